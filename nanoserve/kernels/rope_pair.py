"""Rotary on whole heads in registers, each dimension beside its rotary partner: the device pieces that
qkv_rope_store.py (for partial rotary) and decode_rope_attention.py share.

A head [R, HEAD_DIM] is loaded twice, once as it is and once with each dimension's partner in its place (x_pair),
so that rotate-half is elementwise: out[d] = x[d] cos + sign(d) x_pair[d] sin. With partial rotary (Phi-3's
`partial_rotary_factor`) only the first 2 * ROT_HALF dimensions rotate, in rotate-half layout among themselves; the
others are their own partner with cos 1 and sin 0, so they pass through unchanged (x * 1 + x * 0 is x exactly).
ROT_HALF == HEAD_DIM // 2 (every other model) compiles to the code these kernels ran before partial rotary: no masks,
no selects.
"""

import triton
import triton.language as tl


@triton.jit
def rope_pair(HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr):
    """Each dimension's rotary partner [HEAD_DIM]: d + ROT_HALF in the first half of the rotated dimensions, d -
    ROT_HALF in the second, d itself past them."""
    offs_d = tl.arange(0, HEAD_DIM)
    if ROT_HALF * 2 == HEAD_DIM:
        pair = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    else:
        second = tl.where(offs_d < 2 * ROT_HALF, offs_d - ROT_HALF, offs_d)
        pair = tl.where(offs_d < ROT_HALF, offs_d + ROT_HALF, second)
    return pair


@triton.jit
def rope_cos_sin(cos_ptr, sin_ptr, pos, stride_c, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr):
    """cos and sin at `pos` for every dimension, fp32 [1, HEAD_DIM] (a table row holds ROT_HALF values, one per
    rotated pair); 1 and 0 on the dimensions that do not rotate."""
    offs_d = tl.arange(0, HEAD_DIM)
    if ROT_HALF * 2 == HEAD_DIM:
        cos = tl.load(cos_ptr + pos * stride_c + offs_d % ROT_HALF)
        sin = tl.load(sin_ptr + pos * stride_c + offs_d % ROT_HALF)
    else:
        rotated = offs_d < 2 * ROT_HALF
        col = tl.where(offs_d < ROT_HALF, offs_d, offs_d - ROT_HALF)
        cos = tl.load(cos_ptr + pos * stride_c + col, mask=rotated, other=1.0)
        sin = tl.load(sin_ptr + pos * stride_c + col, mask=rotated, other=0.0)
    return cos[None, :], sin[None, :]


@triton.jit
def norm_weight(w_ptr, pair, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A per-head RMSNorm weight at d and at d's rotary partner, fp32 [1, HEAD_DIM]; ones (never used) without the
    norm."""
    offs_d = tl.arange(0, HEAD_DIM)
    if HAS_NORM:
        w = tl.load(w_ptr + offs_d).to(tl.float32)
        w_pair = tl.load(w_ptr + pair).to(tl.float32)
    else:
        w = tl.full([HEAD_DIM], 1.0, tl.float32)
        w_pair = w
    return w[None, :], w_pair[None, :]


@triton.jit
def norm_rope(
    x, x_pair, w, w_pair, cos, sin, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr
):
    """Heads x [R, HEAD_DIM] (x_pair: the same heads with each dimension's partner in its place) after the per-head
    RMSNorm (HAS_NORM) and rotate-half rotary, rounded to x's dtype where qkv_rope_store rounds."""
    dtype = x.dtype
    y, y_pair = x.to(tl.float32), x_pair.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(y * y, axis=1) / HEAD_DIM + eps)[:, None]
        # As rms_norm: normalize, round, scale, round (the rotary kernel then reads the rounded values).
        y = ((y * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        y_pair = ((y_pair * rstd).to(dtype).to(tl.float32) * w_pair).to(dtype).to(tl.float32)
    # First half: x1 cos - x2 sin; second half: x2 cos + x1 sin (negating is exact, so this is the same sum).
    first_half = (tl.arange(0, HEAD_DIM) < ROT_HALF)[None, :]
    return (y * cos + tl.where(first_half, -y_pair, y_pair) * sin).to(dtype)
