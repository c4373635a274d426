"""What a kernel boundary costs in a large decode step's chain (Qwen3-0.6B shapes, 256 rows, CUDA graphs of 28
layers of distinct weights): the fused residual-add + RMSNorm (a Triton kernel under PDL) and the cuBLAS qkv GEMM
after it, each alone and chained, us a layer. chained - (norm + gemm) is what putting them one after the other
costs beyond their own times, an upper bound on what letting the GEMM start under PDL could save (torch launches
cuBLAS without the attribute, so that edge of the graph waits for the norm to finish). Also reports whether this
torch keeps a captured graph for editing (keep_graph), which turning such edges into programmatic ones would need.

    python scripts/probe_kernel_boundaries.py [--rows 256]
Ends with one JSON line.
"""

import argparse
import json

import torch
from bench_decode_attention import time_fn

from nanoserve.kernels.rms_norm import rms_norm

LAYERS, HIDDEN, QKV = 28, 1024, 4096


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256)
    ns = p.parse_args()
    dev = "cuda"
    x = torch.randn(ns.rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    norm_w = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)
    weights = [torch.randn(QKV, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    outs = [torch.empty(ns.rows, QKV, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    normed = [torch.randn_like(x) for _ in range(LAYERS)]
    residuals = [res.clone() for _ in range(LAYERS)]  # written in place by the norm (x + residual)

    def norms():
        for i in range(LAYERS):
            rms_norm(x, norm_w, 1e-6, residual=residuals[i])

    def gemms():
        for i in range(LAYERS):
            torch.mm(normed[i], weights[i].t(), out=outs[i])

    def chained():
        for i in range(LAYERS):
            torch.mm(rms_norm(x, norm_w, 1e-6, residual=residuals[i]), weights[i].t(), out=outs[i])

    result = {"rows": ns.rows}
    for _ in range(2):
        for name, fn in (("norm", norms), ("gemm", gemms), ("chained", chained)):
            result[name] = min(result.get(name, 1e9), round(time_fn(fn, LAYERS), 2))
    result["boundary_us"] = round(result["chained"] - result["norm"] - result["gemm"], 2)
    result["keep_graph"] = "keep_graph" in (torch.cuda.CUDAGraph.__doc__ or "")  # its documented argument
    result["raw_cuda_graph"] = hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph")
    result["instantiate"] = hasattr(torch.cuda.CUDAGraph, "instantiate")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
