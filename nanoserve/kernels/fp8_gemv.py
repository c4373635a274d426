"""Skinny GEMM for FP8 weights (W8A8 with per-output-row weight scales), for decode's 1-32 rows: the FP8 twin of
kernels/gemv.py's skinny_linear. torch._scaled_mm at one row is far from bandwidth bound (Llama-3.1-8B batch-1
decode ran 5.273 ms a token with it against bf16's 4.340 on an H200), while each weight byte streamed once at
gemv.py's ~90 % of bandwidth would make FP8 about 1.87x bf16.

The math is the scheme's (nanoserve/quantization/fp8_math.py), exactly: each activation row quantized with its own
dynamic scale, max|x_row| / 448 (at least 1e-10 / 448), or one given static scale; q = x / scale rounded to nearest
(as PyTorch divides), clamped to +-448 and cast to float8_e4m3fn; then y = (q . w) * x_scale * w_scale[n] (+ bias)
with the products and their sums in fp32, returned in x's dtype. The FP8 operands are upcast for the products, which
keeps them exact: to fp32 on the CUDA cores, to bf16 for the tensor cores (every float8_e4m3fn value is a bf16
value, and bf16 products accumulate in fp32), not FP8 MMAs, whose accumulator keeps fewer bits than fp32.

Where the activation rows are quantized: with a static scale, and for one row with a dynamic scale, every program
does it for its own rows (a first pass over the row for the amax, then each tile divided as it is used): the row is
a few KB read from L2, the same trade as gemv.py's fused RMSNorm prologue, which measured a gain at one row only.
From two dynamic rows on, kernels/fp8_quant.py's quantize_rows runs first (one launch, each row read once) and the
GEMM reads the FP8 rows and their scales.

The grid and paths follow gemv.py (whose _config cites the measurements): a program owns BLOCK_N output rows of the
weight for all M rows, walking K in tiles; one row, or up to 8 rows of a narrow layer (N < 2048), on the CUDA cores
(two weight tiles in flight ahead of the one multiplied, the first two loaded before the PDL wait, since no kernel
writes weights); otherwise tl.dot with M padded to 16 or 32. Block sizes follow from shapes by _config's rule.

NOT YET MEASURED: the rule carries gemv.py's measured choices over to one-byte weights, reasoned, not timed. To
measure on a GPU (the figures go here with the GPU and date):
    python -m nanoserve.cli bench latency --model benchmarks/configs/llama-3.1-8b --max-model-len 4096 \
        --output-len 256 --quantization fp8
beside the same command without --quantization (bf16), on one machine; the goal is FP8 >= 1.65x bf16's tok/s.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fp8_quant import quantize_rows, quantize_rows_ref, round_to_fp8_grid
from nanoserve.kernels.gemv import _load, _load_tile
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

MAX_M = 32


@triton.jit
def _quantize(x, scale, ROUND_FIRST: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] (fp32) / its rows' scales as float8_e4m3fn, as fp8_quant.quantize_rows computes it."""
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
    if ROUND_FIRST:  # the interpreter's cast misrounds (kernels/fp8_quant.py)
        q = round_to_fp8_grid(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     QUANTIZE: tl.constexpr, STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                     DOT_BF16: tl.constexpr, ROUND_FIRST: tl.constexpr, EVEN_K: tl.constexpr,
                     USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """QUANTIZE: x holds the activations, quantized here with the static scale at xs_ptr (STATIC) or each row's
    dynamic one; else x holds them already quantized (FP8) and xs_ptr their rows' scales."""
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Tail rows and columns read a valid row again instead of being masked; the store drops them.
    rows_w = tl.minimum(offs_n, N - 1)
    rows_x = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
    w_scale = tl.load(ws_ptr + rows_w)  # a weight: no kernel writes it, so it loads before the wait
    if not USE_DOT:
        w = _load_tile(w_ptrs, 0, K, offs_k, BLOCK_K, EVEN_K)
        w_ahead = _load_tile(w_ptrs, BLOCK_K, K, offs_k, BLOCK_K, EVEN_K)
    wait_for_prior_grids(USE_PDL)
    if not QUANTIZE:
        x_scale = tl.load(xs_ptr + rows_x)
    elif STATIC:
        x_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(xs_ptr)
    else:
        amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = _load(x_ptrs + k0, (k0 + offs_k)[None, :] < K, EVEN_K)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        x_scale = tl.maximum(tl.max(amax, axis=1), 1e-10) / 448.0
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        # The K reduction waits for the end of the loop (one cross-warp exchange, not one per tile), as gemv.py's.
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = _load(x_ptrs, k_mask[None, :], EVEN_K)
        if QUANTIZE:
            xq = _quantize(x.to(tl.float32), x_scale, ROUND_FIRST)
        else:
            xq = x
        if USE_DOT:
            w = _load(w_ptrs, k_mask[None, :], EVEN_K)
            if DOT_BF16:
                acc = tl.dot(w.to(tl.bfloat16), tl.trans(xq.to(tl.bfloat16)), acc)
            else:  # the interpreter, which mishandles bf16
                acc = tl.dot(w.to(tl.float32), tl.trans(xq.to(tl.float32)), acc, input_precision="ieee")
            w_ptrs += BLOCK_K
        else:
            w_next = _load_tile(w_ptrs, k0 + 2 * BLOCK_K, K, offs_k, BLOCK_K, EVEN_K)
            acc += xq.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            w = w_ahead
            w_ahead = w_next
        x_ptrs += BLOCK_K
    if USE_DOT:
        res = tl.trans(acc)
    else:
        res = tl.sum(acc, axis=2)
    res = res * x_scale[:, None] * w_scale[None, :]
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


def _config(m: int, n: int, k: int, x_elem_size: int) -> _Config:
    """Block sizes from shapes, by gemv.py's measured bf16 rule (its _config) carried over to one-byte weights
    (not measured yet: module docstring)."""
    block_m = triton.next_power_of_2(m)
    k_cap = max(16, triton.next_power_of_2(k))
    if block_m == 1 or (block_m <= 8 and n < 2048):
        # CUDA cores: gemv.py's path at one row and for narrow layers up to 8 rows. gemv.py sends one row of a
        # bf16 weight of 32 MB or more to the tensor cores, but here they would take each FP8 tile through
        # registers to convert it, and the CUDA-core stream of a 117 MB bf16 weight (kernels/silu_mul_gemv.py)
        # beat cuBLAS: one row stays here at every size. Same slab rows and so the same program counts as gemv.py
        # (512+ at one row, about 4 an SM, which is what hides memory latency on this path), and tiles twice as
        # long in K, so that each holds the bytes gemv.py's measured tiles hold (8 rows x 1 KB at one row); twice
        # the warps keep the fp32 accumulator (BLOCK_M x BLOCK_N x BLOCK_K) at gemv.py's 32-64 registers a thread.
        block_n = max(2, min(_pow2_floor(n // (512 * block_m)), 8 // block_m))
        block_k = min(2048, 16384 // (block_m * block_n)) if block_n == 2 else 1024
        if block_m == 1 and block_n == 2 and k >= 6144:  # gemv.py's long two-row slab at one row, in bytes
            block_n, block_k = 4, 2048
        return _Config(False, block_m, block_n, min(block_k, k_cap), 8, 1)
    # Tensor cores, M padded to 16 or 32 (tl.dot needs 16+). gemv.py's 64 x 256 bf16 tiles (32 KB a stage) would
    # be 64 x 512 here, but a converted FP8 tile passes through registers as bf16, 128 a thread at that size:
    # 256-wide tiles keep it at 64, at half the bytes a stage, so the slabs are halved as well (32 rows from
    # N = 4096 to 8191, 64 from 8192) to keep about as many bytes in flight per SM as gemv.py's measured slabs.
    block_n = max(16, min(64, _pow2_floor(n // 128)))
    # fp32 activation tiles are twice the bytes of bf16 ones: two stages, as gemv.py's fp32 path.
    return _Config(True, max(16, block_m), block_n, min(256, k_cap), 4, 4 if x_elem_size <= 2 else 2)


def _launch(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, cfg: _Config, quantize: bool) -> None:
    """One launch: quantize = x holds the activations (x_scale the static scale, or None for dynamic ones), else
    x holds their FP8 rows and x_scale the rows' scales."""
    m, k = x.shape
    n = weight.shape[0]
    pdl = use_pdl(x)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
        x, x_scale if x_scale is not None else weight_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        QUANTIZE=quantize, STATIC=quantize and x_scale is not None, HAS_BIAS=bias is not None, USE_DOT=cfg.use_dot,
        DOT_BF16=x.is_cuda, ROUND_FIRST=not x.is_cuda, EVEN_K=k % cfg.block_k == 0, USE_PDL=pdl,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             input_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32; 1 <= M <= MAX_M) times weight [N, K] (float8_e4m3fn) scaled per output row by
    weight_scale [N] (fp32), plus bias [N], in x's dtype; x quantized per row dynamically, or with input_scale
    (one number) if given. out, if given, is written and returned."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D [M, K] with a contiguous last dim, got shape {tuple(x.shape)}")
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x has {m} rows; fp8_gemv handles 1..{MAX_M}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [N, {k}] with a contiguous last dim, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    n = weight.shape[0]
    if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
        raise ValueError(f"weight_scale must be contiguous fp32 of shape ({n},), got {tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous of shape ({n},), got {tuple(bias.shape)}")
    if input_scale is not None and (input_scale.numel() != 1 or input_scale.dtype != torch.float32):
        raise ValueError(f"input_scale must be one fp32 number, got {input_scale.dtype} {tuple(input_scale.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be [{m}, {n}] of {x.dtype} with a contiguous last dim, got {tuple(out.shape)}")
    cfg = _config(m, n, k, x.element_size())
    if input_scale is not None or m == 1:
        _launch(x, input_scale, weight, weight_scale, bias, out, cfg, quantize=True)
    else:
        q, scales = quantize_rows(x)
        _launch(q, scales, weight, weight_scale, bias, out, cfg, quantize=False)
    return out


def fp8_gemv_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_gemv in PyTorch (fp32), in the kernel's order: the quantized rows times the FP8 weight, then the scales."""
    q, x_scale = quantize_rows_ref(x, input_scale)
    y = (q.float() @ weight.float().T) * x_scale * weight_scale.float()[None, :]
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)

