"""skinny_linear against torch's F.linear (cuBLAS) on the decode-time linear layers of Qwen3-0.6B and
Llama-3.1-8B, at M = 1 and 8 rows, in bf16 on one GPU; then the fused prologues against the kernel pairs they
replace, at M = 1 and 2: add+RMSNorm then skinny_linear against skinny_norm_linear (qkv, gate_up), SiLU-and-mul
then skinny_linear against skinny_silu_mul_linear (down).

Each plain case is timed twice: eagerly (CUDA events around 200 back-to-back calls after a warm-up) and as
decode runs it, inside a CUDA graph of 20 captured calls (more for small weights: one per weight copy,
see bench_layer), replayed; the fused cases only in graphs, the only place the model uses them. GB/s counts
the bytes a call must move (weight + activations in and out) over its time; the last line is one JSON object
with every figure.

    python scripts/bench_gemv.py [--iters 200] [--graph-calls 20] [--ms 1,8] [--fused-ms 1,2] [--parts plain,fused]
"""

import argparse
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.kernels.activation import silu_and_mul
from nanoserve.kernels.gemv import skinny_linear, skinny_linear_ref, skinny_norm_linear, skinny_silu_mul_linear
from nanoserve.kernels.rms_norm import rms_norm

# (model, layer, K, N) with weight [N, K]; the q/k/v and gate/up projections fused as nanoserve runs them.
SHAPES = [
    ("qwen3-0.6b", "qkv", 1024, 4096),
    ("qwen3-0.6b", "o", 2048, 1024),
    ("qwen3-0.6b", "gate_up", 1024, 6144),
    ("qwen3-0.6b", "down", 3072, 1024),
    ("llama-3.1-8b", "qkv", 4096, 6144),
    ("llama-3.1-8b", "o", 4096, 4096),
    ("llama-3.1-8b", "gate_up", 4096, 28672),
    ("llama-3.1-8b", "down", 14336, 4096),
]
# The layers that take a fused prologue, and which: "norm" (residual add + RMSNorm) or "silu" (SiLU-and-mul).
FUSED = {"qkv": "norm", "gate_up": "norm", "down": "silu"}
LAYERS_PER_MODEL = {"qwen3-0.6b": 28, "llama-3.1-8b": 32}


