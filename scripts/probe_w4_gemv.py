"""Times the one-row W4A16 GEMV (nanoserve/kernels/w4a16_gemv.py, label "hoisted") over tile configs against the
engine's pick (kernels/w4a16_gemm.py's w4a16_linear at M = 1, label "current": the GEMV at gemv_config's tiles; until
issue #41 another kernel, and a "magic" variant was timed too), that file's tensor-core GEMM forced at one row
("tc": x padded to 16 rows, a few tile sizes and splits) and the bf16 GEMV (kernels/gemv.py's skinny_linear) at
Llama-3.1-8B's four projections, one row (issue #41). Prints a table and, last, one JSON line
{shape: {variant: {"us": best, "config": {...}}}}.

    python scripts/probe_w4_gemv.py                      # all shapes and variants, about 1-2 minutes on an H200
    python scripts/probe_w4_gemv.py --shapes o down --variants hoisted
    TRITON_INTERPRET=1 python scripts/probe_w4_gemv.py --tiny   # on the CPU: checks the script, times nothing real

Weights are random in the W4 layout (w4_packing.pack of random 4-bit values, fp16 scales, uint8 zero points as AWQ
has them, group 128), x is bf16. Every variant and config is first checked against the layout's PyTorch reference
(w4a16_reference: dequantize, matmul in fp32); one that fails to compile or run, or is wrong, is reported and left
out. Then each is timed as a CUDA graph of 20 calls, replayed 50 times (median replay): the calls cycle over copies
of the weight totalling at least ROTATE_BYTES, so that, as in a decode step, no call finds its weight in the 50 MB L2.
PDL is off for the bf16 GEMV unless --pdl (the W4 kernels do not use it), so the comparison is of the kernels alone.
"""

import argparse
import functools
import json
import math
import os
import statistics
import traceback
from collections.abc import Callable

import torch
import triton

from nanoserve.kernels import pdl, w4a16_gemm
from nanoserve.kernels.gemv import skinny_linear
from nanoserve.kernels.w4a16_gemm import w4a16_linear
from nanoserve.kernels.w4a16_gemv import GemvConfig, w4a16_gemv
from nanoserve.kernels.w4a16_reference import w4a16_linear_ref
from nanoserve.quantization.w4_packing import pack

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
TINY_SHAPES = {"tiny": (256, 96)}
GROUP = 128
CALLS = 20
REPLAYS = 50
ROTATE_BYTES = 200 << 20  # four times an H200's L2
# (block_n, block_k, num_warps, num_stages, ahead). A thread holds 4 adjacent columns of the tile, times
# block_n / (128 num_warps) where that exceeds 1 (it then shares its x work over 8), and (block_k / 8) x 128 /
# block_n / 32 rows; the int32s 1 + ahead times over. block_n = 128 num_warps keeps the scales' layout the tile's
# (no shared-memory pass); stages > 1 lets Triton's own pipeliner try too.
TILES = [(128, 128, 4, 1, 2), (128, 128, 4, 1, 1), (128, 128, 8, 1, 2), (512, 32, 4, 1, 2), (256, 32, 2, 1, 2),
         (1024, 16, 4, 1, 2), (512, 16, 2, 1, 2), (512, 32, 2, 1, 1), (128, 128, 4, 3, 2)]
SPLITS = [1, 2, 4, 8, 16, 32]
MIN_PROGRAMS = 128  # fewer leave SMs idle: such configs are not timed
# The tensor-core path at one row (w4a16_gemm.py's GEMM kernel, x padded to 16 rows): (block_n, split).
TC_TILES = [(64, 1), (64, 2), (64, 4), (128, 1), (128, 2), (128, 4), (128, 8)]
TINY_TILES, TINY_SPLITS = [(32, 32, 2, 1, 2), (32, 32, 2, 1, 1)], [1, 3]
VARIANTS = ("hoisted",)


