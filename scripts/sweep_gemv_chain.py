"""The batch-1 decode GEMVs of Qwen3-0.6B as the model chains them, under other launch configurations. (GPU only.)

A layer's four skinny GEMVs (kernels/gemv.py: add + RMSNorm + qkv, o, add + RMSNorm + gate_up, SiLU-and-mul +
down) for 28 layers of distinct weights, each feeding the next as in decode (attention's output stood in for by
the q part of qkv), captured in one CUDA graph with PDL between launches. The default configuration (gemv._config,
fitted on an H200) is timed first and last; each variant changes one layer kind's block sizes or warps. Prints
microseconds a layer, the bytes' bound, and one JSON line.

    python scripts/sweep_gemv_chain.py
"""

import json

import torch

from nanoserve.bench import roofline
from nanoserve.kernels import gemv
from nanoserve.kernels.gemv import skinny_linear, skinny_norm_linear, skinny_silu_mul_linear

HID, ATT, INTER, LAYERS, EPS = 1024, 2048, 3072, 28, 1e-6
KINDS = {"qkv": (4096, HID), "o": (HID, ATT), "gate_up": (2 * INTER, HID), "down": (HID, INTER)}  # (N, K)
# (kind, block_n, block_k, num_warps): the CUDA-core path at M = 1.
VARIANTS = [
    ("qkv", 4, 1024, 4), ("qkv", 16, 512, 4), ("qkv", 8, 1024, 4), ("qkv", 8, 512, 8), ("qkv", 4, 512, 4),
    ("o", 2, 2048, 4), ("o", 4, 512, 4), ("o", 4, 1024, 4), ("o", 2, 512, 4), ("o", 2, 1024, 8),
    ("gate_up", 4, 1024, 4), ("gate_up", 16, 512, 4), ("gate_up", 8, 1024, 4), ("gate_up", 4, 512, 4),
    ("gate_up", 8, 512, 8),
    ("down", 2, 512, 4), ("down", 4, 512, 4), ("down", 4, 1024, 4), ("down", 2, 1024, 8), ("down", 8, 512, 4),
]


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bf = torch.bfloat16
    w = {kind: torch.randn(LAYERS, n, k, device=dev, dtype=bf) / k ** 0.5 for kind, (n, k) in KINDS.items()}
    norm1 = 1 + 0.1 * torch.randn(LAYERS, HID, device=dev, dtype=bf)
    norm2 = 1 + 0.1 * torch.randn(LAYERS, HID, device=dev, dtype=bf)
    x0 = torch.randn(1, HID, device=dev, dtype=bf)
    qkv = torch.empty(1, 4096, device=dev, dtype=bf)
    h = torch.empty(1, HID, device=dev, dtype=bf)
    gu = torch.empty(1, 2 * INTER, device=dev, dtype=bf)
    m = torch.empty(1, HID, device=dev, dtype=bf)

    def chain() -> torch.Tensor:
        x, res = x0, None
        for layer in range(LAYERS):
            _, res = skinny_norm_linear(x, res, norm1[layer], EPS, w["qkv"][layer], out=qkv)
            skinny_linear(qkv[:, :ATT], w["o"][layer], out=h)
            _, res = skinny_norm_linear(h, res, norm2[layer], EPS, w["gate_up"][layer], out=gu)
            skinny_silu_mul_linear(gu, w["down"][layer], out=m)
            x = m
        return m

    default_config = gemv._config

    def timed(overrides: dict) -> tuple[float, torch.Tensor]:
        def config(mm: int, n: int, k: int, elem_size: int):
            for kind, (kn, kk) in KINDS.items():
                if (n, k) == (kn, kk) and kind in overrides:
                    bn, bk, warps = overrides[kind]
                    return gemv._Config(False, 1, bn, bk, warps, 1)
            return default_config(mm, n, k, elem_size)

        gemv._config = config
        try:
            chain()  # compiles outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = chain()
        finally:
            gemv._config = default_config
        for _ in range(10):
            g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            for _ in range(40):
                g.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 40 * 1e3 / LAYERS)
        return sorted(times)[2], out.clone()

    bw = roofline.measure_bandwidth(dev)
    layer_bytes = 2 * sum(n * k for n, k in KINDS.values())
    results = {"device": torch.cuda.get_device_name(), "bandwidth_tb_s": round(bw / 1e12, 2),
               "bound_us_per_layer": round(layer_bytes / bw * 1e6, 2),
               "defaults": {kind: default_config(1, n, k, 2)._asdict() for kind, (n, k) in KINDS.items()}}
    base_us, base_out = timed({})
    results["default_us"] = round(base_us, 2)
    print(f"default: {base_us:.2f} us a layer (bound {results['bound_us_per_layer']})", flush=True)
    for kind, bn, bk, warps in VARIANTS:
        name = f"{kind}_n{bn}_k{bk}_w{warps}"
        us, out = timed({kind: (bn, bk, warps)})
        ok = torch.allclose(out.float(), base_out.float(), atol=5e-2, rtol=5e-2)
        results[name] = {"us": round(us, 2), "matches": ok}
        print(f"{name}: {us:.2f} us a layer ({us - base_us:+.2f}), matches: {ok}", flush=True)
    again, _ = timed({})
    results["default_again_us"] = round(again, 2)
    print(f"default again: {again:.2f} us a layer", flush=True)
    print(json.dumps({"sweep": "gemv_chain", **results}))


if __name__ == "__main__":
    main()
