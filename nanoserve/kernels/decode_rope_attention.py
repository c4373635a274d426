"""Decode attention that also does qkv_rope_store's work, for steps that are all decodes: one launch, not two.

At batch 1 a Qwen3-0.6B layer spends ~32 us on an H100 against ~10 us of weights streamed: decode is bound by
launches, and qkv_rope_store (q/k norm, rotary, new K/V into the cache) is one of a layer's six. Here every
(sequence, kv head, split) program of flash-decoding (decode_attention.py; its pieces in decode_split.py) reads its
group's raw query heads from the qkv row and normalizes and rotates them itself (redundant across splits, a
few hundred FLOPs each), and likewise the new token's k (normed, rotated) and v for its kv head. Heads are
rotated whole, each dimension beside its rotary partner (rope_pair.py; with partial rotary the dimensions past the
rotated ones are their own partner and pass through). The program whose split holds the new token's position,
seq_len - 1, stores them into the cache at the token's slot (none when the slot is -1); no other program reads that
position, so there is no race between programs.

The new key and value enter the sums from registers rather than through the cache: a store's round trip to
L2 and back would sit on the critical path, and a barrier would be needed to order it before the program's
own loads. The key loads leave the new position's slot out (zeros), and attend_tile patches in that key's
scores and its value times its weight; patching the sums rather than selecting into the K/V tiles keeps the
tiles' loads going straight to shared memory. Nothing a program loads is then written in this step, so it may
load its first key tile before waiting on the kernel before it (PDL; see the kernel). This relies on the slot
being where the block table puts position seq_len - 1, which the model runner guarantees for a decode (it
derives both from the same table); with slot -1 the cache's entry is read, as in the unfused path.

Roundings follow qkv_rope_store step for step (q and k are rounded to the activation dtype after the norm's
normalize and scale and after rotary; the new key's weight is rounded to the cache dtype as the tile's are),
so the output matches qkv_rope_store then decode_attention up to fp32 rounding order. The rotated q that
qkv_rope_store writes back into the qkv buffer is not written here: nothing after attention reads it.
"""

import functools

import torch
import triton
import triton.language as tl

from nanoserve.kernels.decode_attention import LOG2E, decode_attention_ref
from nanoserve.kernels.decode_launch import launch_reduce, plan_split_launch
from nanoserve.kernels.decode_split import attend_split, load_kv_tile, split_range
from nanoserve.kernels.kv_quant import kv_scales
from nanoserve.kernels.kv_store import to_cache
from nanoserve.kernels.pdl import wait_for_prior_grids
from nanoserve.kernels.qkv_rope_store import qkv_rope_store_ref
from nanoserve.kernels.rope_pair import norm_rope, norm_weight, rope_cos_sin, rope_pair
from nanoserve.kernels.softcap import softcap_scores


