"""Do cuBLASLt algorithms other than the heuristic's first pick run a large decode step's GEMMs faster? Qwen3-0.6B's
four projections at decode row counts, each in a CUDA graph of 28 weight copies (as a step runs them), with torch's
default cuBLAS call and then with TunableOp tuning every shape first (it times the candidates it knows: on torch
builds whose TunableOp registers cuBLASLt algorithms for CUDA, those; else only the default). Prints us a GEMM for
both and the solutions TunableOp picked.

    python scripts/probe_tunable_gemm.py [--rows 256 128 64]
Ends with one JSON line.
"""

import argparse
import json
import os
import tempfile

import torch
import torch.cuda.tunable as tunable
from bench_decode_attention import time_fn

LAYERS = 28
SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}  # (K, N)


def time_shape(rows: int, k: int, n: int) -> float:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def calls():
        for w in weights:
            torch.mm(x, w.t(), out=out)

    return round(time_fn(calls, LAYERS), 2)  # TunableOp tunes in its warm-up run, outside the capture


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 128, 64])
    ns = p.parse_args()
    result = {"torch": torch.__version__}
    default = {f"{name}_{m}": time_shape(m, k, n) for m in ns.rows for name, (k, n) in SHAPES.items()}
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_filename(os.path.join(tempfile.mkdtemp(), "tunableop_results.csv"))
    tuned = {f"{name}_{m}": time_shape(m, k, n) for m in ns.rows for name, (k, n) in SHAPES.items()}
    tunable.enable(False)
    result["us"] = {key: [default[key], tuned[key]] for key in default}
    result["sum_default_tuned_us"] = [round(sum(default.values()), 2), round(sum(tuned.values()), 2)]
    result["solutions"] = [list(map(str, r)) for r in tunable.get_results()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