def _events_us(fn: Callable[[], object], calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def time_eager_us(call: Callable[[int], object], iters: int) -> float:
    """Mean microseconds per call over `iters` back-to-back calls, after a warm-up of the same length."""

    def loop():
        for i in range(iters):
            call(i)

    loop()
    return _events_us(loop, iters)


def time_graph_us(call: Callable[[int], object], graph_calls: int, replays: int = 20) -> float:
    """Microseconds per call inside one captured graph of `graph_calls` calls; median over replays."""
    for i in range(graph_calls):  # compile and warm up outside the capture
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(graph_calls):
            call(i)
    graph.replay()
    times = sorted(_events_us(graph.replay, graph_calls) for _ in range(replays))
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device copy, read plus written: the ceiling the GB/s figures are held to."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _events_us(lambda: [dst.copy_(src) for _ in range(10)], 10) / 1e6
    return 2 * src.numel() * src.element_size() / seconds


def _weight_copies(k: int, n: int, l2_bytes: int) -> list[torch.Tensor]:
    """Enough copies of a bf16 weight [n, k] to overflow the L2 when called in turn: decode reads each layer's
    weight once per step, from HBM, and a single weight called repeatedly would be served from the L2."""
    copies = max(2, math.ceil(3 * l2_bytes / (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]


def bench_layer(k: int, n: int, ms: list[int], iters: int, graph_calls: int, l2_bytes: int) -> list[dict]:
    """Times of both implementations for a bf16 weight [n, k] at each row count in ms."""
    dtype = torch.bfloat16
    weight_bytes = n * k * dtype.itemsize
    weights = _weight_copies(k, n, l2_bytes)
    copies = len(weights)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        ref = skinny_linear_ref(x, weights[0]).float()
        rel_err = ((skinny_linear(x, weights[0]).float() - ref).norm() / ref.norm()).item()
        calls = {
            "torch": lambda i, x=x: F.linear(x, weights[i % copies]),
            "skinny": lambda i, x=x, out=out: skinny_linear(x, weights[i % copies], out=out),
        }
        moved = weight_bytes + (m * k + m * n) * dtype.itemsize
        row = dict(k=k, n=n, m=m, rel_err=rel_err)
        for impl, call in calls.items():
            row[f"eager_{impl}_us"] = time_eager_us(call, iters)
            # Every copy is called at least once per replay, so no replay finds its weight left in L2.
            row[f"graph_{impl}_us"] = time_graph_us(call, max(graph_calls, copies))
        for key in [key for key in row if key.endswith("_us")]:
            row[key.replace("_us", "_gbs")] = moved / row[key] / 1e3
        rows.append(row)
    return rows


def bench_fused(kind: str, k: int, n: int, ms: list[int], graph_calls: int, l2_bytes: int) -> list[dict]:
    """In CUDA graphs: the elementwise kernel + skinny_linear against the fused kernel for a weight [n, k], kind
    "norm" (x, residual [M, k] -> the GEMM's input and the new residual) or "silu" (x [M, 2k] = gate | up)."""
    dtype, eps = torch.bfloat16, 1e-6
    weights = _weight_copies(k, n, l2_bytes)
    norm_w = 1 + 0.1 * torch.randn(k, device="cuda", dtype=dtype)
    rows = []
    for m in ms:
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        if kind == "norm":
            x, residual = (torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(2))
            # x + residual written back in place (unfused) or to a new tensor (fused): 2 reads + 1 write of [M, k].
            act_bytes = 3 * m * k * dtype.itemsize

            def unfused(i, x=x, residual=residual, out=out):
                skinny_linear(rms_norm(x, norm_w, eps, residual), weights[i % len(weights)], out=out)

            def fused(i, x=x, residual=residual, out=out):
                skinny_norm_linear(x, residual, norm_w, eps, weights[i % len(weights)], out=out)

            res_copy = residual.clone()
            want = skinny_linear(rms_norm(x, norm_w, eps, res_copy), weights[0])
            got, new_residual = skinny_norm_linear(x, residual, norm_w, eps, weights[0])
            residual_equal = bool(torch.equal(new_residual, res_copy))
        else:
            x = torch.randn(m, 2 * k, device="cuda", dtype=dtype)
            act_bytes = 2 * m * k * dtype.itemsize

            def unfused(i, x=x, out=out):
                skinny_linear(silu_and_mul(x), weights[i % len(weights)], out=out)

            def fused(i, x=x, out=out):
                skinny_silu_mul_linear(x, weights[i % len(weights)], out=out)

            want, got = skinny_linear(silu_and_mul(x), weights[0]), skinny_silu_mul_linear(x, weights[0])
            residual_equal = None
        moved = n * k * dtype.itemsize + act_bytes + m * n * dtype.itemsize
        row = dict(kind=kind, k=k, n=n, m=m, max_abs_diff=(got.float() - want.float()).abs().max().item(),
                   rel_diff=((got.float() - want.float()).norm() / want.float().norm()).item(),
                   residual_equal=residual_equal)
        for impl, call in (("unfused", unfused), ("fused", fused)):
            row[f"graph_{impl}_us"] = time_graph_us(call, max(graph_calls, len(weights)))
            row[f"graph_{impl}_gbs"] = moved / row[f"graph_{impl}_us"] / 1e3
        row["saved_us"] = row["graph_unfused_us"] - row["graph_fused_us"]
        rows.append(row)
    return rows


def print_fused(shapes: list[tuple[str, str, int, int]], ms: list[int], graph_calls: int, l2_bytes: int) -> list[dict]:
    print("\nfused prologues, in CUDA graphs ('+' = one kernel before the GEMM, launched separately)")
    print(f"{'model':<13} {'layer':<12} {'K':>6} {'N':>6} {'M':>3}  {'graph unfused':>17} {'graph fused':>17}  "
          f"{'saved':>7}  speed-up  check")
    rows = []
    for model, layer, k, n in shapes:
        for row in bench_fused(FUSED[layer], k, n, ms, graph_calls, l2_bytes):
            rows.append(dict(model=model, layer=layer, **row))
            cells = [f"{row[f'graph_{impl}_us']:6.1f}us {row[f'graph_{impl}_gbs']:5.0f}GB/s"
                     for impl in ("unfused", "fused")]
            check = f"rel diff {row['rel_diff']:.1e}" + ("" if row["residual_equal"] in (None, True) else
                                                         "  RESIDUAL DIFFERS")
            print(f"{model:<13} {layer + ('+norm' if row['kind'] == 'norm' else '+silu'):<12} {k:>6} {n:>6} "
                  f"{row['m']:>3}  {cells[0]} {cells[1]}  {row['saved_us']:5.1f}us  "
                  f"{row['graph_unfused_us'] / row['graph_fused_us']:.2f}x  {check}")
        torch.cuda.empty_cache()
    for model, layers in LAYERS_PER_MODEL.items():
        for m in ms:
            saved = sum(r["saved_us"] for r in rows if r["model"] == model and r["m"] == m)
            print(f"{model} M={m}: {saved:.1f} us saved per layer, {saved * layers:.0f} us per token over {layers} "
                  f"layers (were every fused layer on the skinny path)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--graph-calls", type=int, default=20)
    parser.add_argument("--ms", default="1,8", help="comma-separated row counts of the plain comparison")
    parser.add_argument("--fused-ms", default="1,2", help="comma-separated row counts of the fused comparison")
    parser.add_argument("--parts", default="plain,fused", help="which comparisons: plain (vs cuBLAS), fused")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA GPU")
    ms = [int(m) for m in args.ms.split(",")]
    parts = set(args.parts.split(","))
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {bandwidth / 1e9:.0f} GB/s, L2 {l2_bytes >> 20} MiB")
    rows = []
    if "plain" in parts:
        print(f"{'model':<13} {'layer':<8} {'K':>6} {'N':>6} {'M':>3}  {'MB':>6}  "
              f"{'eager torch':>17} {'eager skinny':>17}  {'graph torch':>17} {'graph skinny':>17}  speed-up(graph)")
    for model, layer, k, n in SHAPES if "plain" in parts else []:
        for row in bench_layer(k, n, ms, args.iters, args.graph_calls, l2_bytes):
            rows.append(dict(model=model, layer=layer, **row))
            cells = [f"{row[f'{mode}_{impl}_us']:6.1f}us {row[f'{mode}_{impl}_gbs']:5.0f}GB/s"
                     for mode in ("eager", "graph") for impl in ("torch", "skinny")]
            print(f"{model:<13} {layer:<8} {k:>6} {n:>6} {row['m']:>3}  {n * k * 2 / 1e6:6.1f}  {cells[0]} {cells[1]}  "
                  f"{cells[2]} {cells[3]}  {row['graph_torch_us'] / row['graph_skinny_us']:.2f}x"
                  + ("" if row["rel_err"] < 1e-2 else f"  REL ERR {row['rel_err']:.1e}"))
        torch.cuda.empty_cache()
    fused_rows = []
    if "fused" in parts:
        shapes = [(model, layer, k, n) for model, layer, k, n in SHAPES if layer in FUSED]
        fused_rows = print_fused(shapes, [int(m) for m in args.fused_ms.split(",")], args.graph_calls, l2_bytes)
    print(json.dumps(dict(bench="gemv", device=device, dtype="bfloat16", copy_gbs=bandwidth / 1e9, rows=rows,
                          fused_rows=fused_rows)))


if __name__ == "__main__":
    main()
