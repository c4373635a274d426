"""The batch-1 decode GEMVs of a model as it chains them, under other kernels and launch configurations. (GPU only.)

A layer's four projections (add + RMSNorm + qkv, o, add + RMSNorm + gate_up, SiLU-and-mul + down) for every layer,
with distinct weights, each feeding the next as in decode (attention's output stood in for by the q part of qkv),
captured in one CUDA graph with PDL between the Triton launches. Each projection takes the path the engine takes
(layers/linear.py: the skinny GEMM of kernels/gemv.py with its prologue fused on its CUDA-core path, unfused on its
tensor-core path; past 64 MB cuBLAS after the standalone norm, and at one row kernels/silu_mul_gemv.py for
SiLU-and-mul + down_proj) unless a variant overrides one kind:
- (kind, block_n, block_k, num_warps): the skinny GEMM's CUDA-core path with these blocks (one or two rows a
  program, so from --rows 3 the grid reads the weight more than once);
- (kind, "dot", block_n, block_k, num_warps, num_stages): its tensor-core path, M padded to 16;
- (kind, "skinny"): the skinny GEMM with the configuration gemv._config picks;
- (kind, "cublas"): F.linear after the standalone prologue kernel.
The engine's chain is timed first and last. Prints microseconds a layer, the bytes' bound, and one JSON line.

    python scripts/sweep_gemv_chain.py [--model qwen3-0.6b|llama-3.1-8b]
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from nanoserve.bench import roofline
from nanoserve.kernels import gemv
from nanoserve.kernels.activation import silu_and_mul
from nanoserve.kernels.gemv import skinny_linear, skinny_norm_linear, skinny_silu_mul_linear
from nanoserve.kernels.rms_norm import rms_norm
from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv
from nanoserve.layers.linear import skinny_gemm_fits

# (hidden, q width, kv width, intermediate, layers)
MODELS = {"qwen3-0.6b": (1024, 2048, 1024, 3072, 28), "llama-3.1-8b": (4096, 4096, 1024, 14336, 32)}
VARIANTS = {
    "qwen3-0.6b": [
        ("qkv", 4, 1024, 4), ("qkv", 16, 512, 4), ("qkv", 8, 1024, 4), ("qkv", 8, 512, 8), ("qkv", 4, 512, 4),
        ("o", 2, 2048, 4), ("o", 4, 512, 4), ("o", 4, 1024, 4), ("o", 2, 512, 4), ("o", 2, 1024, 8),
        ("gate_up", 4, 1024, 4), ("gate_up", 16, 512, 4), ("gate_up", 8, 1024, 4), ("gate_up", 4, 512, 4),
        ("gate_up", 8, 512, 8),
        ("down", 2, 512, 4), ("down", 4, 512, 4), ("down", 4, 1024, 4), ("down", 2, 1024, 8), ("down", 8, 512, 4),
        ("qkv", "cublas"), ("o", "cublas"), ("gate_up", "cublas"), ("down", "cublas"),
    ],
    "llama-3.1-8b": [
        ("qkv", "cublas"), ("qkv", "skinny"), ("o", "skinny"), ("gate_up", "skinny"), ("down", "skinny"),
        ("qkv", 8, 512, 4), ("qkv", 16, 512, 4), ("qkv", 4, 1024, 4), ("qkv", 8, 1024, 8),
        ("qkv", "dot", 32, 256, 4, 4), ("qkv", "dot", 64, 256, 4, 4),
        ("o", "cublas"), ("o", 16, 512, 4), ("o", "dot", 32, 256, 4, 4),
        ("gate_up", 8, 512, 4), ("gate_up", 16, 512, 4), ("gate_up", 8, 1024, 4), ("gate_up", 4, 1024, 4),
        ("gate_up", 16, 256, 8), ("gate_up", 8, 512, 8), ("gate_up", "dot", 64, 256, 4, 4),
        ("gate_up", "dot", 128, 128, 4, 4), ("gate_up", "dot", 64, 128, 4, 6), ("gate_up", "dot", 128, 256, 8, 3),
        ("down", 8, 512, 4), ("down", 16, 512, 4), ("down", 8, 1024, 4), ("down", 4, 1024, 4), ("down", 8, 512, 8),
        ("down", "dot", 64, 256, 4, 4), ("down", "dot", 32, 256, 4, 4), ("down", "dot", 64, 128, 4, 6),
    ],
}


def replay_us(graph: torch.cuda.CUDAGraph, per: int) -> float:
    """Microseconds a replay of graph, divided by per (its layers): the median of 5 rounds of 20, after 5 warm-up."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20 * 1e3 / per)
    return sorted(times)[2]


def parse(spec: tuple, rows: int) -> tuple[str, gemv._Config | None]:
    """A variant's path ("skinny" or "cublas") and, for the skinny GEMM, its launch configuration."""
    if spec in (("cublas",), ("skinny",)):
        return spec[0], None
    if spec[0] == "dot":
        bn, bk, warps, stages = spec[1:]
        return "skinny", gemv._Config(True, max(16, triton.next_power_of_2(rows)), bn, bk, warps, stages)
    bn, bk, warps = spec
    return "skinny", gemv._Config(False, min(rows, 2), bn, bk, warps, 1)