def random_w4(k: int, n: int, device: str, gen: torch.Generator):
    values = torch.randint(0, 16, (k, n), generator=gen, device=device, dtype=torch.uint8)
    qweight = pack(values, 0)
    scales = (torch.rand(k // GROUP, n, generator=gen, device=device) * 0.02 + 0.005).half()
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=gen, device=device, dtype=torch.uint8)
    return qweight, scales, zeros


def weight_copies(nbytes: int) -> int:
    return max(1, min(CALLS, math.ceil(ROTATE_BYTES / nbytes)))


def tc_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, block_n: int,
              split: int) -> torch.Tensor:
    """w4a16_linear's tensor-core branch forced at one row (16-row tiles, K split `split` ways, summed by a second
    launch), without act-order or bias."""
    m, k = x.shape
    n = qweight.shape[1]
    block_k = min(128, GROUP)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    w4a16_gemm._w4a16_gemm_kernel[(triton.cdiv(n, block_n), 1, split)](
        x, qweight, scales, zeros, qweight, scales, target, m, n, k, x.stride(0), k_per_split, GROUP=GROUP,
        HAS_ZEROS=True, HAS_PERM=False, HAS_BIAS=False, SPLIT=split, DOT_PRECISION="tf32", EVEN_N=n % block_n == 0,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    if split > 1:
        w4a16_gemm._sum_splits_kernel[(triton.cdiv(m * n, 1024),)](target, target, out, m * n, n, SPLIT=split,
                                                                   HAS_BIAS=False, BLOCK=1024)
    return out


def rotating(fn: Callable[[object], object], items: list) -> list[Callable[[], object]]:
    """CALLS calls of fn, cycling over items (the weight's copies)."""
    return [functools.partial(fn, items[i % len(items)]) for i in range(CALLS)]


def time_us(calls: list[Callable[[], object]]) -> float:
    """Median microseconds of one call over replays of a CUDA graph of the calls (on the CPU, one pass: for
    checking this script only)."""
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for begin, end in events:
        begin.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) for b, e in events) * 1000 / len(calls)


