"""Temporary probe (issue #41): kernels/gemv.py's skinny GEMV with an fp8 weight at one row, Llama-3.1-8B's four
projections, over a sweep of tile configs (gemv._config patched), beside the bf16 weight at its own rule. One JSON
line last: {shape: {"bf16": us, "fp8_rule": us, "fp8_best": [us, config]}}."""

import json

import torch
from probe_w4_gemv import REPLAYS, check, rotating, time_us, weight_copies  # noqa: F401

from nanoserve.kernels import gemv

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # K, N
CORE = [(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]
DOT = [(bn, bk, st) for bn in (32, 64, 128) for bk in (256, 512) for st in (3, 4)]


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rule = gemv._config
    result = {}
    for name, (k, n) in SHAPES.items():
        x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
        w16 = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        scale = w16.float().abs().amax(1) / 448
        w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
        want = x.float() @ (w8.float() * scale[:, None]).t()
        c16 = [w16] + [w16.clone() for _ in range(weight_copies(w16.numel() * 2) - 1)]
        c8 = [w8] + [w8.clone() for _ in range(weight_copies(w8.numel()) - 1)]
        row = {"bf16": round(time_us(rotating(lambda w: gemv.skinny_linear(x, w), c16)), 2)}
        row["fp8_rule"] = round(time_us(rotating(lambda w: gemv.skinny_linear(x, w, weight_scale=scale), c8)), 2)
        best = None
        configs = [gemv._Config(False, 1, bn, bk, w, 1) for bn, bk, w in CORE]
        configs += [gemv._Config(True, 16, bn, bk, 4, st) for bn, bk, st in DOT]
        for cfg in configs:
            gemv._config = lambda *a, cfg=cfg: cfg
            try:
                err = check(gemv.skinny_linear(x, w8, weight_scale=scale), want)
                if err:
                    print(name, cfg, err)
                    continue
                us = time_us(rotating(lambda w: gemv.skinny_linear(x, w, weight_scale=scale), c8))
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(name, cfg, type(e).__name__, str(e)[:120])
                continue
            finally:
                gemv._config = rule
            print(f"{name} {tuple(cfg)} {us:.2f} us")
            if best is None or us < best[0]:
                best = (round(us, 2), tuple(cfg))
        row["fp8_best"] = best
        row["fp8_GBps_best"] = round(n * k / best[0] / 1e3, 1) if best else None
        print(name, row, flush=True)
        result[name] = row
    print(json.dumps(result))


if __name__ == "__main__":
    main()
