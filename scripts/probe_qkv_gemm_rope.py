"""The qkv projection then qkv_rope_store (cuBLAS, then a Triton launch) against one launch doing both (the kernel
below) on Qwen3-0.6B's shapes, at the row counts of large decode steps and short prefill chunks. (GPU only.)

Measured on an H200 (BENCHMARKS.md, session of 6494cf1) and not put in the engine: the fused launch lost 0.3-0.6 us
a layer at 48-128 rows and won 0.5 at 256, and in the engine it moved neither the throughput run nor the prefix one.

Each layer runs RMSNorm, then the pair or the fused kernel, with its own weight (28 layers, more than the L2 holds),
captured in one CUDA graph with PDL between the Triton launches. Prints microseconds a layer per variant (BLOCK_M,
warps, K tile of the fused kernel), the largest difference of its queries and of the K/V it stored from the
pair's, and one JSON line.

    python scripts/probe_qkv_gemm_rope.py [--rows 48,64,100,128,192,256]
"""

import argparse
import functools
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from probe_two_batch import capture_step
from sweep_gemv_chain import replay_us

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids
from nanoserve.kernels.qkv_rope_store import qkv_rope_store
from nanoserve.kernels.rms_norm import rms_norm

# The fused kernel's rows a program, warps and K tile: set per variant below.
BLOCK_M = 64
NUM_WARPS = 4
BLOCK_K = 128


@triton.jit
def _load_x(x_ptrs, k, K, offs_k, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptrs)
    else:
        return tl.load(x_ptrs, mask=(k + offs_k)[None, :] < K, other=0.0)


@triton.jit
def _load_w(w_ptrs, k, K, offs_k, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs)
    else:
        return tl.load(w_ptrs, mask=(k + offs_k)[:, None] < K, other=0.0)


