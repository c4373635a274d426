"""Prefill attention on the GPU as PrefillGraphRunner launches it (a program per kv head serving its query heads,
tiles of prefill_block_m(bucket, pack) query rows, long tiles' keys split by the split map) against the previous
configuration (a program per query head, tiles of an eighth of the bucket's tokens, 128-key tiles, the previous
programs-per-SM guesses), both replayed from CUDA graphs laid out as PrefillGraphRunner lays out a step: tokens
padded to the step's bucket, padded sequences empty, a map as long as the bucket's bound and built on the host.

    python scripts/bench_prefill_attention.py [--quick]

Shapes: Qwen3-0.6B (16 query / 8 kv heads of 128), bf16, 16-token pages, block tables as wide as its
max_model_len (40,960). Cases: (a) 100 new tokens over 2,000 cached ones (the prefix benchmark's cached step),
(b) one 2,100-token prompt, (c) 14 prompts of 100-1,024 tokens, (d) 64 decode rows + one 512-token chunk,
(e) 600 new tokens over 30,000 cached ones, (f) 96 decode rows + a 32-token chunk over 1,000 cached tokens (the
128-token bucket, as (a)). A graph holds one call per layer (28), or more: the calls cycle over
enough distinct KV caches that the keys are not in L2 from the previous call, as in the model. Both paths are
checked against the PyTorch reference and each other, and the split counters must end at zero. Each path's
compiled kernel is listed with its registers, spills and shared memory, and the programs per SM they allow.
A sweep for every case but (f) over tile rows (block_m), piece sizes (min_keys), key tiles (block_n) and pipeline
stages shows what the defaults leave on the table (--quick skips it). Ends with one JSON line.

The previous path runs on this kernel (the map carries the lengths; merges load two partials per trip). The
previous kernel's own figures (H200, 13ca132): (a) 37.3 us per layer, (e) 632 us.
"""

import json
import statistics
import sys

import numpy as np
import torch
from bench_decode_attention import time_graph  # scripts/ is on sys.path when a script in it runs

