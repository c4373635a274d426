"""Activations to FP8 for torch._scaled_mm, one launch: each row of x [M, K] divided by its scale and cast to
float8_e4m3fn, the scale being the row's own max|x| / 448 (dynamic per token) or one given number (static per
tensor), and written out as [M, 1] fp32, the rowwise scale _scaled_mm takes. A program handles one row, in chunks of
BLOCK columns: a first pass for the amax, a second to cast. The division is rounded to nearest, as PyTorch's, so the
kernel gives its reference's bytes (quantize_rows_ref; nanoserve/quantization/fp8_math.py defines the scheme).

The Triton interpreter's cast to FP8 is not the GPU's (round to nearest even): it rounds ties away from zero, flushes
subnormals, and loses the carry when rounding up crosses a power of two (30.9 became 16). Under it (ROUND_FIRST)
the value is first rounded to FP8's grid in fp32 (round_to_fp8_grid), so that the cast is exact there.
"""

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_AMAX = 1e-10  # nanoserve/quantization/fp8_math.py's


@triton.jit
def round_to_fp8_grid(x):
    """x (fp32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even: its spacing is 2^(e - 3) for
    |x| in [2^e, 2^(e + 1)), e >= -6 (below, subnormals spaced 2^-9); adding and subtracting 2^23 rounds
    |x| / spacing (< 16) to an integer, to even, in fp32's own rounding."""
    e = (x.to(tl.int32, bitcast=True) >> 23 & 0xFF) - 127
    spacing = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(x) / spacing + 8388608.0) - 8388608.0) * spacing
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def row_scale(amax):
    """A row's dynamic scale from its max|x| (fp32)."""
    return tl.maximum(amax, 1e-10) / 448.0


@triton.jit
def to_fp8(x, s, ROUND_FIRST: tl.constexpr):
    """x (fp32) / s, clamped and cast to float8_e4m3fn. The fused producers (kernels/rms_norm.py, activation.py)
    quantize their rows with it, so that their bytes are this kernel's."""
    q = tl.clamp(tl.math.div_rn(x, s), -448.0, 448.0)
    if ROUND_FIRST:
        q = round_to_fp8_grid(q)
    return q.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, scale_ptr, K, stride_x, STATIC: tl.constexpr,
                          ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        s = row_scale(tl.max(amax, axis=0))
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + offs, to_fp8(x, s, ROUND_FIRST), mask=offs < K)
    tl.store(s_ptr + row, s)


def empty_quantized(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a quantizing kernel: q [M, K] float8_e4m3fn and the row scales [M, 1] fp32."""
    return (torch.empty((m, k), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((m, 1), dtype=torch.float32, device=device))


def quantize_rows(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] fp32): per-row dynamic scales, or `scale` (one number)
    for every row."""
    m, k = x.shape
    assert x.stride(1) == 1
    q, scales = empty_quantized(m, k, x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scales, scale if scale is not None else scales, k, x.stride(0),
                                    STATIC=scale is not None, ROUND_FIRST=not x.is_cuda,
                                    BLOCK=min(2048, triton.next_power_of_2(k)))
    return q, scales


def quantize_rows_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in PyTorch."""
    if scale is None:
        scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    else:
        scales = scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales.contiguous()