@triton.jit
def _qkv_gemm_rope_kernel(x_ptr, w_ptr, b_ptr, q_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
                          k_cache_ptr, v_cache_ptr, M, K, stride_xm, stride_wn, stride_qm, stride_c, eps,
                          num_q_heads, num_kv_heads, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                          EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_m, M - 1)  # tail rows read a valid row again; their stores are dropped
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    # [BLOCK_K, HALF] tiles of weight.T: the head's first and second halves.
    cols = (head * HEAD_DIM + offs_h).to(tl.int64)
    w1_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]
    w2_ptrs = w1_ptrs + HALF * stride_wn
    # x is the previous kernel's output (the input norm), so nothing is loaded before the wait.
    wait_for_prior_grids(USE_PDL)
    acc1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = _load_x(x_ptrs, k, K, offs_k, EVEN_K)
        acc1 = tl.dot(x, _load_w(w1_ptrs, k, K, offs_k, EVEN_K), acc1, input_precision=DOT_PRECISION)
        acc2 = tl.dot(x, _load_w(w2_ptrs, k, K, offs_k, EVEN_K), acc2, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
        w2_ptrs += BLOCK_K
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + cols + HALF).to(tl.float32)[None, :]
    dtype = q_ptr.dtype.element_ty
    # The qkv values the unfused path would hold.
    y1 = acc1.to(dtype).to(tl.float32)
    y2 = acc2.to(dtype).to(tl.float32)
    live = offs_m < M
    if head < num_q_heads + num_kv_heads:  # a query or key head: norm, then rotary
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / HEAD_DIM + eps)[:, None]
            if head < num_q_heads:
                w1 = tl.load(q_w_ptr + offs_h).to(tl.float32)[None, :]
                w2 = tl.load(q_w_ptr + HALF + offs_h).to(tl.float32)[None, :]
            else:
                w1 = tl.load(k_w_ptr + offs_h).to(tl.float32)[None, :]
                w2 = tl.load(k_w_ptr + HALF + offs_h).to(tl.float32)[None, :]
            # As rms_norm: normalize, round, scale, round.
            y1 = ((y1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            y2 = ((y2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + rows).to(tl.int64)
        cos = tl.load(cos_ptr + pos[:, None] * stride_c + offs_h[None, :])
        sin = tl.load(sin_ptr + pos[:, None] * stride_c + offs_h[None, :])
        r1 = (y1 * cos - y2 * sin).to(dtype)
        r2 = (y2 * cos + y1 * sin).to(dtype)
        if head < num_q_heads:
            dst = q_ptr + offs_m.to(tl.int64)[:, None] * stride_qm + head * HEAD_DIM + offs_h[None, :]
            tl.store(dst, r1, mask=live[:, None])
            tl.store(dst + HALF, r2, mask=live[:, None])
        else:
            slot = tl.load(slot_ptr + rows).to(tl.int64)
            # The caches are contiguous, so a slot's heads are num_kv_heads * HEAD_DIM consecutive elements.
            dst = k_cache_ptr + (slot * num_kv_heads + head - num_q_heads)[:, None] * HEAD_DIM + offs_h[None, :]
            store = (live & (slot >= 0))[:, None]
            tl.store(dst, r1.to(k_cache_ptr.dtype.element_ty), mask=store)
            tl.store(dst + HALF, r2.to(k_cache_ptr.dtype.element_ty), mask=store)
    else:  # a value head, into the cache as it is
        slot = tl.load(slot_ptr + rows).to(tl.int64)
        kv_head = head - num_q_heads - num_kv_heads
        dst = v_cache_ptr + (slot * num_kv_heads + kv_head)[:, None] * HEAD_DIM + offs_h[None, :]
        store = (live & (slot >= 0))[:, None]
        tl.store(dst, y1.to(v_cache_ptr.dtype.element_ty), mask=store)
        tl.store(dst + HALF, y2.to(v_cache_ptr.dtype.element_ty), mask=store)


def _num_stages(block_m: int, block_k: int, head_dim: int, elem_size: int) -> int:
    """As many pipeline stages (x tile and the head's weight tile each) as fit in 200 KB of shared memory, up to 4."""
    stage = (block_m + head_dim) * block_k * elem_size
    return max(1, min(4, (200 << 10) // stage))


def qkv_gemm_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_q_heads: int,
                  num_kv_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv_rope_store(x @ weight.T + bias, ...) in one launch; returns the rotated queries [T, Hq, D].

    x [T, K] with a contiguous last dim; weight [(Hq + 2 Hkv) * D, K] (q, k, v heads in turn), bias [N] or None;
    the rest as qkv_rope_store takes them: positions and slot_mapping [T] (slot -1: not stored), cos/sin
    [max_pos, D/2] fp32, q_weight/k_weight [D] or both None, caches [blocks, block_size, Hkv, D] contiguous.
    """
    t, k = x.shape
    n = weight.shape[0]
    heads = num_q_heads + 2 * num_kv_heads
    head_dim = n // heads
    if x.stride(1) != 1 or weight.stride(1) != 1 or weight.shape[1] != k:
        raise ValueError(f"x [T, K] and weight [N, K] need contiguous rows, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if n != heads * head_dim or head_dim not in (64, 128) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{heads} heads x 64 or 128, {k}] of {x.dtype}, got {tuple(weight.shape)} "
                         f"of {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous of shape ({n},), got {tuple(bias.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be given together")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"the caches must be contiguous [blocks, block_size, {num_kv_heads}, {head_dim}], got "
                         f"{tuple(k_cache.shape)}")
    if positions.shape != (t,) or slot_mapping.shape != (t,) or cos.shape[1] * 2 != head_dim:
        raise ValueError(f"positions and slot_mapping must be [{t}] and cos/sin [max_pos, {head_dim // 2}]")
    q = torch.empty(t, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    if t == 0:
        return q
    block_k = min(BLOCK_K, triton.next_power_of_2(max(k, 16)))
    pdl = use_pdl(x)
    has_norm = q_weight is not None
    _qkv_gemm_rope_kernel[(triton.cdiv(t, BLOCK_M), heads)](
        x, weight, bias if bias is not None else weight, q, q_weight if has_norm else cos,
        k_weight if has_norm else cos, cos, sin, positions, slot_mapping, k_cache, v_cache, t, k, x.stride(0),
        weight.stride(0), q.stride(0), cos.stride(0), eps, num_q_heads, num_kv_heads,
        HAS_BIAS=bias is not None, HAS_NORM=has_norm, EVEN_K=k % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        USE_PDL=pdl, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_K=block_k,
        num_warps=NUM_WARPS, num_stages=_num_stages(BLOCK_M, block_k, head_dim, x.element_size()), launch_pdl=pdl)
    return q


HIDDEN, HQ, HKV, D, LAYERS, BLOCK_SIZE = 1024, 16, 8, 128, 28, 16
VARIANTS = [(32, 4, 128), (64, 4, 128), (64, 8, 128), (128, 8, 128), (64, 4, 64), (128, 8, 64)]


def chain_pair(weights: list[torch.Tensor], x: torch.Tensor, norm_w: torch.Tensor, rope: tuple) -> torch.Tensor:
    for w in weights:
        qkv = F.linear(rms_norm(x, norm_w, 1e-6), w)
        qkv_rope_store(qkv, *rope)
    return qkv[:, :HQ * D].view(x.shape[0], HQ, D)


def chain_fused(weights: list[torch.Tensor], x: torch.Tensor, norm_w: torch.Tensor, rope: tuple) -> torch.Tensor:
    for w in weights:
        q = qkv_gemm_rope(rms_norm(x, norm_w, 1e-6), w, None, *rope)
    return q


def main() -> None:
    global BLOCK_M, NUM_WARPS, BLOCK_K
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="48,64,100,128,192,256")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn((HQ + 2 * HKV) * D, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16()
               for _ in range(LAYERS)]
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    qk_w = (1 + 0.3 * torch.randn(2, D, device="cuda", generator=gen)).bfloat16()
    freqs = torch.randn(4096, D // 2, device="cuda", generator=gen)
    cos, sin = freqs.cos(), freqs.sin()
    result = {"probe": "qkv_gemm_rope", "device": torch.cuda.get_device_name()}
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, HIDDEN, device="cuda", generator=gen).bfloat16()
        pos = torch.randint(0, 4096, (m,), device="cuda", generator=gen)
        slots = torch.randperm(m * 4, device="cuda", generator=gen)[:m]
        caches = [torch.zeros(m * 4 // BLOCK_SIZE + 1, BLOCK_SIZE, HKV, D, device="cuda", dtype=torch.bfloat16)
                  for _ in range(2)]
        rope = (HQ, HKV, pos, cos, sin, qk_w[0], qk_w[1], 1e-6, *caches, slots)

        pair = functools.partial(chain_pair, weights, x, norm_w, rope)
        one = functools.partial(chain_fused, weights, x, norm_w, rope)
        row = {}
        for name, fn, cfg in [("pair", pair, None)] + [(f"fused_m{bm}w{nw}k{bk}", one, (bm, nw, bk))
                                                       for bm, nw, bk in VARIANTS]:
            if cfg is not None:
                BLOCK_M, NUM_WARPS, BLOCK_K = cfg
            try:
                fn()  # compile outside the capture
            except Exception as err:  # a config that does not fit (shared memory) is reported, not fatal
                print(f"M={m} {name}: {type(err).__name__}: {str(err)[:100]}")
                continue
            graph, out = capture_step(fn)
            stored = [c[slots // BLOCK_SIZE, slots % BLOCK_SIZE].float() for c in caches]  # this variant's K/V
            if name == "pair":
                ref, ref_stored = out, stored
            row[name] = {"us": round(replay_us(graph, LAYERS), 2),
                         "max_diff": round((out.float() - ref.float()).abs().max().item(), 4),
                         "kv_max_diff": round(max((a - b).abs().max().item() for a, b in zip(stored, ref_stored,
                                                                                          strict=True)), 4)}
            del graph
        best = min((k for k in row if k != "pair"), key=lambda k: row[k]["us"])
        print(f"M={m:<4} pair {row['pair']['us']:6.2f} us a layer   best {best} {row[best]['us']:6.2f}   "
              + "  ".join(f"{k} {v['us']:.2f} ({v['max_diff']}, {v['kv_max_diff']})" for k, v in row.items()
                          if k != "pair"))
        result[str(m)] = row
    print(json.dumps(result))


if __name__ == "__main__":
    main()
