"""Paged decode attention on the GPU: the one-launch (fused split + merge) path against the two-launch path
(split kernel, then reduce kernel), both replayed from CUDA graphs as the model runner does.

    python scripts/bench_decode_attention.py            # fused vs two launches (the default)
    python scripts/bench_decode_attention.py --splits   # also: bandwidth against num_splits (two launches)

Shapes: Llama-3.1-8B (32 query / 8 kv heads) and Qwen3-0.6B (16 / 8), head_dim 128, bf16, 16-token pages,
block tables as wide as max_model_len 8192 (as the latency benchmark's graphs are, so num_splits is the
default a graph gets), batch 1, 8, 64 and 256, every sequence at 128, 512 or 2048 keys or a mix of 128-2048.
A graph holds one call per layer (32 or 28), or more: the calls cycle over enough distinct KV caches (up to
512) that the keys read are not in L2 from the previous replay, as in the model, where each layer's weights
stream through L2 between two attention calls. The two paths' outputs are checked against each other (and
against the PyTorch reference at batch <= 8), and the counters must be all zero after the replays. Ends with
one JSON line.
"""

import argparse
import json
import statistics

import torch

from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref, default_num_splits

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
HEAD_DIM = 128
MODELS = {"llama-3.1-8b": (32, 8, 32), "qwen3-0.6b": (16, 8, 28)}  # query heads, kv heads, layers
BATCHES = [1, 8, 64, 256]
CONTEXTS = [(128, 128), (512, 512), (2048, 2048), (128, 2048)]
# Distinct caches until the working set is this large: above an H100's or H200's L2 (50-60 MB).
WORKING_SET_BYTES = 256 << 20
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def make_inputs(batch: int, lo: int, hi: int, hq: int, hkv: int, width: int, num_caches: int | None = None,
                gen_seed: int = 0) -> dict:
    """Random bf16 queries and paged caches: each sequence's blocks shuffled over the pool, tables width wide."""
    gen = torch.Generator().manual_seed(gen_seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    blocks = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(blocks.sum()) + 1
    cache_bytes = 2 * num_blocks * BLOCK_SIZE * hkv * HEAD_DIM * 2
    if num_caches is None:
        num_caches = max(1, min(512, -(-WORKING_SET_BYTES // cache_bytes)))
    caches = []
    for _ in range(num_caches):
        k = torch.randn(num_blocks, BLOCK_SIZE, hkv, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        caches.append((k, torch.randn_like(k)))
    tables = torch.zeros(batch, width, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    at = 0
    for b, n in enumerate(blocks.tolist()):
        tables[b, :n] = perm[at:at + n]
        at += n
    return {
        "q": torch.randn(batch, hq, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
        "caches": caches,
        "tables": tables.cuda(),
        "seq_lens": lens.to(torch.int32).cuda(),
        "kv_bytes": int(lens.sum()) * hkv * HEAD_DIM * 2 * 2,
    }


def batch_args(description: str) -> argparse.Namespace:
    """--batch, --lo and --hi (contexts uniform in [lo, hi] keys): the throughput recipe's large decode steps."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=2048)
    return p.parse_args()


def time_graph(graph: torch.cuda.CUDAGraph, calls: int, replays: int = 20) -> float:
    """Microseconds per call: replays of a graph holding `calls` calls, timed with CUDA events."""
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def time_fn(fn, calls: int) -> float:
    """Microseconds per call of fn (which makes `calls` calls), captured once in a CUDA graph after a warm-up run
    (which compiles, and lets TunableOp tune, outside the capture); the best of three timings."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return min(time_graph(graph, calls) for _ in range(3))


def compare_case(model: str, batch: int, lo: int, hi: int) -> dict:
    hq, hkv, layers = MODELS[model]
    inp = make_inputs(batch, lo, hi, hq, hkv, MAX_MODEL_LEN // BLOCK_SIZE)
    calls = max(layers, len(inp["caches"]))
    q, tables, seq_lens = inp["q"], inp["tables"], inp["seq_lens"]
    scale = HEAD_DIM**-0.5
    # One output per call, so the check below sees every call's result.
    outs = {path: torch.empty(calls, *q.shape, dtype=q.dtype, device="cuda") for path in ("two", "one")}
    counters = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")

    def step(path: str) -> None:
        for i in range(calls):
            k, v = inp["caches"][i % len(inp["caches"])]
            decode_attention(q, k, v, seq_lens, tables, scale, out=outs[path][i],
                             counters=counters if path == "one" else None)

    graphs = {}
    for path in ("two", "one"):
        step(path)  # compile outside the capture
        torch.cuda.synchronize()
        graphs[path] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[path]):
            step(path)
    # Interleaved repeats, so clock or thermal drift hits both paths alike; the median of each.
    times = {"two": [], "one": []}
    for _ in range(5):
        for path in ("two", "one"):
            times[path].append(time_graph(graphs[path], calls))
    us = {path: statistics.median(t) for path, t in times.items()}

    for path in ("two", "one"):
        outs[path].fill_(float("nan"))
        graphs[path].replay()
    torch.cuda.synchronize()
    assert (counters == 0).all(), "the fused kernel left a counter non-zero"
    assert torch.isfinite(outs["one"]).all()
    torch.testing.assert_close(outs["one"], outs["two"], **BF16_TOL)
    max_diff = (outs["one"].float() - outs["two"].float()).abs().max().item()
    if batch <= 8:
        k, v = inp["caches"][0]
        torch.testing.assert_close(outs["one"][0], decode_attention_ref(q, k, v, seq_lens, tables, scale), **BF16_TOL)
    return {
        "splits": default_num_splits(batch, hkv, MAX_MODEL_LEN),
        "calls_per_graph": calls,
        "two_launch_us": round(us["two"], 2),
        "one_launch_us": round(us["one"], 2),
        "saved_us": round(us["two"] - us["one"], 2),
        "speedup": round(us["two"] / us["one"], 3),
        "one_launch_gb_s": round(inp["kv_bytes"] / us["one"] / 1e3, 1),
        "bitwise_equal": bool(torch.equal(outs["one"], outs["two"])),
        "max_abs_diff": max_diff,
    }


def sweep_splits(batch: int, lo: int, hi: int, max_model_len: int, splits: list[int]) -> dict:
    """Two-launch bandwidth against num_splits (Qwen3-0.6B heads): how default_num_splits was chosen."""
    hq, hkv, _ = MODELS["qwen3-0.6b"]
    inp = make_inputs(batch, lo, hi, hq, hkv, max_model_len // BLOCK_SIZE, num_caches=1)
    (k, v), q = inp["caches"][0], inp["q"]
    out = torch.empty_like(q)
    result = {"default_splits": default_num_splits(batch, hkv, max_model_len)}
    for s in splits + [None]:
        def call(s=s):
            decode_attention(q, k, v, inp["seq_lens"], inp["tables"], HEAD_DIM**-0.5, num_splits=s, out=out)

        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                call()
        us = time_graph(graph, 10, replays=10)
        result[f"splits_{s or 'default'}"] = {"us": round(us, 1), "gb_s": round(inp["kv_bytes"] / us / 1e3, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--splits", action="store_true", help="also sweep num_splits (two-launch path)")
    args = parser.parse_args()
    results: dict = {"bench": "decode_attention", "device": torch.cuda.get_device_name(), "fused_vs_two_launch": {}}
    for model in MODELS:
        for batch in BATCHES:
            for lo, hi in CONTEXTS:
                if batch == 1 and lo != hi:
                    continue  # one sequence: a mixed range is just another fixed length
                key = f"{model}_b{batch}_ctx{lo}-{hi}"
                results["fused_vs_two_launch"][key] = compare_case(model, batch, lo, hi)
                print(key, results["fused_vs_two_launch"][key], flush=True)
                torch.cuda.empty_cache()
    cases = results["fused_vs_two_launch"]
    results["speedup_geomean_by_batch"] = {
        batch: round(statistics.geometric_mean([r["speedup"] for key, r in cases.items() if f"_b{batch}_" in key]), 3)
        for batch in BATCHES
    }
    if args.splits:
        results["splits_sweep"] = {}
        for batch, lo, hi, mml in [(256, 100, 2048, 40960), (256, 100, 2048, 4096), (64, 500, 1100, 4096),
                                   (1, 128, 640, 40960), (1, 128, 640, 4096), (1, 4000, 4000, 8192)]:
            key = f"b{batch}_ctx{lo}-{hi}_mml{mml}"
            results["splits_sweep"][key] = sweep_splits(batch, lo, hi, mml, [1, 2, 4, 8, 16, 32])
            print(key, results["splits_sweep"][key], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
