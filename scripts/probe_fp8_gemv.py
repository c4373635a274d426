# ruff: noqa: B023, B007  (a temporary probe: its lambdas run within their loop iteration)
"""Temporary probe (issue #41): kernels/fp8_gemv.py's tile configs at one row (and 8 rows), Llama-3.1-8B's four
projections, CUDA graphs of CALLS calls cycling over weight copies past the L2; beside the bf16 skinny GEMV. One JSON
line last: {shape: {"bf16": us, "rule": us, "best": [us, config], ...}}."""

import functools
import itertools
import json
import math
import sys

import torch

from nanoserve.kernels import gemv
from nanoserve.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_config
from nanoserve.kernels.fp8_quant import quantize_rows

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
CALLS, REPLAYS, ROTATE = 20, 30, 200 << 20


def time_us(calls) -> float:
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[REPLAYS // 2] * 1e3 / len(calls)


def rotating(fn, items):
    return [functools.partial(fn, items[i % len(items)]) for i in range(CALLS)]


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {}
    for name, (k, n) in SHAPES.items():
        x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
        w16 = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        scale = w16.float().abs().amax(1) / 448
        w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
        q, xs = quantize_rows(x)
        want = (q.float() * xs.float()) @ (w8.float() * scale[:, None]).t()
        copies = max(1, min(CALLS, math.ceil(ROTATE / (n * k))))
        c8 = [w8] + [w8.clone() for _ in range(copies - 1)]
        c16 = [w16] + [w16.clone() for _ in range(max(1, min(CALLS, math.ceil(ROTATE / (2 * n * k)))) - 1)]
        counters = torch.zeros(n, dtype=torch.int32, device="cuda")
        row = {"bf16": round(time_us(rotating(lambda w: gemv.skinny_linear(x, w), c16)), 2),
               "quantize_rows": round(time_us([lambda: quantize_rows(x)] * CALLS), 2),
               "rule": round(time_us(rotating(lambda w: fp8_gemv(q, xs, w, scale, counters=counters), c8)), 2)}
        timed = []
        for bn, bk, sp, wp, st in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4,), (3, 5)):
            cfg = Fp8GemvConfig(bn, bk, sp, wp, st)
            try:
                got = fp8_gemv(q, xs, w8, scale, counters=counters, config=cfg)
                err = (got.float() - want).abs().max().item()
                if not err <= 2e-2 * want.abs().max().item():
                    print(name, cfg, "WRONG", err)
                    continue
                us = time_us(rotating(lambda w, cfg=cfg: fp8_gemv(q, xs, w, scale, counters=counters, config=cfg), c8))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(name, cfg, type(e).__name__, str(e)[:100])
                continue
            timed.append((round(us, 2), tuple(cfg)))
        timed.sort()
        for us, cfg in list(timed[:3]):  # the best three, with other warps and stages
            for wp, st in ((2, 4), (8, 4), (4, 2), (4, 4), (4, 6), (8, 6)):
                c = Fp8GemvConfig(*cfg[:3], wp, st)
                try:
                    fp8_gemv(q, xs, w8, scale, counters=counters, config=c)
                    timed.append((round(time_us(rotating(lambda w, c=c: fp8_gemv(q, xs, w, scale, counters=counters,
                                                                                     config=c), c8)), 2), tuple(c)))
                except Exception as e:  # noqa: BLE001
                    print(name, c, type(e).__name__, str(e)[:100])
        timed.sort()
        row["best"] = timed[:5]
        row["rule_cfg"] = tuple(fp8_gemv_config(n, k))
        row["best_TBps"] = round(n * k / timed[0][0] / 1e6, 2)
        print(name, row, flush=True)
        result[name] = row
    print(json.dumps(result))


if __name__ == "__main__":
    main()