def check(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if got is want to bf16's precision (1e-2 relative, plus 1e-2 of the mean magnitude), else why not."""
    err = (got.float() - want.float()).abs()
    bound = 1e-2 * want.float().abs() + 1e-2 * want.float().abs().mean()
    if torch.isfinite(got.float()).all() and bool((err <= bound).all()):
        return None
    return f"wrong: max abs err {err.max().item():.3g} (max |ref| {want.float().abs().max().item():.3g})"


def probe_shape(name: str, k: int, n: int, variants: list[str], tiles, splits, tc_tiles, device: str,
                gen: torch.Generator) -> dict:
    # bf16 as the model runs; fp16 on the CPU, whose interpreter mishandles bf16 in tl.dot.
    act_dtype = torch.bfloat16 if device == "cuda" else torch.float16
    x = torch.randn(1, k, generator=gen, device=device).to(act_dtype)
    qweight, scales, zeros = random_w4(k, n, device, gen)
    w4_bytes = qweight.numel() * 4 + scales.numel() * 2 + zeros.numel()
    copies = [(qweight, scales, zeros)] + [(qweight.clone(), scales.clone(), zeros.clone())
                                           for _ in range(weight_copies(w4_bytes) - 1)]
    want = w4a16_linear_ref(x, qweight, scales, zeros, None, GROUP)
    # The split's arrival counters, as a layer holds them (made before the graphs; every launch leaves them zero),
    # for column tiles of 16 or more.
    counters = torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)
    results: dict[str, dict] = {}

    def run(label: str, config: dict, fn: Callable[[tuple], torch.Tensor], copies: list[tuple]) -> None:
        try:
            problem = check(fn(copies[0]), want)
            if problem is None:
                us = time_us(rotating(fn, copies))
        except Exception as e:  # a config that does not compile or launch here
            problem = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if os.environ.get("PROBE_TRACEBACK"):
                traceback.print_exc()
        if problem is not None:
            print(f"  {name:8s} {label:8s} {json.dumps(config):60s} {problem}")
            return
        best = results.get(label)
        if best is None or us < best["us"]:
            results[label] = {"us": round(us, 2), "config": config}

    run("current", {}, lambda c: w4a16_linear(x, *c, None, GROUP, None, counters), copies)
    if "tc" in variants:
        for block_n, split in tc_tiles:
            cfg = dict(block_n=block_n, split=split)
            run("tc", cfg, lambda c, cfg=cfg: tc_linear(x, *c, **cfg), copies)
    for variant in (v for v in variants if v in VARIANTS):
        for block_n, block_k, warps, stages, ahead in tiles:
            for split in splits:
                programs = triton.cdiv(n, block_n) * split
                if split > max(1, k // min(block_k, GROUP)) or (device == "cuda" and programs < MIN_PROGRAMS):
                    continue
                cfg = dict(block_n=block_n, block_k=block_k, split=split, num_warps=warps, num_stages=stages,
                           ahead=ahead)
                run(variant, cfg, lambda c, cfg=cfg: w4a16_gemv(x, *c, None, GROUP, None, counters,
                                                                         GemvConfig(**cfg)),
                    copies)
    del copies
    # The bf16 GEMV on the same shape: its weight [N, K], the copies again past L2.
    dense = torch.randn(n, k, generator=gen, device=device).to(act_dtype) * 0.02
    dense_copies = [dense] + [dense.clone() for _ in range(weight_copies(dense.numel() * 2) - 1)]
    want_bf16 = (x.float() @ dense.float().T).to(act_dtype)
    try:
        problem = check(skinny_linear(x, dense), want_bf16)
        if problem is None:
            us = time_us(rotating(lambda w: skinny_linear(x, w), dense_copies))
            results["bf16"] = {"us": round(us, 2), "config": {}}
        else:
            print(f"  {name:8s} bf16     {problem}")
    except Exception as e:
        print(f"  {name:8s} bf16     failed: {type(e).__name__}: {e}")
    results["_bytes"] = {"w4": w4_bytes, "bf16": dense.numel() * 2}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, "tc"], default=[*VARIANTS, "tc"])
    parser.add_argument("--pdl", action="store_true", help="let the bf16 GEMV launch with PDL")
    parser.add_argument("--tiny", action="store_true", help="one small shape and config (for the CPU interpreter)")
    args = parser.parse_args()
    pdl.set_pdl(args.pdl)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = TINY_SHAPES if args.tiny else {s: SHAPES[s] for s in args.shapes}
    tiles, splits, tc_tiles = (TINY_TILES, TINY_SPLITS, [(32, 2)]) if args.tiny else (TILES, SPLITS, TC_TILES)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (interpreter: times are not measured)"
    print(f"{gpu}, triton {triton.__version__}, torch {torch.__version__}, bf16 PDL {'on' if args.pdl else 'off'}")
    summary = {}
    for name, (k, n) in shapes.items():
        results = probe_shape(name, k, n, args.variants, tiles, splits, tc_tiles, device, gen)
        nbytes = results.pop("_bytes")
        summary[name] = results
        base = results.get("current", {}).get("us")
        print(f"\n{name}: K={k} N={n}, W4 {nbytes['w4'] / 1e6:.1f} MB (with scales, zeros), bf16 "
              f"{nbytes['bf16'] / 1e6:.1f} MB")
        print(f"  {'variant':8s} {'us':>8s} {'GB/s':>7s} {'vs cur':>7s}  best config")
        for label, r in sorted(results.items(), key=lambda item: item[1]["us"]):
            moved = nbytes["bf16" if label == "bf16" else "w4"]
            rate = moved / r["us"] / 1e3 if r["us"] > 0 else 0.0
            ratio = f"{base / r['us']:.2f}x" if base and r["us"] > 0 else "-"
            print(f"  {label:8s} {r['us']:8.2f} {rate:7.0f} {ratio:>7s}  {json.dumps(r['config'])}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
