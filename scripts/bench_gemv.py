"""skinny_linear against torch's F.linear (cuBLAS) on the decode-time linear layers of Qwen3-0.6B and
Llama-3.1-8B, at M = 1 and 8 rows, in bf16 on one GPU.

Each case is timed twice: eagerly (CUDA events around 200 back-to-back calls after a warm-up) and as
decode runs it, inside a CUDA graph of 20 captured calls (more for small weights: one per weight copy,
see bench_layer), replayed. GB/s counts the bytes a call must move (weight + x + out) over its time; the
last line is one JSON object with every figure.

    python scripts/bench_gemv.py [--iters 200] [--graph-calls 20] [--ms 1,8]
"""

import argparse
import json
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.kernels.gemv import skinny_linear, skinny_linear_ref

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


def bench_layer(k: int, n: int, ms: list[int], iters: int, graph_calls: int, l2_bytes: int) -> list[dict]:
    """Times of both implementations for a bf16 weight [n, k] at each row count in ms."""
    dtype = torch.bfloat16
    weight_bytes = n * k * dtype.itemsize
    # Decode reads each layer's weight once per step, from HBM: with a single weight, repeated calls would
    # be served from the 50-60 MB L2 instead, so calls cycle through copies that together overflow it.
    copies = max(2, math.ceil(3 * l2_bytes / weight_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(copies)]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--graph-calls", type=int, default=20)
    parser.add_argument("--ms", default="1,8", help="comma-separated row counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemv needs a CUDA GPU")
    ms = [int(m) for m in args.ms.split(",")]
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"{device}: copy {bandwidth / 1e9:.0f} GB/s, L2 {l2_bytes >> 20} MiB")
    print(f"{'model':<13} {'layer':<8} {'K':>6} {'N':>6} {'M':>3}  {'MB':>6}  "
          f"{'eager torch':>17} {'eager skinny':>17}  {'graph torch':>17} {'graph skinny':>17}  speed-up(graph)")
    rows = []
    for model, layer, k, n in SHAPES:
        for row in bench_layer(k, n, ms, args.iters, args.graph_calls, l2_bytes):
            rows.append(dict(model=model, layer=layer, **row))
            cells = [f"{row[f'{mode}_{impl}_us']:6.1f}us {row[f'{mode}_{impl}_gbs']:5.0f}GB/s"
                     for mode in ("eager", "graph") for impl in ("torch", "skinny")]
            print(f"{model:<13} {layer:<8} {k:>6} {n:>6} {row['m']:>3}  {n * k * 2 / 1e6:6.1f}  {cells[0]} {cells[1]}  "
                  f"{cells[2]} {cells[3]}  {row['graph_torch_us'] / row['graph_skinny_us']:.2f}x"
                  + ("" if row["rel_err"] < 1e-2 else f"  REL ERR {row['rel_err']:.1e}"))
        torch.cuda.empty_cache()
    print(json.dumps(dict(bench="gemv", device=device, dtype="bfloat16", copy_gbs=bandwidth / 1e9, rows=rows)))


if __name__ == "__main__":
    main()
