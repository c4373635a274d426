"""RMSNorm in one pass, optionally adding the residual first (the add, the norm and both writes fused).

Rows are addressed as [N, M, D] with strides for N and M, so the per-head q/k norms of Qwen3 run on
the strided views of the fused qkv output without a copy.

weight_offset: Gemma's norms scale by (offset + weight), offset 1.0, and as transformers' Gemma RMSNorm they multiply
in fp32 and round once, where Llama's rounds the normalized row before the weight. A constexpr: 0.0 compiles the
Llama kernel unchanged.

rms_norm_fp8: the normalized row quantized to float8_e4m3fn for an FP8 projection after it
(quantization/fp8_linear.py), instead of written in the activation dtype: the bytes and scale kernels/fp8_quant.py's
quantize_rows gives on rms_norm's output (the row rounded to the activation dtype first, as that output is), with
one launch and one read of the row fewer. The residual is written as rms_norm writes it.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fp8_quant import empty_quantized, row_scale, to_fp8
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_xn, stride_xm, stride_rn, stride_on, stride_om,
                     eps, s_ptr, scale_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     WEIGHT_OFFSET: tl.constexpr, USE_PDL: tl.constexpr, QUANTIZE: tl.constexpr = False,
                     STATIC: tl.constexpr = False, ROUND_FIRST: tl.constexpr = False):
    """QUANTIZE: out is float8_e4m3fn [N, D] and s_ptr the row scales [N] (M is 1); STATIC: every row's scale is
    scale_ptr's one number, else the row's max|y| / 448."""
    wait_for_prior_grids(USE_PDL)
    n, m = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x_row = x_ptr + n.to(tl.int64) * stride_xn + m * stride_xm
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_row = res_ptr + n.to(tl.int64) * stride_rn
        # The sum is rounded to the activation dtype first, as the unfused model does.
        x = x + tl.load(r_row + offs, mask=mask, other=0.0)
        tl.store(r_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_OFFSET != 0.0:
        y = xf * rstd * (w + WEIGHT_OFFSET)
    else:
        y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    if QUANTIZE:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # the row quantize_rows reads from rms_norm's output
        if STATIC:
            s = tl.load(scale_ptr).to(tl.float32)
        else:
            s = row_scale(tl.max(tl.abs(y), axis=0))
        tl.store(out_ptr + n.to(tl.int64) * stride_on + offs, to_fp8(y, s, ROUND_FIRST), mask=mask)
        tl.store(s_ptr + n, s)
    else:
        tl.store(out_ptr + n.to(tl.int64) * stride_on + m * stride_om + offs, y.to(out_ptr.dtype.element_ty),
                 mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0) -> torch.Tensor:
    """x [..., D] (last dim contiguous; 2-D, or 3-D with any leading strides) -> a new normalized tensor.
    With `residual` (contiguous, x's shape), x + residual is normalized and written back into residual.
    weight_offset: the row is scaled by weight_offset + weight (module docstring)."""
    assert x.stride(-1) == 1 and weight.is_contiguous()
    x3 = x if x.dim() == 3 else x.view(x.shape[0], 1, x.shape[-1]) if x.dim() == 2 else x.reshape(-1, 1, x.shape[-1])
    n, m, d = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and x.dim() == 2
    _launch(x3, weight, eps, residual, weight_offset, out, out.stride(0), out.stride(1))
    return out.view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 weight_offset: float = 0.0, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(rms_norm(x, weight, eps, residual, weight_offset), scale) in one launch: x [T, D] (last dim
    contiguous) -> (q [T, D] float8_e4m3fn, row scales [T, 1] fp32); residual as rms_norm's."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
    q, scales = empty_quantized(x.shape[0], x.shape[1], x.device)
    _launch(x.view(x.shape[0], 1, x.shape[1]), weight, eps, residual, weight_offset, q, q.stride(0), 0,
            s_ptr=scales, scale_ptr=scale if scale is not None else scales, QUANTIZE=True, STATIC=scale is not None,
            ROUND_FIRST=not x.is_cuda)
    return q, scales


def _launch(x3: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, weight_offset: float,
            out: torch.Tensor, stride_on: int, stride_om: int, s_ptr: torch.Tensor | None = None,
            scale_ptr: torch.Tensor | None = None, **quantize) -> None:
    """One program a row of x3 [N, M, D]; the reduction's layout (BLOCK_D, num_warps) is the same with QUANTIZE or
    without, so that rms_norm_fp8's row is rms_norm's, bit for bit."""
    n, m, d = x3.shape
    block = triton.next_power_of_2(d)
    pdl = use_pdl(x3)
    _rms_norm_kernel[(n, m)](x3, residual if residual is not None else x3, weight, out, x3.stride(0), x3.stride(1),
                             residual.stride(0) if residual is not None else 0, stride_on, stride_om, eps,
                             s_ptr if s_ptr is not None else out, scale_ptr if scale_ptr is not None else out,
                             D=d, BLOCK_D=block, HAS_RESIDUAL=residual is not None,
                             WEIGHT_OFFSET=float(weight_offset), USE_PDL=pdl, launch_pdl=pdl,
                             num_warps=min(max(block // 256, 1), 8), **quantize)  # one warp per 256 elements


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 weight_offset: float = 0.0) -> torch.Tensor:
    """The Hugging Face computation (Llama's, or Gemma's with weight_offset); updates `residual` in place like the
    kernel."""
    if residual is not None:
        x = x + residual
        residual.copy_(x)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_offset:
        return (xf * (weight_offset + weight.float())).to(dtype)
    return weight * xf.to(dtype)
