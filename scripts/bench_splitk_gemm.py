"""cuBLAS (F.linear) against a split-K GEMM (below) on Qwen3-0.6B's linear layers at the row counts of the
throughput benchmark's large decode steps, in bf16, each config checked against F.linear first.

Every GEMM is timed inside a CUDA graph of 28 captured calls, one per weight copy (a decode step reads 28 layers'
weights, more than the L2 holds), replayed 20 times; median us per call (scripts/bench_gemv.py's time_graph_us).
The split-K kernel launches under PDL, as in the engine. Per M: the step's sum over 28 layers of the four GEMMs,
cuBLAS against the best config per shape.

    python scripts/bench_splitk_gemm.py [--ms 64,128,256]
Ends with one JSON line.

The kernel, out[M, N] = x[M, K] @ weight[N, K].T split along K: at M = 64-256 a small model's narrow layers
(N = 1024) give a library GEMM 16-32 output tiles: a few SMs walk all of K while the rest idle. Here each tile's
K is cut into SPLIT_K ranges, one program each, so the grid fills the GPU. A program writes its fp32 partial to
scratch and bumps its tile's counter; the last of a tile's programs sums the partials (in split order, so the
result does not depend on which program came last), writes the output and resets the counter for the next
launch. One launch, no zeroing kernel, no atomics on the output.
"""

import argparse
import itertools
import json
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_gemm_shapes import LAYERS, SHAPES
from bench_gemv import time_graph_us

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    stages: int = 3
    warps: int = 4


@triton.jit(do_not_specialize=["M"])
def _splitk_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counters_ptr, M, N, K, stride_xm, stride_wn,
                        stride_om, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                        USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile // num_n, tile % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Tail rows and columns read a valid row again rather than being masked; the stores drop them.
    rows_x = tl.minimum(offs_m, M - 1)
    rows_w = tl.minimum(offs_n, N - 1)
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w.to(tl.int64)[None, :] * stride_wn + (k_start + offs_k)[:, None]  # a tile of weight.T
    wait_for_prior_grids(USE_PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            in_k = (k + offs_k) < k_end
            x = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile_elems = BLOCK_M * BLOCK_N
        in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        parts = part_ptr + tile.to(tl.int64) * SPLIT_K * tile_elems + in_tile
        tl.store(parts + split * tile_elems, acc)
        # The counter hand-over of kernels/decode_attention.py: the barrier orders every thread's partial stores
        # before the acq_rel atomic (issued from one thread), whose result reaches the other threads behind a
        # barrier; the partials are then read with .cg from L2, where the other SMs' stores are visible.
        tl.debug_barrier()
        counter = counters_ptr + tile
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            tl.debug_barrier()
            tl.store(counter, 0)  # every program of the tile is past its atomic; the kernel boundary publishes it
            total = tl.load(parts, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(parts + s * tile_elems, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def num_tiles(m: int, n: int, cfg: GemmConfig) -> int:
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig,
                  counters: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N]. With cfg.split_k > 1, counters: int32 zeros, at least one
    per output tile (num_tiles), left zeroed again by every launch."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = num_tiles(m, n, cfg)
    if cfg.split_k > 1:
        assert counters is not None and counters.dtype == torch.int32 and counters.numel() >= tiles
        # Scratch from the caching allocator (a CUDA graph's pool when captured): fully written before it is read.
        parts = torch.empty(tiles * cfg.split_k * cfg.block_m * cfg.block_n, dtype=torch.float32, device=x.device)
    else:
        parts = counters = out
    pdl = use_pdl(x)
    _splitk_gemm_kernel[(tiles, cfg.split_k)](
        x, weight, bias if bias is not None else weight, out, parts, counters, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, SPLIT_K=cfg.split_k,
        EVEN_K=k % cfg.block_k == 0, USE_PDL=pdl, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages, launch_pdl=pdl)
    return out

CONFIGS = [GemmConfig(bm, bn, bk, sk, st, 8 if bm == bn == 128 else 4)
           for bm, bn, bk, sk, st in itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4), (3, 4))]
CONFIGS += [GemmConfig(64, 32, bk, sk, 3) for bk in (64, 128) for sk in (1, 2, 4)]


def name(cfg: GemmConfig) -> str:
    return f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}sk{cfg.split_k}s{cfg.stages}w{cfg.warps}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="64,128,256")
    ns = p.parse_args()
    ms = [int(m) for m in ns.ms.split(",")]
    torch.manual_seed(0)
    rows = []
    for layer, k, n in SHAPES:
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(LAYERS)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
            row = {"layer": layer, "m": m, "k": k, "n": n, "us": {},
                   "cublas_us": round(time_graph_us(lambda i, x=x, w=weights: F.linear(x, w[i]), LAYERS), 2)}
            for cfg in CONFIGS:
                if num_tiles(m, n, cfg) > counters.numel() or cfg.block_m > 2 * m:
                    continue
                try:
                    got = splitk_linear(x, weights[0], None, cfg, counters).float()
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
                    assert counters.eq(0).all(), "counters not reset"
                    row["us"][name(cfg)] = round(time_graph_us(
                        lambda i, x=x, w=weights, cfg=cfg, c=counters: splitk_linear(x, w[i], None, cfg, c), LAYERS),
                        2)
                except Exception as exc:  # out of shared memory, or a mismatch: reported, not timed
                    row["us"][name(cfg)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            timed = {c: us for c, us in row["us"].items() if isinstance(us, float)}
            best = min(timed, key=timed.get)
            row["best"], row["best_us"] = best, timed[best]
            top = sorted(timed, key=timed.get)[:4]
            print(f"{layer:<8} M={m:<4} cuBLAS {row['cublas_us']:6.2f} us   best {timed[best]:6.2f} {best}   next: "
                  + ", ".join(f"{c} {timed[c]:.2f}" for c in top[1:]), flush=True)
            rows.append(row)
        del weights
        torch.cuda.empty_cache()
    steps = {m: {"cublas_ms": round(sum(r["cublas_us"] for r in rows if r["m"] == m) * LAYERS / 1e3, 3),
                 "best_ms": round(sum(min(r["cublas_us"], r["best_us"]) for r in rows if r["m"] == m)
                                  * LAYERS / 1e3, 3)} for m in ms}
    for m, s in steps.items():
        print(f"M={m}: a step's 112 GEMMs, cuBLAS {s['cublas_ms']:.3f} ms, the better per shape {s['best_ms']:.3f} ms")
    print(json.dumps({"bench": "splitk_gemm", "device": torch.cuda.get_device_name(), "steps": steps,
                      "rows": [{k: v for k, v in r.items() if k != "us"} for r in rows]}))


if __name__ == "__main__":
    main()
