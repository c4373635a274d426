"""Prefill attention on the GPU with long tiles' keys split across programs (the split map) against the unsplit
tile map, both replayed from CUDA graphs laid out as PrefillGraphRunner lays out a step: tokens padded to the
step's bucket, padded sequences empty, a map as long as the bucket's bound and built on the host per step.

    python scripts/bench_prefill_attention.py

Shapes: Qwen3-0.6B (16 query / 8 kv heads of 128), bf16, 16-token pages, block tables as wide as its
max_model_len (40,960). Cases: (a) 100 new tokens over 2,000 cached ones (the prefix benchmark's cached step),
(b) one 2,100-token prompt, (c) 14 prompts of 100-1,024 tokens, (d) 64 decode rows + one 512-token chunk,
(e) 600 new tokens over 30,000 cached ones. A graph holds one call per layer (28), or more: the calls cycle over
enough distinct KV caches that the keys are not in L2 from the previous call, as in the model. The split path's
output is checked against the unsplit one and the PyTorch reference, and its counters must end at zero. A sweep
over piece sizes (min_keys) and key tile (block_n) for (a) and (e) shows what the split policy leaves on the
table. Ends with one JSON line.
"""

import json
import statistics

import numpy as np
import torch
from bench_decode_attention import time_graph  # scripts/ is on sys.path when a script in it runs

from nanoserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from nanoserve.kernels.split_scratch import SplitScratch
from nanoserve.kernels.tile_map import (
    max_kv_partials,
    max_prefill_tiles,
    prefill_block_m,
    prefill_programs_per_sm,
    prefill_split_map,
    prefill_tile_map,
    split_slots_used,
)
from nanoserve.worker.cuda_graphs import token_ladder

