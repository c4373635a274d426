"""Is there a Triton GEMM that beats cuBLAS on Qwen3-0.6B's projections at the row counts of the throughput
recipe's large decode steps (64-256) and the cached prefix step (128)? Inductor's max-autotune searches its Triton
templates (TMA-persistent ones included) beside cuBLAS for each shape; this times its pick against torch.mm the way
a step runs them: a CUDA graph of 28 calls over 28 weight copies (more than the L2 holds), us a GEMM.

    python scripts/probe_inductor_gemm.py [--rows 256 128] [--exhaustive]
Inductor prints each shape's ranked candidates (lines from "AUTOTUNE") to stderr. Ends with one JSON line.
"""

import argparse
import json

import torch
import torch._inductor.config as inductor_config
from bench_decode_attention import time_fn
from probe_tunable_gemm import LAYERS, SHAPES


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t())


def time_shape(fn, rows: int, k: int, n: int) -> tuple[float, float]:
    """(us a GEMM over LAYERS weight copies, max |difference| from torch.mm)."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    err = (fn(x, weights[0]).float() - mm(x, weights[0]).float()).abs().max().item()
    return round(time_fn(lambda: [fn(x, w) for w in weights], LAYERS), 2), err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 128])
    p.add_argument("--exhaustive", action="store_true", help="Inductor's exhaustive GEMM search space")
    ns = p.parse_args()
    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor_config.triton.enable_persistent_tma_matmul = True
    if ns.exhaustive:
        inductor_config.max_autotune_gemm_search_space = "EXHAUSTIVE"
    tuned = torch.compile(mm, mode="max-autotune-no-cudagraphs", dynamic=False)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "us_cublas_inductor": {}}
    sums = [0.0, 0.0]
    for rows in ns.rows:
        for name, (k, n) in SHAPES.items():
            cublas, _ = time_shape(mm, rows, k, n)
            ind, err = time_shape(tuned, rows, k, n)
            result["us_cublas_inductor"][f"{name}_{rows}"] = [cublas, ind, round(err, 4)]
            sums[0] += cublas
            sums[1] += ind
            print(f"{name} M={rows}: cuBLAS {cublas} us, Inductor's pick {ind} us (max diff {err:.4f})", flush=True)
    result["sum_us"] = [round(s, 2) for s in sums]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
