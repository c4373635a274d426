"""SiLU(gate) * up over the fused gate_up output, in one pass."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    t, b = tl.program_id(0), tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = x_ptr + t.to(tl.int64) * stride_x
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I]."""
    assert x.dim() == 2 and x.stride(1) == 1
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    block = 1024
    if num_tokens:
        pdl = use_pdl(x)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](x, out, x.stride(0), out.stride(0), inter,
                                                                      BLOCK=block, USE_PDL=pdl, num_warps=4,
                                                                      launch_pdl=pdl)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
