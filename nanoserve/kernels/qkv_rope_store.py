"""After the qkv projection, in one launch: Qwen3's per-head RMSNorm of q and k (when the model has it),
rotary on q and k in place, and k and v written into the paged KV cache.

Separately these are four launches per layer (q norm, k norm, rotary, store); at batch 1 a decode step
is bound by launches, not bytes, so one program per token does all of them. The arithmetic and
its roundings follow the unfused kernels (rms_norm.py, rotary.py) step for step, so outputs match them, Gemma 3's
norms (norm_offset 1.0: the scale is 1 + weight, multiplied before the one rounding) included.

With partial rotary (cos/sin tables narrower than half a head: Phi-3's partial_rotary_factor) the heads are handled
whole, each dimension beside its rotary partner (rope_pair.py), and the dimensions past the rotated ones pass through;
full rotary keeps the two-halves code below, which loads each element once.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.kv_store import to_cache
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids
from nanoserve.kernels.rope_pair import norm_rope, norm_weight, rope_cos_sin, rope_pair


@triton.jit
def _qkv_rope_store_kernel(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                           stride_t, stride_c, eps, num_q_heads, num_kv_heads, k_scale, v_scale,
                           HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr,
                           NORM_OFFSET: tl.constexpr, KV_FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """HALF: half the rotated dimensions of a head (the tables' width); HEAD_DIM // 2 but for partial rotary."""
    # One program per token, all its q and k heads at once (q heads first, then k heads, each of which also
    # stores its v head): a program per (token, head) made a 2,100-token prefill take 38 us a layer on an
    # H200, tens of thousands of one-warp programs moving 256 bytes each.
    wait_for_prior_grids(USE_PDL)
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    valid = heads < num_q_heads + num_kv_heads
    is_q = heads < num_q_heads
    pos = tl.load(pos_ptr + t).to(tl.int64)
    row = qkv_ptr + t.to(tl.int64) * stride_t  # q and k heads are consecutive in a row
    if HALF * 2 != HEAD_DIM:
        _partial_rope_store(row, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos, slot_ptr + t, k_cache_ptr, v_cache_ptr,
                            stride_c, eps, num_q_heads, num_kv_heads, k_scale, v_scale, HEAD_DIM, HALF, HAS_NORM,
                            NORM_OFFSET, KV_FP8, BLOCK_H)
    else:
        offs = tl.arange(0, HALF)
        ptrs = row + heads[:, None] * HEAD_DIM + offs[None, :]
        x1 = tl.load(ptrs, mask=valid[:, None], other=0.0)
        x2 = tl.load(ptrs + HALF, mask=valid[:, None], other=0.0)
        dtype = x1.dtype
        y1, y2 = x1.to(tl.float32), x2.to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / HEAD_DIM + eps)[:, None]
            w1 = tl.where(is_q[:, None], tl.load(q_w_ptr + offs)[None, :], tl.load(k_w_ptr + offs)[None, :])
            w2 = tl.where(is_q[:, None], tl.load(q_w_ptr + HALF + offs)[None, :],
                          tl.load(k_w_ptr + HALF + offs)[None, :])
            w1, w2 = w1.to(tl.float32) + NORM_OFFSET, w2.to(tl.float32) + NORM_OFFSET
            if NORM_OFFSET != 0.0:
                # As rms_norm with an offset (Gemma): normalize and scale in fp32, round once.
                y1 = (y1 * rstd * w1).to(dtype).to(tl.float32)
                y2 = (y2 * rstd * w2).to(dtype).to(tl.float32)
            else:
                # As rms_norm: normalize, round, scale, round (the rotary kernel then reads the rounded values).
                y1 = ((y1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
                y2 = ((y2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        cos = tl.load(cos_ptr + pos * stride_c + offs)[None, :]
        sin = tl.load(sin_ptr + pos * stride_c + offs)[None, :]
        r1 = (y1 * cos - y2 * sin).to(dtype)
        r2 = (y2 * cos + y1 * sin).to(dtype)
        tl.store(ptrs, r1, mask=valid[:, None])
        tl.store(ptrs + HALF, r2, mask=valid[:, None])
        slot = tl.load(slot_ptr + t).to(tl.int64)
        slots = tl.zeros([BLOCK_H], dtype=tl.int64) + slot  # a vector, so the mask below has the heads' shape
        store = (valid & (heads >= num_q_heads) & (slots >= 0))[:, None]
        kv_head = heads - num_q_heads
        # The caches are contiguous, so a slot's heads are num_kv_heads * HEAD_DIM consecutive elements.
        dst = (slots * num_kv_heads + kv_head)[:, None] * HEAD_DIM + offs[None, :]
        tl.store(k_cache_ptr + dst, to_cache(r1, k_scale, k_cache_ptr, KV_FP8), mask=store)
        tl.store(k_cache_ptr + dst + HALF, to_cache(r2, k_scale, k_cache_ptr, KV_FP8), mask=store)
        v_ptrs = ptrs + num_kv_heads * HEAD_DIM  # the v head sits num_kv_heads heads after its k head
        v1 = tl.load(v_ptrs, mask=store, other=0.0)
        v2 = tl.load(v_ptrs + HALF, mask=store, other=0.0)
        tl.store(v_cache_ptr + dst, to_cache(v1, v_scale, v_cache_ptr, KV_FP8), mask=store)
        tl.store(v_cache_ptr + dst + HALF, to_cache(v2, v_scale, v_cache_ptr, KV_FP8), mask=store)


@triton.jit
def _partial_rope_store(row, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos, slot_ptr, k_cache_ptr, v_cache_ptr, stride_c,
                        eps, num_q_heads, num_kv_heads, k_scale, v_scale, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                        HAS_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr, KV_FP8: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    """One token's heads as the kernel above handles them, for a rotation over the first 2 * HALF dimensions of each
    head only: whole heads, each dimension beside its partner (decode_rope_attention.py's way)."""
    heads = tl.arange(0, BLOCK_H)
    valid = (heads < num_q_heads + num_kv_heads)[:, None]
    is_q = (heads < num_q_heads)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    pair = rope_pair(HEAD_DIM, HALF)
    ptrs = row + heads[:, None] * HEAD_DIM + offs_d[None, :]
    x = tl.load(ptrs, mask=valid, other=0.0)
    x_pair = tl.load(row + heads[:, None] * HEAD_DIM + pair[None, :], mask=valid, other=0.0)
    q_w, q_w_pair = norm_weight(q_w_ptr, pair, HAS_NORM, NORM_OFFSET, HEAD_DIM)
    k_w, k_w_pair = norm_weight(k_w_ptr, pair, HAS_NORM, NORM_OFFSET, HEAD_DIM)
    cos, sin = rope_cos_sin(cos_ptr, sin_ptr, pos, stride_c, HEAD_DIM, HALF)
    r = norm_rope(x, x_pair, tl.where(is_q, q_w, k_w), tl.where(is_q, q_w_pair, k_w_pair), cos, sin, eps, HAS_NORM,
                  NORM_OFFSET, HEAD_DIM, HALF)
    tl.store(ptrs, r, mask=valid)
    slot = tl.load(slot_ptr).to(tl.int64)
    slots = tl.zeros([BLOCK_H], dtype=tl.int64) + slot
    store = valid & ((heads >= num_q_heads) & (slots >= 0))[:, None]
    dst = (slots * num_kv_heads + heads - num_q_heads)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, to_cache(r, k_scale, k_cache_ptr, KV_FP8), mask=store)
    v = tl.load(ptrs + num_kv_heads * HEAD_DIM, mask=store, other=0.0)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr, KV_FP8), mask=store)


def qkv_rope_store(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                   eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   norm_offset: float = 0.0, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """qkv [T, (Hq + 2 Hkv) * D] (rows contiguous), rotated (and normed) in place; k/v stored at their slots.
    norm_offset: the norms scale by norm_offset + weight (Gemma 3: 1.0; kernels/rms_norm.py). k_scale, v_scale: an
    fp8 cache's scales (kv_store.py), ignored for others.

    cos/sin [max_pos, R/2] fp32 for a rotation of the first R <= D dimensions (R = D but for partial rotary);
    q_weight/k_weight [D] or both None; caches [blocks, block_size, Hkv, D]
    contiguous; slot_mapping [T] int64 with -1 for tokens whose K/V are not stored.
    """
    num_tokens, width = qkv.shape
    head_dim = width // (num_q_heads + 2 * num_kv_heads)
    assert qkv.stride(1) == 1 and width == (num_q_heads + 2 * num_kv_heads) * head_dim
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] * 2 <= head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert (q_weight is None) == (k_weight is None)
    if num_tokens == 0:
        return
    has_norm = q_weight is not None
    block_h = triton.next_power_of_2(num_q_heads + num_kv_heads)
    pdl = use_pdl(qkv)
    _qkv_rope_store_kernel[(num_tokens,)](
        qkv, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin, positions, slot_mapping,
        k_cache, v_cache, qkv.stride(0), cos.stride(0), eps, num_q_heads, num_kv_heads, k_scale, v_scale,
        HEAD_DIM=head_dim, HALF=cos.shape[1], HAS_NORM=has_norm, NORM_OFFSET=float(norm_offset),
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn, BLOCK_H=block_h,
        USE_PDL=pdl,
        num_warps=4 if block_h * head_dim >= 2048 else 1, launch_pdl=pdl)


def qkv_rope_store_ref(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, norm_offset: float = 0.0, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> None:
    """The unfused references, one after the other."""
    from nanoserve.kernels.kv_store import store_kvcache_ref
    from nanoserve.kernels.rms_norm import rms_norm_ref
    from nanoserve.kernels.rotary import apply_rotary_ref

    t = qkv.shape[0]
    d = qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k, v = q.view(t, num_q_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
    if q_weight is not None:
        q.copy_(rms_norm_ref(q, q_weight, eps, weight_offset=norm_offset))
        k.copy_(rms_norm_ref(k, k_weight, eps, weight_offset=norm_offset))
    apply_rotary_ref(q, k, cos, sin, positions)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
