"""Causal attention of packed new tokens over the paged KV cache (prefill, chunked prefill, prefix hits).

Query i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to keys 0..that position, all
read from the cache through the block table (the new tokens' K/V were stored there before this call).

Work is cut into query tiles of block_m rows listed in a map built on the host (kernels/tile_map.py), so the
launch grid depends only on the map's length: a CUDA graph captured once replays any batch whose tiles fit the map.
A split map may also cut a long tile's keys into ranges run by separate programs (flash-decoding for prefill: a
short chunk over a long cached prefix is a few tiles, too few programs to fill the GPU); each writes a partial
output and its log-sum-exp to scratch, and the last of them to finish merges them, so no second launch is needed.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.prefill_split import _publish_and_merge
from nanoserve.kernels.split_scratch import SplitScratch

# The maps are built on the host, where Triton may be absent (CPU-only installs): kernels/tile_map.py.
from nanoserve.kernels.tile_map import (
    KV_SPLIT_GRANULE,
    SPLIT_MAP_COLUMNS,
    eager_split_map,
    prefill_block_m,
    split_slots_used,
)

# SMs assumed where there is no GPU to ask (the interpreter): an H100's or H200's.
_ASSUMED_SMS = 132


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    kv_head,
    stride_cb,
    stride_ct,
    stride_ch,
    lo,
    hi,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax accumulation over key tiles [lo, hi); MASKED applies causality and the end bound."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        # Gather each key's page through the block table, so BLOCK_N and BLOCK_SIZE need not match.
        if MASKED:
            block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        else:
            block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_offs = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        if MASKED:
            k = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)
            v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None])
            v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :])

        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            causal = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            qk = tl.where(causal, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tile_map_ptr,
    split_out_ptr,
    split_lse_ptr,
    split_count_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    num_queries_per_kv,
    MAP_COLUMNS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    map_row = tile_map_ptr + tile * MAP_COLUMNS
    seq = tl.load(map_row)
    if seq < 0:
        return
    start_m = tl.load(map_row + 1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # A map row past its sequence's queries (a map out of step with cu_seqlens_q) must write nothing.
    if start_m >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // num_queries_per_kv
    first_pos = seq_len - q_len + start_m
    # Key tiles past this query tile's last position are fully masked by causality: stop before them.
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    if MAP_COLUMNS == 2:
        kv_lo = 0
        kv_hi = kv_end
    else:
        # The map starts a range at or below first_pos, so every row of the tile sees its first key and no row max
        # stays -inf (which would give NaN from -inf - -inf); and on a multiple of the key tile, which written out
        # lets the compiler see whole pages and contiguous keys in each key tile (else 128-row tiles spill).
        kv_lo = tl.load(map_row + 2) // BLOCK_N * BLOCK_N
        kv_hi = tl.minimum(tl.load(map_row + 3), kv_end)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < q_len
    q_pos = first_pos + tl.arange(0, BLOCK_M)
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Whole key tiles below this query tile's first position are visible to every row: no masks there. Rows past
    # q_len sit further on and see at least as much.
    unmasked_end = kv_lo + tl.maximum(tl.minimum(first_pos, kv_hi) - kv_lo, 0) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, stride_cb, stride_ct, stride_ch,
        kv_lo, unmasked_end, qk_scale, DOT_PRECISION, False, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, stride_cb, stride_ct, stride_ch,
        unmasked_end, kv_hi, qk_scale, DOT_PRECISION, True, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
    )  # fmt: skip

    acc = acc / l_i[:, None]
    write = m_valid
    if MAP_COLUMNS != 2:
        num_splits = tl.load(map_row + 6)
        if num_splits > 1:
            acc, last = _publish_and_merge(
                acc, m_i + tl.log2(l_i), split_out_ptr, split_lse_ptr, split_count_ptr, tl.load(map_row + 4),
                tl.load(map_row + 5), num_splits, head, tl.num_programs(0), m_valid, HEAD_DIM, BLOCK_M,
            )  # fmt: skip
            write = tl.where(last, m_valid, False)  # (m_valid & last is int32 in the interpreter)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=write[:, None],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile_map: torch.Tensor | None = None,
    block_m: int | None = None,
    split_scratch: SplitScratch | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [T, num_q_heads, head_dim] packed by cu_seqlens_q [B+1]; returns [T, num_q_heads, head_dim].

    out, if given, is written in place (contiguous last dim, q's shape) and returned. Rows of tokens that no
    tile covers (past cu_seqlens_q[B], as in a padded batch) are left untouched.

    Without tile_map, a split map is built here from cu_seqlens_q and seq_lens, read on the host, with block_m
    defaulting to prefill_block_m(max_seqlen_q) (max_seqlen_q is used for nothing else), and scratch for it.

    With tile_map and out, the call reads no device value on the host and allocates nothing: the launch depends
    only on tensor shapes and block_m, so it can be captured in a CUDA graph and replayed with new contents in the
    same tensors. tile_map is a device copy, built with this block_m, of either prefill_tile_map's int32
    [num_tiles, 2] (nothing split) or prefill_split_map's int32 [rows, SPLIT_MAP_COLUMNS], which also needs
    split_scratch for this block_m, q's heads and head_dim, with every slot the map names (its max_partials), and
    with its counters at zero (as allocated; every call leaves them so).

    block_n (keys per inner tile) overrides the measured default, for scripts/bench_prefill_attention.py.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    assert head_dim in (64, 128), "head_dim must be 64 or 128"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 8"
    assert num_q_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cu_seqlens_q.shape == (batch + 1,) and block_tables.shape[0] == batch
    if tile_map is not None:
        assert out is not None and block_m is not None, "a tile_map call must not allocate or choose block_m"
        assert tile_map.dtype == torch.int32 and tile_map.is_contiguous()
        assert tile_map.dim() == 2 and tile_map.shape[1] in (2, SPLIT_MAP_COLUMNS)
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or batch == 0:
        return out
    if tile_map is None:
        block_m = prefill_block_m(max_seqlen_q) if block_m is None else block_m
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else _ASSUMED_SMS
        split_map = eager_split_map(cu_seqlens_q.tolist(), seq_lens.tolist(), block_m, num_q_heads, num_sms)
        slots = max(1, split_slots_used(split_map))
        split_scratch = SplitScratch.allocate(slots, num_q_heads, block_m, head_dim, q.device)
        tile_map = torch.from_numpy(split_map).to(q.device)
    assert block_m >= 16 and block_m & (block_m - 1) == 0, "block_m must be a power of 2 >= 16 (tl.dot)"
    if tile_map.shape[0] == 0:
        return out
    # Measured once on an H200 (bf16, no autotuning): 128-key tiles were 5% faster than 64 at head_dim 128 and
    # 20% slower at head_dim 64; a third stage gained nothing over two. fp32 128x128 tiles overflow shared memory.
    block_n = block_n or (128 if head_dim == 128 and q.element_size() == 2 else 64)
    split = tile_map.shape[1] == SPLIT_MAP_COLUMNS
    if split:
        assert split_scratch is not None, "a split map needs split_scratch"
        split_scratch.check(num_q_heads, block_m, head_dim)
        assert KV_SPLIT_GRANULE % block_n == 0, "split ranges must start on a key tile"
    # Heads vary fastest in launch order, so every head of the longest tile starts before any shorter tile
    # (with tiles fastest, the last head's longest tile would start in the last wave). On an H200 the two
    # orders measured within 2% of each other.
    grid = (num_q_heads, tile_map.shape[0])
    _prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        seq_lens,
        block_tables,
        tile_map,
        split_scratch.out if split else None,
        split_scratch.lse if split else None,
        split_scratch.count if split else None,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        num_q_heads // num_kv_heads,
        MAP_COLUMNS=tile_map.shape[1],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # 8 warps give each warp 16 query rows of a 128-row tile (one mma row block).
        num_warps=8 if block_m == 128 else 4,
        num_stages=2,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch version of prefill_attention, in fp32, one sequence at a time."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len, group)
        qb = q[cu[b] : cu[b + 1]].float().transpose(0, 1)  # [H, q_len, D]
        scores = (qb @ k.transpose(1, 2)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        causal = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[cu[b] : cu[b + 1]] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first seq_len keys and values as fp32 [num_q_heads, seq_len, head_dim]."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table[pos // block_size].long()
    offsets = pos % block_size
    k = k_cache[blocks, offsets].float().transpose(0, 1)  # [num_kv_heads, seq_len, D]
    v = v_cache[blocks, offsets].float().transpose(0, 1)
    return k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