def from_name(name: str, kinds: dict) -> tuple[str, tuple]:
    """A variant from its printed name, e.g. gate_up_dot_64_256_4_4 -> ("gate_up", ("dot", 64, 256, 4, 4))."""
    kind = next(k for k in kinds if name.startswith(k + "_"))
    return kind, tuple(int(p) if p.isdigit() else p for p in name[len(kind) + 1:].split("_"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.6b")
    p.add_argument("--rows", type=int, default=1, help="decode batch: from 2 rows the prologues run unfused, "
                   "as in the engine (layers/linear.py)")
    p.add_argument("--only", help="comma-separated variant names to run, as printed (e.g. qkv_dot_64_256_4_4), "
                   "listed or not (default: the model's list)")
    args = p.parse_args()
    rows = args.rows
    hid, q_width, kv_width, inter, layers = MODELS[args.model]
    kinds = {"qkv": (q_width + 2 * kv_width, hid), "o": (hid, q_width), "gate_up": (2 * inter, hid),
             "down": (hid, inter)}  # (N, K)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bf = torch.bfloat16
    w = {kind: torch.randn(layers, n, k, device=dev, dtype=bf) / k ** 0.5 for kind, (n, k) in kinds.items()}
    norm1 = 1 + 0.1 * torch.randn(layers, hid, device=dev, dtype=bf)
    norm2 = 1 + 0.1 * torch.randn(layers, hid, device=dev, dtype=bf)
    x0 = torch.randn(rows, hid, device=dev, dtype=bf)
    out = {kind: torch.empty(rows, n, device=dev, dtype=bf) for kind, (n, _) in kinds.items()}
    default_config = gemv._config
    engine_paths = {kind: "skinny" if skinny_gemm_fits(rows, 2 * n * k) else "cublas"
                    for kind, (n, k) in kinds.items()}
    if rows == 1 and engine_paths["down"] == "cublas":
        engine_paths["down"] = "silu_mul_gemv"
    fused = rows == 1

    def chain(paths: dict[str, str]) -> torch.Tensor:
        def linear(kind, x):
            if paths[kind] == "skinny":
                skinny_linear(x, w[kind][layer], out=out[kind])
            else:
                torch.matmul(x, w[kind][layer].T, out=out[kind])

        def norm_linear(kind, x, res, norm_w):
            if paths[kind] == "skinny" and fused and not gemv.tensor_cores_at(rows, w[kind][layer]):
                return skinny_norm_linear(x, res, norm_w, 1e-5, w[kind][layer], out=out[kind])[1]
            if res is None:  # the first layer: nothing to add; a copy, as the residual is updated in place later
                normed, res = rms_norm(x, norm_w, 1e-5), x.clone()
            else:
                normed = rms_norm(x, norm_w, 1e-5, res)  # adds x into res in place
            linear(kind, normed)
            return res

        x, res = x0.clone(), None  # a copy: the first layer's x becomes the residual, which is updated in place
        for layer in range(layers):
            res = norm_linear("qkv", x, res, norm1[layer])
            linear("o", out["qkv"][:, :q_width])
            res = norm_linear("gate_up", out["o"], res, norm2[layer])
            if paths["down"] == "silu_mul_gemv":
                x = silu_mul_gemv(out["gate_up"], w["down"][layer])
                continue
            if paths["down"] == "skinny" and fused and not gemv.tensor_cores_at(rows, w["down"][layer]):
                skinny_silu_mul_linear(out["gate_up"], w["down"][layer], out=out["down"])
            else:
                linear("down", silu_and_mul(out["gate_up"]))
            x = out["down"]
        return F.rms_norm(x + res, (hid,))

    def timed(kind: str | None = None, spec: tuple = ()) -> tuple[float, torch.Tensor]:
        paths = dict(engine_paths)
        cfg = None
        if kind is not None:
            paths[kind], cfg = parse(spec, rows)

        def config(mm: int, n: int, k: int, elem_size: int):
            return cfg if cfg is not None and (n, k) == kinds[kind] else default_config(mm, n, k, elem_size)

        gemv._config = config
        try:
            chain(paths)  # compiles outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                result = chain(paths)
        finally:
            gemv._config = default_config
        return replay_us(g, layers), result.clone()

    bw = roofline.measure_bandwidth(dev)
    layer_bytes = 2 * sum(n * k for n, k in kinds.values())
    results = {"model": args.model, "rows": rows, "device": torch.cuda.get_device_name(),
               "bandwidth_tb_s": round(bw / 1e12, 2), "bound_us_per_layer": round(layer_bytes / bw * 1e6, 2),
               "engine_paths": engine_paths, "defaults": {kind: default_config(rows, n, k, 2)._asdict()
                            for kind, (n, k) in kinds.items()}}
    base_us, base_out = timed()
    results["default_us"] = round(base_us, 2)
    print(f"default ({engine_paths}): {base_us:.2f} us a layer (bound {results['bound_us_per_layer']})", flush=True)
    variants = [from_name(name, kinds) for name in args.only.split(",")] if args.only else [
        (kind, tuple(spec)) for kind, *spec in VARIANTS[args.model]]
    for kind, spec in variants:
        name = "_".join([kind, *map(str, spec)])
        try:
            us, result = timed(kind, spec)
        except Exception as e:  # a config that does not compile or launch (shared memory, registers)
            results[name] = {"error": type(e).__name__}
            print(f"{name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        ok = torch.allclose(result.float(), base_out.float(), atol=5e-2, rtol=5e-2)
        results[name] = {"us": round(us, 2), "matches": ok}
        print(f"{name}: {us:.2f} us a layer ({us - base_us:+.2f}), matches: {ok}", flush=True)
    again, _ = timed()
    results["default_again_us"] = round(again, 2)
    print(f"default again: {again:.2f} us a layer", flush=True)
    print(json.dumps({"sweep": "gemv_chain", **results}))


if __name__ == "__main__":
    main()
