"""Rotary embedding applied in place to q and k in one launch (rotate-half layout, as Hugging Face).

With partial rotary (Phi-3's partial_rotary_factor) the cos/sin tables are narrower than half a head: the first
2 * HALF dimensions of each head rotate and the rest are left as they are (never loaded).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_c, num_q_heads, num_k_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    if BLOCK_HALF == HALF:
        cos = tl.load(cos_ptr + pos * stride_c + offs)[None, :]
        sin = tl.load(sin_ptr + pos * stride_c + offs)[None, :]
    else:  # a rotated half that is not a power of two (Phi-4-mini's 48 of 128), padded
        cols = (offs < HALF)[None, :]
        cos = tl.load(cos_ptr + pos * stride_c + offs[None, :], mask=cols, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_c + offs[None, :], mask=cols, other=0.0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    for which in tl.static_range(2):
        if which == 0:
            base, st, sh, nh = q_ptr, stride_qt, stride_qh, num_q_heads
        else:
            base, st, sh, nh = k_ptr, stride_kt, stride_kh, num_k_heads
        ptr = base + t.to(tl.int64) * st + heads * sh + offs[None, :]
        mask = heads < nh
        if BLOCK_HALF != HALF:
            mask = mask & cols
        x1 = tl.load(ptr, mask=mask, other=0.0)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptr, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
        tl.store(ptr + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor) -> None:
    """q [T, Hq, D], k [T, Hk, D] (last dim contiguous), cos/sin [max_pos, R/2] fp32 for a rotation of the first
    R <= D dimensions, positions [T]."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.shape[1] * 2 <= head_dim
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                  cos.stride(0), num_q_heads, k.shape[1], HALF=cos.shape[1],
                                  BLOCK_HALF=triton.next_power_of_2(cos.shape[1]),
                                  BLOCK_H=triton.next_power_of_2(max(num_q_heads, k.shape[1])), num_warps=4)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor) -> None:
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    half = cos.shape[1]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        x[..., :2 * half] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
