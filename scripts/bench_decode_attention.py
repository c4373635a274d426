"""Paged decode attention's achieved bandwidth against num_splits, on the GPU, for batch shapes the
benchmarks produce (Qwen3-0.6B heads: 16 query / 8 kv heads of 128, bf16, 16-token pages).

    python scripts/bench_decode_attention.py
Ends with one JSON line: for each (batch, context range), GB/s per split count.
"""

import json

import torch

from nanoserve.kernels.decode_attention import decode_attention, default_num_splits


def case(batch: int, lo: int, hi: int, max_model_len: int, splits: list[int]) -> dict:
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 16, 8, 128, 16
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    blocks = (lens + bs - 1) // bs
    num_blocks = int(blocks.sum()) + 1
    k = torch.randn(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    width = max_model_len // bs  # as in a CUDA graph: the table is as wide as the longest context
    tables = torch.zeros(batch, width, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    at = 0
    for b, n in enumerate(blocks.tolist()):
        tables[b, :n] = perm[at:at + n]
        at += n
    tables, seq_lens = tables.cuda(), lens.to(torch.int32).cuda()
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    kv_bytes = int(lens.sum()) * hkv * d * 2 * 2
    result = {"default_splits": default_num_splits(batch, hkv, width * bs)}
    for s in splits + [None]:
        def call(s=s):
            decode_attention(q, k, v, seq_lens, tables, d**-0.5, num_splits=s, out=out)

        for _ in range(3):
            call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / 100
        result[f"splits_{s or 'default'}"] = {"us": round(us, 1), "gb_s": round(kv_bytes / us / 1e3, 1)}
    return result


def main() -> None:
    results = {}
    for batch, lo, hi, mml in [(256, 100, 2048, 40960), (256, 100, 2048, 4096), (64, 500, 1100, 4096),
                               (1, 128, 640, 40960), (1, 128, 640, 4096), (1, 4000, 4000, 8192)]:
        key = f"b{batch}_ctx{lo}-{hi}_mml{mml}"
        results[key] = case(batch, lo, hi, mml, [1, 2, 4, 8, 16, 32])
        print(key, results[key], flush=True)
    print(json.dumps({"bench": "decode_attention", "device": torch.cuda.get_device_name(), **results}))


if __name__ == "__main__":
    main()
