"""W8A8 GEMM for a few rows on the tensor cores: out[M, N] = (q[M, K] @ w[N, K].T) * x_scale[M] * w_scale[N] (+ bias),
q and w float8_e4m3fn, for M <= MAX_M; what torch._scaled_mm computes with row-wise scales, as one skinny launch.

Why: at batch 1 decode streams the weights, and fp8 halves their bytes, but the skinny GEMM that widens each fp8 value
on the CUDA cores (kernels/gemv.py, weight-only) streamed them at 1.5-1.85 TB/s on an H200 in every tile config swept
(issue 41, c14782a): as slow in time as bf16's GEMV, since each value costs conversions on top of its FMA. Widening to
bf16 for the tensor cores was slower still. Here nothing is converted: the input rows come quantized (q, x_scale: the
kernel before, rms_norm_fp8, act_and_mul_fp8 or quantize_rows, made them) and the tensor cores multiply fp8 by fp8
into fp32 (mma's fp8 shapes on sm_89+), the products exact; the scales multiply once, after the K reduction.

A program owns BLOCK_N output columns and walks its [BLOCK_N, K] slab of w (contiguous along K) in [BLOCK_N,
BLOCK_K] tiles, the A operand; q's rows, padded to 16 by reading the last row again, are B. The loads are
pipelined over num_stages by the compiler; no split-K (one launch, one node in a graph). Block sizes: 16-64 rows
of w a program so that the grid fills the GPU (as gemv.py's tensor-core path), 256 fp8 columns a tile; not tuned
on a GPU yet (the first measurement is owed: quantization/fp8_linear.py's ONE_ROW_FP8_DOT).
"""

import torch
import triton
import triton.language as tl

MAX_M = 32


@triton.jit
def _fp8_gemv_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_qm, stride_wn, stride_om,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Tail rows and columns read a valid row again instead of being masked; the store drops them.
    rows_w = tl.minimum(offs_n, N - 1)
    rows_q = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    q_ptrs = q_ptr + rows_q[:, None] * stride_qm + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            q = tl.load(q_ptrs + k0)
        else:
            k_mask = (k0 + offs_k)[None, :] < K
            w = tl.load(w_ptrs + k0, mask=k_mask, other=0.0)
            q = tl.load(q_ptrs + k0, mask=k_mask, other=0.0)
        acc = tl.dot(w, tl.trans(q), acc)
    res = tl.trans(acc) * tl.load(xs_ptr + rows_q)[:, None] * tl.load(ws_ptr + rows_w)[None, :]
    if HAS_BIAS:
        res += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def fp8_gemv(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q [M, K] and weight [N, K] float8_e4m3fn, x_scale [M, 1] and weight_scale [N] fp32 -> [M, N] of out_dtype,
    accumulated in fp32 (+ bias [N]), for 1 <= M <= MAX_M."""
    m, k = q.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"q has {m} rows; fp8_gemv handles 1..{MAX_M}")
    if q.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q and weight must be float8_e4m3fn, got {q.dtype} and {weight.dtype}")
    if weight.shape != (n, k) or q.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] and both contiguous along K, got {tuple(weight.shape)}")
    if x_scale.numel() != m or weight_scale.shape != (n,):
        raise ValueError(f"x_scale must hold {m} and weight_scale ({n},) values, got {tuple(x_scale.shape)} and "
                         f"{tuple(weight_scale.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    block_n = max(16, min(64, _pow2_floor(n // 128)))
    block_k = min(256, max(32, triton.next_power_of_2(k)))
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        q, x_scale.reshape(m).float(), weight, weight_scale, bias if bias is not None else weight_scale, out, m, n, k,
        q.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return out


def fp8_gemv_ref(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8_gemv in PyTorch (fp32)."""
    res = (q.float() @ weight.float().T) * x_scale.reshape(-1, 1).float() * weight_scale.float()[None, :]
    return (res if bias is None else res + bias.float()).to(out_dtype)