@triton.jit
def _decode_rope_split_kernel(qkv_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr,
                              v_cache_ptr, seq_lens_ptr, block_tables_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
                              counters_ptr, qk_scale, eps, stride_qkv, stride_c, stride_cb, stride_ct, stride_ch,
                              stride_bt, stride_ob, stride_oh, num_queries_per_kv, num_splits, window, sinks_ptr,
                              softcap, k_scale, v_scale, HAS_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
                              ROT_HALF: tl.constexpr, PREFETCH: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
                              WINDOW: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
                              BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_q_heads = num_kv_heads * num_queries_per_kv
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    pair = rope_pair(HEAD_DIM, ROT_HALF)

    # Before waiting on the kernel before this one (PDL), only memory that no kernel this close before writes.
    # Under PDL this program starts once every program of that kernel (the qkv GEMM) has passed its own wait,
    # so all kernels before *it* are done and visible. seq_lens, positions, slot_mapping and block_tables are
    # copied in from the host before the step's first kernel; cos/sin and the norm weights are the model's; the
    # cache holds positions < seq_len - 1 from earlier steps (or from block copies before the forward), and the
    # new token's slot is left out of the loads (and written by this program only). With PREFETCH (small grids,
    # see _prefetch_pays) the first key tile, all of a split's keys at batch 1 up to 1,024 keys, then streams
    # while the GEMM finishes.
    seq_len, chunk, kv_start, kv_end = split_range(seq_lens_ptr, seq, split, num_splits, window, BLOCK_N, WINDOW)
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    last = seq_len - 1
    # The new key's position, where it enters the sums from registers; none with slot -1 (the cache's entry
    # is read there, as in the unfused path).
    new_pos = tl.where(slot >= 0, last, -1)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if PREFETCH:
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, kv_start, kv_end, new_pos, stride_cb,
                            stride_ct, stride_ch, True, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    cos, sin = rope_cos_sin(cos_ptr, sin_ptr, pos, stride_c, HEAD_DIM, ROT_HALF)
    q_w, q_w_pair = norm_weight(q_w_ptr, pair, HAS_NORM, NORM_OFFSET, HEAD_DIM)
    k_w, k_w_pair = norm_weight(k_w_ptr, pair, HAS_NORM, NORM_OFFSET, HEAD_DIM)
    wait_for_prior_grids(USE_PDL)

    # The qkv row: q heads, then k heads, then v heads.
    row = qkv_ptr + seq.to(tl.int64) * stride_qkv
    q_rows = row + (kv_head * num_queries_per_kv + offs_g)[:, None] * HEAD_DIM
    q_mask = (offs_g < num_queries_per_kv)[:, None]
    q = norm_rope(tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0),
                  tl.load(q_rows + pair[None, :], mask=q_mask, other=0.0),
                  q_w, q_w_pair, cos, sin, eps, HAS_NORM, NORM_OFFSET, HEAD_DIM, ROT_HALF)
    k_row = row + (num_q_heads + kv_head) * HEAD_DIM
    # The new K/V as the cache stores them: the sums below then see what later steps will read back.
    new_k = to_cache(norm_rope(tl.load(k_row + offs_d[None, :]), tl.load(k_row + pair[None, :]),
                               k_w, k_w_pair, cos, sin, eps, HAS_NORM, NORM_OFFSET, HEAD_DIM, ROT_HALF),
                     k_scale, k_cache_ptr, KV_FP8)
    new_v = to_cache(tl.load(row + (num_q_heads + num_kv_heads + kv_head) * HEAD_DIM + offs_d[None, :]), v_scale,
                     v_cache_ptr, KV_FP8)

    # The split holding position seq_len - 1 stores the new K/V (split 0 for a length-0 row, which has none,
    # as qkv_rope_store stores whatever the row's length; a CUDA-graph padding row's slot is -1 anyway).
    owns_new = ((kv_start <= last) & (last < kv_end)) | ((seq_len == 0) & (split == 0))
    if owns_new & (slot >= 0):
        # Contiguous caches: slot * stride_ct is block * stride_cb + offset * stride_ct.
        dst = slot * stride_ct + kv_head * stride_ch + offs_d[None, :]
        tl.store(k_cache_ptr + dst, new_k)
        tl.store(v_cache_ptr + dst, new_v)
    # The new key's scores, as the tile's dot would give them (exact products, fp32 sums) but for the order (an fp8
    # key's k_scale is in qk_scale, as for the cache's keys).
    qk_new = tl.sum(q.to(tl.float32) * new_k.to(tl.float32), 1) * qk_scale
    if SOFTCAP:
        qk_new = softcap_scores(qk_new, softcap)

    attend_split(q, k if PREFETCH else None, v if PREFETCH else None, k_cache_ptr, v_cache_ptr, bt_row, mid_o_ptr,
                 mid_lse_ptr, out_ptr, counters_ptr, seq, kv_head, split, seq_len, chunk, kv_start, kv_end, qk_scale,
                 stride_cb, stride_ct, stride_ch, stride_ob, stride_oh, num_queries_per_kv, num_splits, new_pos, qk_new,
                 new_v, sinks_ptr, softcap, v_scale, PREFETCH, True, SPLIT, FUSED, WINDOW, SINKS, SOFTCAP, KV_FP8,
                 DOT_PRECISION, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_N, BLOCK_G, BLOCK_S)


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prefetch_pays(grid: tuple[int, int, int], device: torch.device) -> bool:
    """Whether to load the first key tile before the PDL wait: when the grid fits in one wave. The tile is held
    in registers across the wait, 64 more a thread at head_dim 128 (about 165 rather than 110, compiled offline
    for sm_90), so three programs fit on an SM rather than four; that costs more than it gains once programs
    queue for SMs (and only the first wave starts under the previous kernel anyway). Batch 1 and 2 at 8 kv heads
    and 16 splits (128 and 256 programs) fit on an H100's or H200's 132 SMs at two programs each."""
    if device.type != "cuda":
        return True
    return grid[0] * grid[1] * grid[2] <= 2 * _num_sms(device)


