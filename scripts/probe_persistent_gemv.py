"""A persistent batch-1 GEMV with its prologue fused, against cuBLAS, in the chained decode GEMVs. (GPU only.)

Llama-3.1-8B's gate_up_proj and down_proj (235 and 117 MB) ran on cuBLAS at one row, after a standalone RMSNorm and
SiLU-and-mul: the skinny GEMM streams them more slowly, so their prologues could not be fused. This kernel tests one
reason it might: thousands of short programs, each ramping its loads up and down. Here a grid of a few programs
per SM walks the weight in one flattened loop over (row block, K tile), two tiles in flight ahead across row-block
boundaries, the first two loaded before the PDL wait; the prologue's sum of squares is computed once per program.
M = 1, bf16, K a multiple of BLOCK_K. Its SiLU-and-mul form on down_proj (16-row blocks, 512-wide tiles, 8 warps,
two programs an SM) won in the whole model and became kernels/silu_mul_gemv.py (8b3135a); on gate_up_proj, with
the norm, it lost.

Runs scripts/sweep_gemv_chain.py's chain (every projection of every layer, one CUDA graph, PDL) with one kind
taken by this kernel, against the chain as the engine ran it before 8b3135a (gate_up and down on cuBLAS), and
prints us a layer:
    python scripts/probe_persistent_gemv.py [--model llama-3.1-8b] [--variants gate_up:8:512:4:4,...]
A variant is KIND:BLOCK_N:BLOCK_K:WARPS:PROGRAMS_PER_SM. Ends with one JSON line.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from sweep_gemv_chain import replay_us

from nanoserve.bench import roofline
from nanoserve.kernels.activation import silu_and_mul
from nanoserve.kernels.gemv import skinny_linear, skinny_norm_linear, skinny_silu_mul_linear
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids
from nanoserve.kernels.rms_norm import rms_norm
from nanoserve.kernels.silu_mul_gemv import _accumulate, _silu_mul_gemv_kernel, _tile
from nanoserve.layers.linear import skinny_gemm_fits

MODELS = {"qwen3-0.6b": (1024, 2048, 1024, 3072, 28), "llama-3.1-8b": (4096, 4096, 1024, 14336, 32)}
DEFAULT_VARIANTS = ("down:16:512:8:2,down:8:512:4:4,down:8:1024:8:2,down:4:1024:4:4,down:2:1024:4:4,"
                    "gate_up:8:512:4:4,gate_up:8:1024:8:2,gate_up:16:256:4:4,qkv:4:1024:4:4,o:4:1024:4:4")


@triton.jit
def _persistent_gemv_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, out_ptr, N, K, eps,
                            NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            USE_PDL: tl.constexpr, K_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    pid, G = tl.program_id(0), tl.num_programs(0)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, G) * K_TILES
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w = _tile(w_ptr, 0, pid, G, N, K, offs_n, offs_k, K_TILES, BLOCK_N, BLOCK_K, True)
    w_ahead = _tile(w_ptr, tl.minimum(1, total - 1), pid, G, N, K, offs_n, offs_k, K_TILES, BLOCK_N,
                                 BLOCK_K, True)
    wait_for_prior_grids(USE_PDL)
    act = x_ptr.dtype.element_ty
    if NORM:
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            h = tl.load(x_ptr + k0 + offs_k)
            if HAS_RESIDUAL:
                h = (h.to(tl.float32) + tl.load(res_ptr + k0 + offs_k).to(tl.float32)).to(act)
                if pid == 0:
                    tl.store(res_out_ptr + k0 + offs_k, h)
            h = h.to(tl.float32)
            sum_sq += h * h
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t in range(total):
        kt = t % K_TILES
        w_next = _tile(w_ptr, tl.minimum(t + 2, total - 1), pid, G, N, K, offs_n, offs_k, K_TILES,
                                    BLOCK_N, BLOCK_K, True)
        k_offs = kt * BLOCK_K + offs_k
        if NORM:
            h = tl.load(x_ptr + k_offs)
            if HAS_RESIDUAL:
                h = (h.to(tl.float32) + tl.load(res_ptr + k_offs).to(tl.float32)).to(act)
            nw = tl.load(norm_w_ptr + k_offs).to(tl.float32)
            x = ((h.to(tl.float32) * rstd).to(act).to(tl.float32) * nw).to(act)
        else:
            x = tl.load(x_ptr + k_offs)
        acc = _accumulate(acc, x, w, t, pid, G, out_ptr, N, offs_n, K_TILES, BLOCK_N, BLOCK_K)
        w = w_ahead
        w_ahead = w_next


def persistent_gemv(x, weight, out, block_n, block_k, warps, per_sm, norm=None, silu_mul=False):
    """out [1, N] = prologue(x) @ weight.T; norm = (residual or None, norm weight, eps, residual out or None). The
    SiLU-and-mul prologue runs the engine's kernel (kernels/silu_mul_gemv.py) with these blocks."""
    n, k = weight.shape
    assert x.shape[0] == 1 and k % block_k == 0
    residual, norm_w, eps, res_out = norm if norm is not None else (None, None, 0.0, None)
    grid = min(triton.cdiv(n, block_n), per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)
    pdl = use_pdl(x)
    if silu_mul:
        _silu_mul_gemv_kernel[(grid,)](x, weight, out, n, k, K_TILES=k // block_k, EVEN_K=True, USE_PDL=pdl,
                                       BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, launch_pdl=pdl)
        return out
    _persistent_gemv_kernel[(grid,)](
        x, residual if residual is not None else x, norm_w if norm_w is not None else weight,
        res_out if res_out is not None else x, weight, out, n, k, eps, NORM=norm is not None,
        HAS_RESIDUAL=residual is not None, USE_PDL=pdl, K_TILES=k // block_k, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, launch_pdl=pdl)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = p.parse_args()
    hid, q_width, kv_width, inter, layers = MODELS[args.model]
    kinds = {"qkv": (q_width + 2 * kv_width, hid), "o": (hid, q_width), "gate_up": (2 * inter, hid),
             "down": (hid, inter)}
    torch.manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    w = {kind: torch.randn(layers, n, k, device=dev, dtype=bf) / k ** 0.5 for kind, (n, k) in kinds.items()}
    norm1 = 1 + 0.1 * torch.randn(layers, hid, device=dev, dtype=bf)
    norm2 = 1 + 0.1 * torch.randn(layers, hid, device=dev, dtype=bf)
    x0 = torch.randn(1, hid, device=dev, dtype=bf)
    out = {kind: torch.empty(1, n, device=dev, dtype=bf) for kind, (n, _) in kinds.items()}
    # The engine at one row before 8b3135a: the skinny GEMM (prologue fused) under 32 MB, its tensor-core path
    # (prologue unfused) up to 64 MB, cuBLAS (prologue unfused) above.
    paths = {kind: ("fused" if 2 * n * k < 32 << 20 else "skinny") if skinny_gemm_fits(1, 2 * n * k) else "cublas"
             for kind, (n, k) in kinds.items()}

    def chain(variant: tuple | None) -> torch.Tensor:
        def path(kind):
            return "persistent" if variant is not None and variant[0] == kind else paths[kind]

        def project(kind, x, layer, norm=None, silu=False):
            """The kind's projection of x, its prologue included; returns the next residual for a norm."""
            p_ = path(kind)
            wk = w[kind][layer]
            if p_ == "persistent":
                res_out = None
                if norm is not None and norm[0] is not None:
                    res_out = torch.empty_like(x)
                persistent_gemv(x, wk, out[kind], *variant[1:],
                                norm=(norm[0], norm[1], 1e-5, res_out) if norm is not None else None, silu_mul=silu)
                return (res_out if res_out is not None else x) if norm is not None else None
            if p_ == "fused" and norm is not None:
                return skinny_norm_linear(x, norm[0], norm[1], 1e-5, wk, out=out[kind])[1]
            if p_ == "fused" and silu:
                skinny_silu_mul_linear(x, wk, out=out[kind])
                return None
            res = None
            if norm is not None:
                if norm[0] is None:
                    x, res = rms_norm(x, norm[1], 1e-5), x.clone()
                else:
                    res = norm[0]
                    x = rms_norm(x, norm[1], 1e-5, res)
            elif silu:
                x = silu_and_mul(x)
            if p_ == "cublas":
                torch.matmul(x, wk.T, out=out[kind])
            else:
                skinny_linear(x, wk, out=out[kind])
            return res

        x, res = x0.clone(), None
        for layer in range(layers):
            res = project("qkv", x, layer, norm=(res, norm1[layer]))
            project("o", out["qkv"][:, :q_width], layer)
            res = project("gate_up", out["o"], layer, norm=(res, norm2[layer]))
            project("down", out["gate_up"], layer, silu=True)
            x = out["down"]
        return F.rms_norm(x + res, (hid,))

    def timed(variant):
        chain(variant)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            result = chain(variant)
        return replay_us(g, layers), result.clone()

    bw = roofline.measure_bandwidth(dev)
    bound = 2 * sum(n * k for n, k in kinds.values()) / bw * 1e6
    base_us, base_out = timed(None)
    print(f"engine paths {paths}: {base_us:.2f} us a layer (bound {bound:.2f})", flush=True)
    results = {"engine_us": round(base_us, 2)}
    for spec in args.variants.split(","):
        kind, *nums = spec.split(":")
        variant = (kind, *map(int, nums))
        try:
            us, result = timed(variant)
        except Exception as e:  # registers or shared memory: not a candidate
            print(f"{spec}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        diff = (result.float() - base_out.float()).abs().max().item()
        results[spec] = {"us": round(us, 2), "max_diff": round(diff, 4)}
        print(f"{spec}: {us:.2f} us a layer ({us - base_us:+.2f}), max diff from the engine's chain {diff:.4f}",
              flush=True)
    again, _ = timed(None)
    print(f"engine again: {again:.2f} us a layer", flush=True)
    print(json.dumps({"probe": "persistent_gemv", "model": args.model, "device": torch.cuda.get_device_name(),
                      "bound_us": round(bound, 2), "engine_again_us": round(again, 2), **results}))


if __name__ == "__main__":
    main()
