"""The Gumbel-max sampling kernel at the throughput recipe's largest step (256 rows of a 151,936-token vocabulary,
bf16 logits): as it runs on a GPU (the outer log of its noise fast), with both logs exact (as on the CPU), and
reading the logits alone (temperature 0: no noise); the draws are compared with the reference's over --seeds keys.

    python scripts/bench_sampler.py [--rows 256]
Ends with one JSON line.
"""

import argparse
import json

import torch
import triton

from nanoserve.kernels import sampling


def time_us(fn, iters: int = 50) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--seeds", type=int, default=4, help="keys to compare each variant's tokens with the reference")
    p.add_argument("--vocab", type=int, default=151936)
    ns = p.parse_args()
    logits = torch.randn(ns.rows, ns.vocab, device="cuda").bfloat16()
    temps = torch.full((ns.rows,), 0.8, device="cuda")
    parts = triton.cdiv(ns.vocab, sampling._BLOCK_V)
    val = torch.empty(ns.rows, parts, device="cuda")
    idx = torch.empty(ns.rows, parts, dtype=torch.int64, device="cuda")
    rows = {}
    variants = {"default": {"FAST_LOG": True}, "exact_logs": {"FAST_LOG": False},
                "temperature_0": {"FAST_LOG": True}}
    for _ in range(2):
        for name, opts in variants.items():
            t = torch.zeros_like(temps) if name == "temperature_0" else temps

            def call(t=t, opts=opts):
                sampling._gumbel_max_kernel[(ns.rows, parts)](logits, t, val, idx, logits.stride(0), ns.vocab, parts,
                                                              12345, BLOCK_V=sampling._BLOCK_V, num_warps=8, **opts)

            rows[name] = min(rows.get(name, 1e9), round(time_us(call), 2))
    for key in range(ns.seeds):
        want = sampling.gumbel_max_sample_ref(logits, temps, key)
        for name, opts in variants.items():
            if name != "temperature_0":
                sampling._gumbel_max_kernel[(ns.rows, parts)](logits, temps, val, idx, logits.stride(0), ns.vocab,
                                                              parts, key, BLOCK_V=sampling._BLOCK_V, num_warps=8,
                                                              **opts)
                got = idx.gather(1, val.argmax(dim=1, keepdim=True))[:, 0]
                rows[name + "_differ"] = rows.get(name + "_differ", 0) + int((got != want).sum())
    print(json.dumps({"bench": "sampler", "rows": ns.rows, "vocab": ns.vocab, "logits_gb_s_floor":
                      round(logits.numel() * 2 / rows["temperature_0"] / 1e3, 1), "us": rows}))


if __name__ == "__main__":
    main()
