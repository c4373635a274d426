"""act(gate) * up over the fused gate_up output, in one pass: SiLU (Llama, Qwen) or tanh-approximated GELU (Gemma's
gelu_pytorch_tanh). The activation is a constexpr, so SiLU's kernel is what it was.

act_and_mul_fp8: the product quantized to float8_e4m3fn for an FP8 down_proj (quantization/fp8_linear.py), instead
of written in the activation dtype: the bytes and scale kernels/fp8_quant.py's quantize_rows gives on act_and_mul's
output, in one launch. A program takes a row: with dynamic scales it computes the row twice, once for its max|y|, once
to cast (the second read of gate and up mostly from L2), rather than writing the row and reading it back."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.kernels.fp8_quant import empty_quantized, row_scale, to_fp8
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def act_mul(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in fp32 (the fused GEMVs' prologues use it too, kernels/gemv.py and silu_mul_gemv.py)."""
    if ACTIVATION == "gelu_tanh":
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (...)
        # tanh(z) = 2 sigmoid(2z) - 1: one formula the interpreter and every Triton version have.
        act = 0.5 * gate * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    else:
        act = gate * tl.sigmoid(gate)
    return act * up


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    t, b = tl.program_id(0), tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = x_ptr + t.to(tl.int64) * stride_x
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = act_mul(gate, up, ACTIVATION)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_chunk(row, offs, inter, ACTIVATION: tl.constexpr):
    """act(gate) * up at columns offs of one row, rounded to the activation dtype as act_and_mul writes it."""
    mask = offs < inter
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    return act_mul(gate, up, ACTIVATION).to(row.dtype.element_ty).to(tl.float32)


@triton.jit
def _act_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, scale_ptr, stride_x, inter, ACTIVATION: tl.constexpr,
                            STATIC: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK: tl.constexpr,
                            USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * stride_x
    if STATIC:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, inter, BLOCK):
            amax = tl.maximum(amax, tl.abs(_act_mul_chunk(row, k + tl.arange(0, BLOCK), inter, ACTIVATION)))
        s = row_scale(tl.max(amax, axis=0))
    for k in range(0, inter, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        y = _act_mul_chunk(row, offs, inter, ACTIVATION)
        tl.store(q_ptr + t * inter + offs, to_fp8(y, s, ROUND_FIRST), mask=offs < inter)
    tl.store(s_ptr + t, s)


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [T, 2I] -> act(x[:, :I]) * x[:, I:], [T, I]; activation one of ACTIVATIONS."""
    assert x.dim() == 2 and x.stride(1) == 1 and activation in ACTIVATIONS
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    block = 1024
    if num_tokens:
        pdl = use_pdl(x)
        _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                                     ACTIVATION=activation, BLOCK=block,
                                                                     USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def act_and_mul_fp8(x: torch.Tensor, activation: str = "silu",
                    scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(act_and_mul(x, activation), scale) in one launch: x [T, 2I] -> (q [T, I] float8_e4m3fn, row
    scales [T, 1] fp32)."""
    assert x.dim() == 2 and x.stride(1) == 1 and activation in ACTIVATIONS
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    q, scales = empty_quantized(num_tokens, inter, x.device)
    if num_tokens:
        pdl = use_pdl(x)
        _act_and_mul_fp8_kernel[(num_tokens,)](x, q, scales, scale if scale is not None else scales, x.stride(0),
                                               inter, ACTIVATION=activation, STATIC=scale is not None,
                                               ROUND_FIRST=not x.is_cuda,
                                               BLOCK=min(4096, triton.next_power_of_2(inter)), USE_PDL=pdl,
                                               num_warps=8, launch_pdl=pdl)
    return q, scales


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    return act_and_mul(x, "silu")


def act_and_mul_ref(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    return act_and_mul_ref(x, "silu")