HQ, HKV, HEAD_DIM, BLOCK_SIZE, LAYERS = 16, 8, 128, 16, 28
MAX_MODEL_LEN, MAX_NUM_TOKENS, MAX_NUM_SEQS = 40960, 8192, 256  # Qwen3-0.6B; EngineArgs defaults
# Distinct caches until the working set is this large: above an H100's or H200's L2 (50-60 MB).
WORKING_SET_BYTES = 256 << 20
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def cases() -> dict[str, list[tuple[int, int]]]:
    """(q_len, seq_len) of each sequence of each step."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, 1025, 14).tolist()
    decodes = rng.integers(100, 2049, 64).tolist()
    return {
        "a_cached_100_over_2000": [(100, 2100)],
        "b_prompt_2100": [(2100, 2100)],
        "c_14_prompts_100-1024": [(n, n) for n in prompts],
        "d_64_decodes_and_512_chunk": [(1, n) for n in decodes] + [(512, 512)],
        "e_cached_600_over_30000": [(600, 30600)],
    }


def make_step(lens: list[tuple[int, int]]) -> dict:
    """A step's device tensors padded to its bucket, as PrefillGraphRunner.prepare leaves them."""
    gen = torch.Generator().manual_seed(0)
    q_lens, seq_lens = [q for q, _ in lens], [s for _, s in lens]
    n = sum(q_lens)
    t = next(s for s in token_ladder(MAX_NUM_TOKENS) if s >= n)
    s = min(t, MAX_NUM_SEQS)
    cu = np.cumsum([0] + q_lens).tolist()
    blocks = [-(-x // BLOCK_SIZE) for x in seq_lens]
    num_blocks = sum(blocks) + 1
    cache_bytes = 2 * num_blocks * BLOCK_SIZE * HKV * HEAD_DIM * 2
    caches = []
    for _ in range(max(1, -(-WORKING_SET_BYTES // cache_bytes))):
        k = torch.randn(num_blocks, BLOCK_SIZE, HKV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        caches.append((k, torch.randn_like(k)))
    tables = torch.zeros(s, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    at = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = perm[at : at + nb]
        at += nb
    cu_pad = cu + [n] * (s - len(lens))  # padded sequences bring no tokens
    return {
        "cu": cu,
        "seq_lens": seq_lens,
        "bucket": t,
        "q": torch.randn(t, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
        "caches": caches,
        "cu_dev": torch.tensor(cu_pad, dtype=torch.int32, device="cuda"),
        "seq_lens_dev": torch.tensor(seq_lens + [0] * (s - len(lens)), dtype=torch.int32, device="cuda"),
        "tables": tables.cuda(),
    }




def run_paths(step: dict, paths: dict[str, dict]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median microseconds per call and the last call's output of each path (keyword arguments for
    prefill_attention: tile_map, block_m, split_scratch, block_n), captured and replayed interleaved."""
    q, caches = step["q"], step["caches"]
    calls = max(LAYERS, len(caches))
    outs = {name: torch.empty_like(q) for name in paths}
    graphs = {}
    for name, kwargs in paths.items():

        def call_all(name=name, kwargs=kwargs):
            for i in range(calls):
                k, v = caches[i % len(caches)]
                prefill_attention(q, k, v, step["cu_dev"], step["seq_lens_dev"], step["tables"], q.shape[0],
                                  HEAD_DIM**-0.5, out=outs[name], **kwargs)  # fmt: skip

        call_all()  # compile outside the capture
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            call_all()
    # Interleaved repeats, so clock or thermal drift hits every path alike; the median of each.
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(5):
        for name in paths:
            times[name].append(time_graph(graphs[name], calls))
    for name in paths:
        outs[name].fill_(float("nan"))
        graphs[name].replay()
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}, outs


def maps(step: dict, min_keys: int | None = None) -> tuple[dict, dict]:
    """The unsplit and split paths' arguments for a step, as the graph runner builds them, and split stats."""
    t, cu, seq_lens = step["bucket"], step["cu"], step["seq_lens"]
    s = min(t, MAX_NUM_SEQS)
    block_m = prefill_block_m(t)
    num_tiles = max_prefill_tiles(t, s, block_m)
    max_partials = max_kv_partials(block_m, HQ)
    concurrency = torch.cuda.get_device_properties(0).multi_processor_count * prefill_programs_per_sm(block_m)
    extra = {} if min_keys is None else {"min_keys": min_keys}
    split_map = prefill_split_map(cu, seq_lens, block_m, num_tiles, HQ, concurrency, max_partials, **extra)
    old = {"tile_map": torch.from_numpy(prefill_tile_map(cu, seq_lens, block_m, num_tiles)).cuda(), "block_m": block_m}
    new = {
        "tile_map": torch.from_numpy(split_map).cuda(),
        "block_m": block_m,
        "split_scratch": SplitScratch.allocate(max_partials, HQ, block_m, HEAD_DIM, "cuda"),
    }
    real = split_map[split_map[:, 0] >= 0]
    stats = {
        "bucket": t,
        "block_m": block_m,
        "tiles": int((real[:, 5] == 0).sum()),
        "programs": int(len(real)) * HQ,
        "max_splits": int(real[:, 6].max()),
        "slots": split_slots_used(split_map),
        "grid_rows": num_tiles,  # the same for both paths: pieces take the rows the tiles leave free
    }
    return {"unsplit": old, "split": new}, stats


def check(step: dict, outs: dict[str, torch.Tensor], scratch: SplitScratch) -> float:
    """Split vs unsplit and vs the reference (on the last call's cache); returns the max split-unsplit diff."""
    n = step["cu"][-1]
    got, base = outs["split"][:n], outs["unsplit"][:n]
    assert torch.isfinite(got).all()
    assert (scratch.count == 0).all(), "the split path left a counter non-zero"
    torch.testing.assert_close(got, base, **BF16_TOL)
    k, v = step["caches"][(max(LAYERS, len(step["caches"])) - 1) % len(step["caches"])]
    b = len(step["seq_lens"])
    want = prefill_attention_ref(step["q"][:n], k, v, step["cu_dev"][: b + 1], step["seq_lens_dev"][:b],
                                 step["tables"][:b], 0, HEAD_DIM**-0.5)  # fmt: skip
    torch.testing.assert_close(got, want, **BF16_TOL)
    return (got.float() - base.float()).abs().max().item()


def main() -> None:
    results: dict = {"bench": "prefill_attention", "device": torch.cuda.get_device_name(), "cases": {}, "sweep": {}}
    for name, lens in cases().items():
        step = make_step(lens)
        paths, stats = maps(step)
        us, outs = run_paths(step, paths)
        max_diff = check(step, outs, paths["split"]["split_scratch"])
        results["cases"][name] = {
            "unsplit_us": round(us["unsplit"], 2),
            "split_us": round(us["split"], 2),
            "speedup": round(us["unsplit"] / us["split"], 3),
            "max_abs_diff": max_diff,
            **stats,
        }
        print(name, results["cases"][name], flush=True)
        if name.startswith(("a_", "e_")):
            # Piece sizes and key tiles for the split path: min_keys sets the pieces where the step is small.
            sweep, max_splits = {"unsplit": paths["unsplit"]}, {}
            for min_keys in (256, 512, 1024):
                variants, vstats = maps(step, min_keys)
                max_splits[min_keys] = vstats["max_splits"]
                for block_n in (64, 128):
                    sweep[f"min_keys{min_keys}_block_n{block_n}"] = dict(variants["split"], block_n=block_n)
            sweep_us, _ = run_paths(step, sweep)
            results["sweep"][name] = {"us": {key: round(v, 2) for key, v in sweep_us.items()},
                                      "max_splits_by_min_keys": max_splits}  # fmt: skip
            print(name, "sweep", results["sweep"][name], flush=True)
        del step, outs
        torch.cuda.empty_cache()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
