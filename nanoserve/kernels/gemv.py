"""Skinny GEMM for decode: out[M, N] = x[M, K] @ weight[N, K].T (+ bias) for a handful of rows.

At M <= 16 a linear layer is a pass over its weight, so the kernel is built to stream each weight byte
once at full bandwidth: a program owns BLOCK_N output columns for all M rows and walks its [BLOCK_N, K]
slab of the weight (contiguous along K) in wide, coalesced [BLOCK_N, BLOCK_K] tiles: on the CUDA cores at
M <= 2, on the tensor cores (M padded to 16) from M = 3 (from M = 9 when N < 2048). There is one launch and no split-K
partials to reduce, so a call adds one node to a CUDA graph, and block sizes come from shapes by an
explicit rule (no autotuning, which cannot run inside graph capture).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_M = 16


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                          HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Tail rows and columns read a valid row again instead of being masked, so full tiles load without
    # predicates; the store below drops them.
    rows_w = tl.minimum(offs_n, N - 1)
    rows_x = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        # The K reduction is deferred to after the loop: reducing every tile would cost a cross-warp
        # exchange and a barrier per iteration.
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
        if USE_DOT:
            # Tensor cores take the weight tile as it is (the A operand, K-contiguous) and x as B [K, M]
            # (also K-contiguous), accumulating in fp32.
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        res = tl.trans(acc)
    else:
        res = tl.sum(acc, axis=2)
    if HAS_BIAS:
        res += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


class _Config(NamedTuple):
    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _config(m: int, n: int, k: int, elem_size: int) -> _Config:
    """Block sizes from shapes alone, by a rule fitted to a sweep on an H200 (132 SMs, bf16, the Qwen3-0.6B and
    Llama-3.1-8B decode layers at M = 1, 2, 4, 8, 16, in CUDA graphs): the rule's pick was within 5% of the
    sweep's best config in most cases, 12% at worst (M = 2, N = 6144, where the tensor-core path won)."""
    block_m = triton.next_power_of_2(m)
    k_cap = max(16, triton.next_power_of_2(k))
    if block_m <= 2 or (block_m <= 8 and n < 2048):
        # CUDA-core path. Its weight loads go to registers, so memory latency is hidden only by many resident
        # programs: slabs of 2-8 rows give 512+ programs at M = 1 (about 4 per SM). The accumulator holds
        # BLOCK_M x BLOCK_N x BLOCK_K fp32 values, so wider M takes narrower slabs.
        block_n = max(2, min(_pow2_floor(n // (512 * block_m)), 8 // block_m))
        # Two-row slabs (small N, or M >= 4) stream the longest K stretch, up to 1024, that keeps the accumulator
        # within 64 registers a thread; wider slabs measured best at 512 (1024 was 5-20% slower at K = 1024).
        block_k = min(1024, 8192 // (block_m * block_n)) if block_n == 2 else 512
        return _Config(False, block_m, block_n, min(block_k, k_cap), 4, 1)
    # Tensor-core path for M >= 3 (M >= 9 at small N): M FMAs per weight element would make the CUDA-core
    # path compute bound (an H200 has about 67 fp32 TFLOP/s against 4.8 TB/s): at N >= 4096 it measured
    # 1.3-1.7x slower than this one at M = 4 and 2.2-2.6x at M = 8. Below N = 2048 the CUDA-core path
    # stays up to M = 8, since 16-row slabs would give under 128 programs. tl.dot needs every tile dim
    # >= 16, so M is padded to 16 (free: the weight stream dominates). Its loads are asynchronous copies
    # pipelined over 4 stages (32 KB each for a 64 x 256 bf16 tile), so a few programs per SM already keep
    # the memory busy: 64-row slabs measured best wherever that still gives 64+ programs, 16-row ones below.
    block_n = max(16, min(64, _pow2_floor(n // 64)))
    # fp32 tiles are twice the bytes (4 stages would need 320 KB): two fit in the 227 KB of shared memory.
    return _Config(True, 16, block_n, min(256, k_cap), 4, 4 if elem_size <= 2 else 2)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            cfg: _Config) -> None:
    m, k = x.shape
    n = weight.shape[0]
    _skinny_linear_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype, accumulated in fp32, for 1 <= M <= MAX_M.

    Inputs need a contiguous last dimension; out, if given, is written in place and returned.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D [M, K] with a contiguous last dim, got shape {tuple(x.shape)}")
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x has {m} rows; skinny_linear handles 1..{MAX_M} (use F.linear above that)")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [N, {k}] with a contiguous last dim, got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous of shape ({n},), got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be [{m}, {n}] of {x.dtype} with a contiguous last dim, got {tuple(out.shape)}")
    _launch(x, weight, bias, out, _config(m, n, k, x.element_size()))
    return out


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch version of skinny_linear, in fp32."""
    res = x.float() @ weight.float().T
    if bias is not None:
        res += bias.float()
    res = res.to(x.dtype)
    if out is None:
        return res
    return out.copy_(res)
