"""Measures fused_moe's tile sizes for one MoE shape on this GPU and writes the table that fused_moe reads them from
(nanoserve/kernels/fused_moe_configs/E=..,H=..,I=..,device=<GPU name>.json). Prints one JSON line last.

    python scripts/tune_fused_moe.py                          # Qwen3-30B-A3B: E=128, H=2048, I=768, top_k=8
    python scripts/tune_fused_moe.py --preset mixtral-8x7b    # E=8, H=4096, I=14336, top_k=2
    python scripts/tune_fused_moe.py --inter 384              # the same model's experts at TP=2
    python scripts/tune_fused_moe.py --num-experts 64 --ep-size 2   # at EP=2: 64 of 128 experts on this rank

For each token count M, in bf16 with random routing (near uniform, the worst case for bytes, as random weights
route), every candidate is timed in a CUDA graph of 8 calls, each with its own routing: launch overhead is left
out as in the engine's decode graphs, and 8 routings' experts are too many bytes to stay in L2 between calls.
The search, pruned to finish in a few minutes a shape on an H100:
- BLOCK_M (shared by both GEMMs: it is the alignment's block) from the rows an expert gets on average, r = M top_k /
  (E ep_size): 16 while r <= 8, then powers of two from about r / 4 to 2 r, between 16 and 128;
- for each BLOCK_M, the gate/up and the down GEMM separately (each keeps its best): skinny blocks (<= 32 rows:
  weight streaming) over narrow tiles N 32-128, K 64-256 and 3-5 pipeline stages; wide blocks (compute) over N
  64-256, K 64-128, 4 or 8 warps, 3-4 stages and grouped ordering; those whose pipeline would not fit in shared
  memory or whose accumulators would spill are left out;
- the BLOCK_M with the least time for alignment + both GEMMs wins.
Every candidate kernel is compiled first, in parallel processes (the Triton cache then serves the timing runs).
"""

import argparse
import functools
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import torch
import triton
from tqdm import tqdm

from nanoserve.kernels import fused_moe as fm
from nanoserve.kernels.fused_moe import GemmConfig, MoeConfig
from nanoserve.kernels.moe_align import moe_align_block_size

