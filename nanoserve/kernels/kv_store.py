"""Write new tokens' K/V into the paged KV cache.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; a slot is
block_id * block_size + offset_in_block, so a contiguous cache viewed as [num_slots, ...] is indexed by slot.
An fp8 cache stores clamp(x / scale, -448, 448) rounded to fp8 (kv_quant.py), with the layer's k_scale and v_scale.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.kv_quant import quantize_kv


@triton.jit
def to_cache(x, scale, cache_ptr, KV_FP8: tl.constexpr):
    """x as the cache at cache_ptr stores it (kv_quant.quantize_kv): KV_FP8, divided by scale and clamped to fp8's
    range (the cast does not saturate); else only cast."""
    if KV_FP8:
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    num_kv_heads,
    KV_FP8: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < num_kv_heads
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    # The caches are contiguous, so a slot's heads are num_kv_heads * HEAD_DIM consecutive elements.
    dst = slot * num_kv_heads * HEAD_DIM + h * HEAD_DIM + d
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr, KV_FP8), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Copy key/value [T, num_kv_heads, head_dim] into the caches at slot_mapping [T]; slot -1 is skipped. k_scale,
    v_scale: an fp8 cache's scales (ignored for others)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2"
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        *key.stride(),
        *value.stride(),
        num_kv_heads,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        num_warps=4,  # a program moves one token's K and V (a few KB at most): 4 warps cover it in one pass
    )


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain PyTorch version of store_kvcache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(key[keep], k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(value[keep], v_cache.dtype, v_scale)