from nanoserve.kernels import prefill_attention as pa
from nanoserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from nanoserve.kernels.split_scratch import SplitScratch
from nanoserve.kernels.tile_map import (
    MIN_SPLIT_KEYS,
    max_kv_partials,
    max_prefill_tiles,
    prefill_block_m,
    prefill_block_n,
    prefill_programs_per_sm,
    prefill_split_map,
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
    small_step_decodes = rng.integers(100, 2049, 96).tolist()
    return {
        "a_cached_100_over_2000": [(100, 2100)],
        "b_prompt_2100": [(2100, 2100)],
        "c_14_prompts_100-1024": [(n, n) for n in prompts],
        "d_64_decodes_and_512_chunk": [(1, n) for n in decodes] + [(512, 512)],
        "e_cached_600_over_30000": [(600, 30600)],
        "f_96_decodes_and_32_chunk": [(1, n) for n in small_step_decodes] + [(32, 1032)],
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


# Resources of first compiles, by (block_m, block_n, pack, num_stages, partials' dtype, num_warps).
_RESOURCES: dict[tuple, dict] = {}


def _compiled_kernels() -> dict:
    """The prefill kernel's compiled variants so far, by Triton's cache key."""
    caches = getattr(pa._prefill_attention_kernel, "device_caches", {})
    return {key: kernel for cache in caches.values() for key, kernel in cache[0].items()}


def _resources(kernel) -> dict:
    """Registers, spills, shared memory and warps of a compiled kernel, and the programs per SM they allow on an
    H100/H200 (64K registers, allocated 256 per warp; 228 KB of shared memory, 1 KB of it reserved per block)."""
    try:
        regs, warps, shared = kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared
        by_regs = 65536 // (-(-regs * 32 // 256) * 256 * warps)
        by_smem = (228 << 10) // (shared + 1024)
        return {"regs": regs, "spills": kernel.n_spills, "shared": shared, "warps": warps,
                "programs_per_sm": min(by_regs, by_smem, 64 // warps, 32)}  # fmt: skip
    except AttributeError as e:  # another Triton's layout
        return {"unknown": str(e)}


def run_paths(step: dict, paths: dict[str, dict]) -> tuple[dict[str, float], dict[str, torch.Tensor], dict]:
    """Median microseconds per call, the last call's output and the compiled kernel's resources of each path
    (keyword arguments for prefill_attention: tile_map, block_m, split_scratch, pack, block_n, num_stages, num_warps),
    captured and replayed interleaved."""
    q, caches = step["q"], step["caches"]
    calls = max(LAYERS, len(caches))
    outs = {name: torch.empty_like(q) for name in paths}
    graphs, resources = {}, {}
    for name, kwargs in paths.items():

        def call_all(name=name, kwargs=kwargs):
            for i in range(calls):
                k, v = caches[i % len(caches)]
                prefill_attention(q, k, v, step["cu_dev"], step["seq_lens_dev"], step["tables"], q.shape[0],
                                  HEAD_DIM**-0.5, out=outs[name], **kwargs)  # fmt: skip

        before = set(_compiled_kernels())
        call_all()  # compile outside the capture
        torch.cuda.synchronize()
        config = (kwargs["block_m"], kwargs.get("block_n") or prefill_block_n(HEAD_DIM, 2, kwargs["block_m"]),
                  kwargs["pack"], kwargs.get("num_stages", 2), kwargs["split_scratch"].out.dtype,
                  kwargs.get("num_warps"))  # fmt: skip
        new = [k for key, k in _compiled_kernels().items() if key not in before]
        if new:
            _RESOURCES[config] = _resources(new[0])
        resources[name] = {"block_n": config[1], **_RESOURCES.get(config, {})}
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
    return {name: statistics.median(t) for name, t in times.items()}, outs, resources


def _old_block_m(num_tokens: int) -> int:
    """The previous tile height: an eighth of the step's tokens, 16 to 128."""
    return min(128, max(16, (1 << max(num_tokens - 1, 0).bit_length()) // 8))


def path(step: dict, pack: int, block_m: int, programs_per_sm: int, min_keys: int = MIN_SPLIT_KEYS,
         scratch_dtype: torch.dtype = torch.float32, exact: bool = False, **launch) -> tuple[dict, dict]:  # fmt: skip
    """prefill_attention's arguments for a step with this configuration, its map built as the graph runner
    builds one (exact: cut to its live rows, to see what the padding rows' programs cost), and the map's stats."""
    t, cu, seq_lens = step["bucket"], step["cu"], step["seq_lens"]
    heads = HQ // pack
    num_rows = max_prefill_tiles(t, min(t, MAX_NUM_SEQS), block_m, pack)
    max_partials = max_kv_partials(block_m, heads)
    concurrency = torch.cuda.get_device_properties(0).multi_processor_count * programs_per_sm
    split_map = prefill_split_map(cu, seq_lens, block_m, num_rows, heads, concurrency, max_partials, min_keys, pack)
    real = split_map[split_map[:, 0] >= 0]
    if exact:
        split_map = np.ascontiguousarray(split_map[: len(real)])
        num_rows = len(real)
    kwargs = {
        "tile_map": torch.from_numpy(split_map).cuda(),
        "block_m": block_m,
        "split_scratch": SplitScratch.allocate(max_partials, heads, block_m, HEAD_DIM, "cuda", scratch_dtype),
        "pack": pack,
        **launch,
    }
    keys = real[:, 3] - real[:, 2]
    stats = {
        "block_m": block_m,
        "pack": pack,
        "tiles": int((real[:, 5] == 0).sum()),
        "programs": int(len(real)) * heads,
        "waves": round(len(real) * heads / concurrency, 2),  # at the assumed programs per SM
        "max_splits": int(real[:, 6].max()),
        "keys_per_program": [int(keys.min()), int(keys.max())],
        "slots": split_slots_used(split_map),
        "grid": num_rows * heads,
    }
    return kwargs, stats


def default_paths(step: dict) -> tuple[dict, dict]:
    """The new path (as PrefillGraphRunner builds it) and the previous configuration."""
    t = step["bucket"]
    pack = HQ // HKV
    new, new_stats = path(step, pack, prefill_block_m(t, pack), prefill_programs_per_sm(prefill_block_m(t, pack)))
    old_m = _old_block_m(t)
    old, old_stats = path(step, 1, old_m, {16: 3, 32: 2}.get(old_m, 1), block_n=128)
    return {"old": old, "new": new}, {"old": old_stats, "new": new_stats}


def check(step: dict, outs: dict[str, torch.Tensor], paths: dict[str, dict]) -> float:
    """Every path vs the reference (on the last call's cache) and vs each other; returns the max difference
    between the paths."""
    n, b = step["cu"][-1], len(step["seq_lens"])
    k, v = step["caches"][(max(LAYERS, len(step["caches"])) - 1) % len(step["caches"])]
    want = prefill_attention_ref(step["q"][:n], k, v, step["cu_dev"][: b + 1], step["seq_lens_dev"][:b],
                                 step["tables"][:b], 0, HEAD_DIM**-0.5)  # fmt: skip
    for name, kwargs in paths.items():
        got = outs[name][:n]
        assert torch.isfinite(got).all(), name
        assert (kwargs["split_scratch"].count == 0).all(), f"{name} left a split counter non-zero"
        torch.testing.assert_close(got, want, **BF16_TOL)
    first = outs[next(iter(paths))][:n].float()
    return max((outs[name][:n].float() - first).abs().max().item() for name in paths)


# (block_m, min_keys, launch options) around the defaults: tile rows, piece sizes (and so splits and waves), key
# tiles, pipeline stages, and partial outputs in bf16 (what the merge's reads cost).
SWEEP = {
    "a_": [(32, 128, {}), (32, 256, {}), (32, 512, {}), (64, 128, {}),
           (64, 256, {}), (64, 384, {}), (64, 512, {}), (64, 256, {"block_n": 128}),
           (64, 256, {"num_stages": 3}), (64, 256, {"scratch_dtype": torch.bfloat16}), (128, 256, {}),
           (128, 512, {}), (128, 256, {"block_n": 64}), (128, 256, {"scratch_dtype": torch.bfloat16}),
           (64, 256, {"exact": True}), (32, 256, {"exact": True}), (64, 512, {"exact": True})],
    "b_": [(128, 256, {}), (64, 256, {}), (64, 256, {"num_stages": 3})],
    "c_": [(128, 256, {}), (128, 256, {"block_n": 64}), (128, 256, {"num_stages": 3}), (128, 256, {"num_warps": 4}),
           (128, 256, {"block_n": 64, "num_stages": 3}), (64, 256, {}), (64, 256, {"block_n": 128}),
           (64, 256, {"num_warps": 8}), (64, 256, {"num_stages": 3}), (32, 256, {})],
    "d_": [(128, 256, {}), (64, 256, {}), (64, 256, {"num_stages": 3}), (32, 256, {}), (64, 256, {"exact": True})],
    "f_": [(64, 256, {}), (64, 256, {"exact": True})],
    "e_": [(64, 256, {}), (128, 256, {}), (128, 256, {"block_n": 64}), (128, 256, {"num_stages": 3}),
           (128, 256, {"scratch_dtype": torch.bfloat16})],
}  # fmt: skip


def sweep_paths(step: dict, name: str) -> dict:
    """The SWEEP variants of a case, all with a program per kv head."""
    pack = HQ // HKV
    paths, stats = {}, {}
    for block_m, min_keys, launch in SWEEP[name[:2]]:
        key = "_".join([f"m{block_m}", f"keys{min_keys}", *(f"{k}={str(v).removeprefix('torch.')}"
                                                             for k, v in launch.items())])  # fmt: skip
        paths[key], s = path(step, pack, block_m, prefill_programs_per_sm(block_m), min_keys, **launch)
        stats[key] = {k: s[k] for k in ("programs", "waves", "max_splits", "keys_per_program")}
    us, outs, resources = run_paths(step, paths)
    check(step, outs, paths)
    return {key: {"us": round(us[key], 2), **stats[key], **resources.get(key, {})} for key in paths}


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    results: dict = {"bench": "prefill_attention", "device": torch.cuda.get_device_name(), "cases": {}, "sweep": {}}
    for name, lens in cases().items():
        step = make_step(lens)
        paths, stats = default_paths(step)
        us, outs, resources = run_paths(step, paths)
        max_diff = check(step, outs, paths)
        results["cases"][name] = {
            "bucket": step["bucket"],
            "old_us": round(us["old"], 2),
            "new_us": round(us["new"], 2),
            "speedup": round(us["old"] / us["new"], 3),
            "max_abs_diff": max_diff,
            "old": {**stats["old"], **resources.get("old", {})},
            "new": {**stats["new"], **resources.get("new", {})},
        }
        print(name, json.dumps(results["cases"][name]), flush=True)
        if not quick and name.startswith(tuple(SWEEP)):
            results["sweep"][name] = sweep_paths(step, name)
            for key, row in sorted(results["sweep"][name].items(), key=lambda kv: kv[1]["us"]):
                print(f"  {name} {key}: {json.dumps(row)}", flush=True)
        del step, outs
        torch.cuda.empty_cache()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