PRESETS = {
    "qwen3-30b-a3b": dict(num_experts=128, hidden=2048, inter=768, top_k=8, activation="silu", bias=False),
    "mixtral-8x7b": dict(num_experts=8, hidden=4096, inter=14336, top_k=2, activation="silu", bias=False),
    "gpt-oss-20b": dict(num_experts=32, hidden=2880, inter=2880, top_k=4, activation="swigluoai", bias=True),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
ROUTINGS = 8
TIMED_MS = 5.0  # replays of a candidate's graph per timing, about
SHARED_MEMORY = 200 * 1024  # of an H100's 227 KB a block, leaving room for the epilogue's layout conversions
ACC_PER_THREAD = 128  # fp32 accumulator values a thread may hold without spilling


@dataclass(frozen=True)
class Shape:
    num_experts: int
    hidden: int
    inter: int
    top_k: int
    ep_size: int
    activation: str
    bias: bool


def block_m_candidates(m: int, shape: Shape) -> list[int]:
    rows = m * shape.top_k / (shape.num_experts * shape.ep_size)
    p = triton.next_power_of_2(max(1, math.ceil(rows)))
    if p <= 8:
        return [16]
    return [bm for bm in (16, 32, 64, 128) if min(64, max(16, p // 4)) <= bm <= min(128, 2 * p)]


def gemm_candidates(block_m: int, n: int, k: int, tiles: int) -> list[GemmConfig]:
    """tiles: weight tiles a K step loads (2 for gate/up, 1 for down)."""
    def fit(block: int, size: int) -> int:
        return min(block, max(16, triton.next_power_of_2(size)))

    if block_m <= 32:
        space = [(bn, bk, 1, 4, st) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)]
    else:
        space = [(bn, bk, 8, w, st) for bn in (64, 128, 256) for bk in (64, 128) for w in (4, 8) for st in (3, 4)]
    out = []
    for bn, bk, group, warps, stages in space:
        bn, bk = fit(bn, n), fit(bk, k)
        stage_bytes = (block_m * bk + tiles * bn * bk) * 2
        if stages * stage_bytes > SHARED_MEMORY or tiles * block_m * bn > ACC_PER_THREAD * 32 * warps:
            continue
        cfg = GemmConfig(bn, bk, group, warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


def _weights(shape: Shape, num_experts: int, device: str):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(torch.bfloat16)

    e, h, i = num_experts, shape.hidden, shape.inter
    w13, w2 = randn(e, 2 * i, h, scale=h**-0.5), randn(e, h, i, scale=i**-0.5)
    b13, b2 = (randn(e, 2 * i), randn(e, h)) if shape.bias else (None, None)
    return w13, w2, b13, b2


def _routing(m: int, shape: Shape, gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(m, shape.num_experts * shape.ep_size, generator=gen, device=device)
    weights, ids = logits.softmax(-1).topk(shape.top_k, dim=-1)
    return ids, weights


def _compile_jobs(shape: Shape, jobs: list[tuple[int, str, GemmConfig]]) -> int:
    """Runs each (block_m, gemm, config) once on one expert's weights and one token, which specializes the kernels
    exactly as the timing runs do (same strides and constants), so the Triton cache holds them. Returns failures."""
    device = "cuda"
    w13, w2, b13, b2 = _weights(shape, 1, device)
    x = torch.randn(1, shape.hidden, device=device).bfloat16()
    ids = torch.zeros(1, shape.top_k, dtype=torch.int64, device=device)
    topk_weights = torch.ones(1, shape.top_k, device=device)
    h = torch.randn(shape.top_k, shape.inter, device=device).bfloat16()
    failures = 0
    for block_m, gemm, cfg in jobs:
        try:
            align = moe_align_block_size(ids, 1, block_m)
            if gemm == "gate_up":
                fm.moe_gate_up(x, w13, b13, align, shape.top_k, shape.activation, cfg)
            else:
                fm.moe_down(h, w2, b2, topk_weights, align, cfg)
            torch.cuda.synchronize()
        except Exception:  # out of resources: the timing run skips it too
            failures += 1
    return failures


def precompile(shape: Shape, tokens: list[int]) -> tuple[float, int]:
    """Compiles every candidate of every M in parallel processes; returns the seconds it took and the candidates
    that failed to compile or launch. Should the workers fail, the timing runs compile what they need."""
    start = time.perf_counter()
    jobs = sorted({(bm, gemm, cfg) for m in tokens for bm in block_m_candidates(m, shape)
                   for gemm, cfgs in (("gate_up", gemm_candidates(bm, shape.inter, shape.hidden, 2)),
                                      ("down", gemm_candidates(bm, shape.hidden, shape.inter, 1)))
                   for cfg in cfgs}, key=str)
    workers = max(1, min(16, os.cpu_count() or 1, len(jobs)))
    chunks = [jobs[i::workers] for i in range(workers)]
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            failures = sum(tqdm(pool.map(_compile_jobs, [shape] * workers, chunks), total=workers,
                                desc=f"compiling {len(jobs)} kernels"))
    except Exception as e:
        print(f"parallel compilation failed ({e!r}); compiling as the timing goes")
        failures = -1
    return time.perf_counter() - start, failures


def time_us(calls: list[Callable[[], object]]) -> float:
    """Mean microseconds of one call, over replays of a CUDA graph of all of them (on the CPU, the interpreter
    running them once: for checking this script, not for timing)."""
    for call in calls:  # compiles, and a config that cannot launch fails here, outside the capture
        call()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = max(1, min(50, int(TIMED_MS / max(begin.elapsed_time(end), 1e-3))))
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1000 / reps / len(calls)


def best_of(cfgs: list[GemmConfig], calls_for: Callable[[GemmConfig], list[Callable[[], object]]],
            bar: tqdm) -> tuple[GemmConfig, float]:
    best, best_us, error = None, math.inf, None
    for cfg in cfgs:
        try:
            us = time_us(calls_for(cfg))
        except Exception as e:  # out of resources on this device
            error = e
            us = math.inf
        if us < best_us:
            best, best_us = cfg, us
        bar.update()
    if best is None:
        raise RuntimeError(f"no candidate config ran; the last error: {error!r}")
    return best, best_us


def _gate_up_calls(x, w13, b13, aligns, shape: Shape, cfg: GemmConfig) -> list[Callable[[], object]]:
    return [functools.partial(fm.moe_gate_up, x, w13, b13, a, shape.top_k, shape.activation, cfg) for a in aligns]


def _down_calls(hs, w2, b2, routings, aligns, cfg: GemmConfig) -> list[Callable[[], object]]:
    return [functools.partial(fm.moe_down, h, w2, b2, tw, a, cfg)
            for h, (_, tw), a in zip(hs, routings, aligns, strict=True)]


def tune(m: int, shape: Shape, weights, device: str, bar: tqdm) -> dict:
    """The best config for M tokens, its time and the default rule's (whole fused_moe, in microseconds)."""
    w13, w2, b13, b2 = weights
    e, k = shape.num_experts, shape.top_k
    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, shape.hidden, generator=gen, device=device).bfloat16()
    routings = [_routing(m, shape, gen, device) for _ in range(ROUTINGS)]
    best = None
    for bm in block_m_candidates(m, shape):
        aligns = [moe_align_block_size(ids, e, bm) for ids, _ in routings]
        align_us = time_us([functools.partial(moe_align_block_size, ids, e, bm) for ids, _ in routings])
        up, up_us = best_of(gemm_candidates(bm, shape.inter, shape.hidden, 2),
                            functools.partial(_gate_up_calls, x, w13, b13, aligns, shape), bar)
        hs = [call() for call in _gate_up_calls(x, w13, b13, aligns, shape, up)]
        down, down_us = best_of(gemm_candidates(bm, shape.hidden, shape.inter, 1),
                                functools.partial(_down_calls, hs, w2, b2, routings, aligns), bar)
        total = align_us + up_us + down_us
        if best is None or total < best[1]:
            best = (MoeConfig(bm, up, down), total)

    def whole(cfg: MoeConfig) -> float:
        return time_us([functools.partial(fm.fused_moe_with_config, x, w13, w2, tw, ids, cfg, w13_bias=b13,
                                          w2_bias=b2, activation=shape.activation) for ids, tw in routings])

    default = fm.default_config(m, e, shape.hidden, shape.inter, k)
    return {"config": best[0], "us": round(whole(best[0]), 2), "default_us": round(whole(default), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b",
                        help="model shape; the flags below override its values")
    parser.add_argument("--num-experts", type=int, help="experts on this rank (E of the table's name)")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--inter", type=int, help="each expert's intermediate size on this rank (I)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--activation", choices=fm.ACTIVATIONS)
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--ep-size", type=int, default=1,
                        help="expert parallel ranks: tokens route over E * ep-size experts, this rank's E get theirs")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts M")
    parser.add_argument("--out-dir", default=str(fm.CONFIG_DIR))
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    shape = Shape(**{key: getattr(args, key) if getattr(args, key) is not None else preset[key] for key in preset},
                  ep_size=args.ep_size)
    tokens = [int(t) for t in args.tokens.split(",")]
    start = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    compile_s, compile_failures = precompile(shape, tokens) if on_gpu else (0.0, 0)
    weights = _weights(shape, shape.num_experts, device)
    total = sum(len(gemm_candidates(bm, shape.inter, shape.hidden, 2)) +
                len(gemm_candidates(bm, shape.hidden, shape.inter, 1))
                for m in tokens for bm in block_m_candidates(m, shape))
    results = {}
    with tqdm(total=total, desc="timing") as bar:
        for m in tokens:
            bar.set_postfix(M=m)
            results[m] = tune(m, shape, weights, device, bar)
    device_name = torch.cuda.get_device_name() if on_gpu else "cpu"
    path = fm.config_file(shape.num_experts, shape.hidden, shape.inter, device_name)
    path = os.path.join(args.out_dir, path.name)
    os.makedirs(args.out_dir, exist_ok=True)
    meta = {**asdict(shape), "dtype": "bfloat16", "device": device_name, "triton": triton.__version__,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(path, "w") as f:
        json.dump({"meta": meta, "configs": {str(m): r["config"].to_json() for m, r in results.items()},
                   "us": {str(m): r["us"] for m, r in results.items()}}, f, indent=1)
        f.write("\n")
    print(json.dumps({"file": path, **meta, "seconds": round(time.perf_counter() - start, 1),
                      "compile_seconds": round(compile_s, 1), "compile_failures": compile_failures,
                      "us": {m: r["us"] for m, r in results.items()},
                      "default_us": {m: r["default_us"] for m, r in results.items()},
                      "block_m": {m: r["config"].block_m for m, r in results.items()}}))


if __name__ == "__main__":
    main()