def decode_rope_attention(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          scale: float, num_splits: int | None = None, out: torch.Tensor | None = None,
                          counters: torch.Tensor | None = None, prefetch: bool | None = None,
                          window: int | None = None, sinks: torch.Tensor | None = None,
                          softcap: float | None = None, norm_offset: float = 0.0, k_scale: float = 1.0,
                          v_scale: float = 1.0) -> torch.Tensor:
    """qkv_rope_store(qkv, ...) then decode_attention(q, ...) in one launch (two with num_splits > 1 and no
    counters), for a batch of decodes: row b of qkv [B, (Hq + 2 Hkv) * D] is sequence b's one new token, at
    position seq_lens[b] - 1 and cache slot slot_mapping[b] (-1: not stored). Returns [B, Hq, D] (into out if
    given). qkv is left as it is: the rotated q is not written back. Arguments as in those two functions.

    prefetch: whether each program loads its first key tile before waiting on the kernel before it (see
    _prefetch_pays); None decides from the grid. Tests set it to cover both paths; the output is the same either way.
    window, sinks, softcap, k_scale, v_scale: as decode_attention takes them; norm_offset: as qkv_rope_store takes it.
    """
    num_tokens, width = qkv.shape
    head_dim = width // (num_q_heads + 2 * num_kv_heads)
    assert qkv.stride(1) == 1 and width == (num_q_heads + 2 * num_kv_heads) * head_dim
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] * 2 <= head_dim
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and (q_weight is None) == (k_weight is None)
    assert positions.shape == slot_mapping.shape == (num_tokens,)
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (num_tokens, num_q_heads, head_dim)
    launch = plan_split_launch(qkv.dtype, out, k_cache, v_cache, seq_lens, block_tables, num_splits, counters,
                               window)
    if launch is None:
        return out
    has_norm = q_weight is not None
    if prefetch is None:
        prefetch = _prefetch_pays(launch.grid, out.device)
    _decode_rope_split_kernel[launch.grid](
        qkv, q_weight if has_norm else cos, k_weight if has_norm else cos,  # cos stands in for unused weights
        cos, sin, positions, slot_mapping, k_cache, v_cache, seq_lens, block_tables, launch.mid_o, launch.mid_lse,
        out, launch.counters, scale * kv_scales(k_cache, k_scale) * LOG2E, eps, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        num_q_heads // num_kv_heads, launch.grid[2], window or 0, sinks, (softcap or 0.0) * LOG2E, k_scale,
        kv_scales(v_cache, v_scale), HAS_NORM=has_norm, NORM_OFFSET=float(norm_offset), ROT_HALF=cos.shape[1],
        PREFETCH=prefetch, WINDOW=window is not None, SINKS=sinks is not None, SOFTCAP=softcap is not None,
        **launch.options)
    launch_reduce(launch, out)
    return out


def decode_rope_attention_ref(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
                              k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scale: float, num_splits: int | None = None,
                              out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                              window: int | None = None, sinks: torch.Tensor | None = None,
                              softcap: float | None = None, norm_offset: float = 0.0, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> torch.Tensor:
    """The unfused references: qkv_rope_store_ref on a copy of qkv (the caches are written), then
    decode_attention_ref; num_splits and counters are accepted and ignored."""
    qkv = qkv.clone()
    qkv_rope_store_ref(qkv, num_q_heads, num_kv_heads, positions, cos, sin, q_weight, k_weight, eps, k_cache,
                       v_cache, slot_mapping, norm_offset, k_scale, v_scale)
    q = qkv[:, :num_q_heads * k_cache.shape[3]].view(qkv.shape[0], num_q_heads, k_cache.shape[3])
    return decode_attention_ref(q, k_cache, v_cache, seq_lens, block_tables, scale, out=out, window=window,
                                sinks=sinks, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
