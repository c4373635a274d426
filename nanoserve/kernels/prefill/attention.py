"""Causal attention of packed new tokens over the paged KV cache (prefill, chunked prefill, prefix hits).

Query i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to keys 0..that position, all
read from the cache through the block table (the new tokens' K/V were stored there before this call).

Work is cut into tiles of block_m query rows listed in a map built on the host (prefill/tile_map.py, which says
what a row is), so the launch grid depends only on the map's length: a CUDA graph captured once replays any batch
whose tiles fit the map. A program serves `pack` query heads sharing a kv head (GQA packing): their rows go
through one load of each K/V tile, where one program per query head would read the same keys pack times. A tile
with at most 16 live rows (a decode entry, a sequence's last few rows) takes a 16-row path in the same launch.
The map may also cut a long tile's keys into ranges run by separate programs (flash-decoding for prefill: a
short chunk over a long cached prefix is a few tiles, too few programs to fill the GPU); each writes a partial
output and its log-sum-exp to scratch, and the last of them to finish merges them, so no second launch is needed.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.kv_quant import dequantize_kv, kv_scales
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

# The maps are planned on the host, where Triton may be absent (CPU-only installs): prefill/planner.py.
from nanoserve.kernels.prefill.planner import PrefillPlanner
from nanoserve.kernels.prefill.split_scratch import SplitScratch
from nanoserve.kernels.prefill.tile import _attend_rows
from nanoserve.kernels.prefill.tile_map import KV_SPLIT_GRANULE, SPLIT_MAP_COLUMNS, prefill_block_m, prefill_block_n

# SMs assumed where there is no GPU to ask (the interpreter): an H100's or H200's.
_ASSUMED_SMS = 132


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    tile_map_ptr,
    split_out_ptr,
    split_lse_ptr,
    split_count_ptr,
    qk_scale,
    window,
    sinks_ptr,
    softcap,
    v_scale,
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
    PACK: tl.constexpr,
    SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    head = tl.program_id(0)  # this program's query heads are head * PACK .. head * PACK + PACK - 1
    map_row = tile_map_ptr + tl.program_id(1) * MAP_COLUMNS
    # The whole row in one round trip (padding rows hold harmless values).
    seq, start_r, kv_lo, kv_hi = tl.load(map_row), tl.load(map_row + 1), tl.load(map_row + 2), tl.load(map_row + 3)
    first_slot, split, num_splits = tl.load(map_row + 4), tl.load(map_row + 5), tl.load(map_row + 6)
    q_start, q_rows, pos0 = tl.load(map_row + 7), tl.load(map_row + 8), tl.load(map_row + 9)
    if seq < 0:
        return
    # The map is a step input, copied before the step's first kernel, so it was read above without waiting on
    # the kernel before this one (under PDL, still finishing the q/k/v this launch reads).
    wait_for_prior_grids(USE_PDL)
    args = (q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, split_out_ptr, split_lse_ptr, split_count_ptr,
            qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
            head * PACK // num_queries_per_kv, head, seq, start_r, kv_lo, kv_hi, first_slot, split, num_splits,
            q_start, q_rows, pos0, window, sinks_ptr, softcap, v_scale)  # fmt: skip
    # A tile of at most 16 live rows (a decode entry, a sequence's last rows) runs 16-row matrix products: the same
    # keys for a fraction of the work (the branch is uniform over the program; both paths are compiled in).
    # The constexprs go by name, not in `args`: compiled Triton makes a tuple of tensors of it (a string fails).
    if BLOCK_M > 16:
        if q_rows - start_r <= 16:
            _attend_rows(*args, PACK, SPLITS, WINDOW, SINKS, SOFTCAP, KV_FP8, DOT_PRECISION, HEAD_DIM, BLOCK_SIZE, 16,
                         BLOCK_M, BLOCK_N)
        else:
            _attend_rows(*args, PACK, SPLITS, WINDOW, SINKS, SOFTCAP, KV_FP8, DOT_PRECISION, HEAD_DIM, BLOCK_SIZE,
                         BLOCK_M, BLOCK_M, BLOCK_N)
    else:
        _attend_rows(*args, PACK, SPLITS, WINDOW, SINKS, SOFTCAP, KV_FP8, DOT_PRECISION, HEAD_DIM, BLOCK_SIZE, BLOCK_M,
                     BLOCK_M, BLOCK_N)


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
    pack: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, num_q_heads, head_dim] packed by cu_seqlens_q [B+1]; returns [T, num_q_heads, head_dim].

    window: a sliding window (query at p sees keys p - window + 1 .. p), None for none. sinks: fp32 [num_q_heads],
    each head's sink logit, which joins the softmax's denominator (gpt-oss), None for none. softcap: scores capped
    at softcap * tanh(score / softcap) (Gemma 2; kernels/softcap.py), None for none. k_scale, v_scale: an fp8
    cache's scales (kernels/kv_quant.py), ignored for a cache in q's dtype.

    out, if given, is written in place (contiguous last dim, q's shape) and returned. Rows of tokens that no
    tile covers (past cu_seqlens_q[B], as in a padded batch) are left untouched. pack: query heads per program
    (a divisor of num_q_heads // num_kv_heads), by default all of a kv head's.

    Without tile_map, a split map is built here from cu_seqlens_q and seq_lens, read on the host, with block_m
    defaulting to prefill_block_m(max_seqlen_q, pack) (max_seqlen_q is used for nothing else), and scratch for it.

    With tile_map and out, the call reads no device value on the host and allocates nothing: the launch depends
    only on tensor shapes, block_m and pack, so it can be captured in a CUDA graph and replayed with new contents
    in the same tensors. tile_map is a device copy of a map of prefill/tile_map.py built for this block_m and pack
    from the lengths in cu_seqlens_q and seq_lens (which the kernel then never reads). A map that splits tiles
    needs split_scratch for this block_m, num_q_heads // pack program heads and head_dim, with every slot the map
    names (its max_partials), and with its counters at zero (as allocated; every call leaves them so). Without
    split_scratch the map must split nothing (prefill_tile_map).

    Keys per inner tile, stages and warps follow measured rules (prefill_block_n; the benchmark that measured
    them is at 275aa23).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    pack = group if pack is None else pack
    assert head_dim in (64, 128, 256), "head_dim must be 64, 128 or 256"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 8"
    assert num_q_heads % num_kv_heads == 0 and group % pack == 0
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cu_seqlens_q.shape == (batch + 1,) and block_tables.shape[0] == batch
    if tile_map is not None:
        assert out is not None and block_m is not None, "a tile_map call must not allocate or choose block_m"
        assert tile_map.dtype == torch.int32 and tile_map.is_contiguous()
        assert tile_map.dim() == 2 and tile_map.shape[1] == SPLIT_MAP_COLUMNS
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or batch == 0:
        return out
    heads = num_q_heads // pack  # programs per map row
    if tile_map is None:
        block_m = prefill_block_m(max_seqlen_q, pack) if block_m is None else block_m
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else _ASSUMED_SMS
        planner = PrefillPlanner(num_q_heads, num_kv_heads, num_sms, pack)
        _, split_map = planner.for_batch(cu_seqlens_q.tolist(), seq_lens.tolist(), block_m)
        split_scratch = planner.scratch_for(split_map, block_m, head_dim, q.device)
        tile_map = torch.from_numpy(split_map).to(q.device)
    assert block_m >= 16 and block_m & (block_m - 1) == 0, "block_m must be a power of 2 >= 16 (tl.dot)"
    if tile_map.shape[0] == 0:
        return out
    block_n = prefill_block_n(head_dim, q.element_size(), block_m)
    if split_scratch is not None:
        split_scratch.check(heads, block_m, head_dim)
        assert KV_SPLIT_GRANULE % block_n == 0, "split ranges must start on a key tile"
    # Heads vary fastest in launch order, so every head of the longest tile starts before any shorter tile
    # (with tiles fastest, the last head's longest tile would start in the last wave). On an H200 the two
    # orders measured within 2% of each other.
    grid = (heads, tile_map.shape[0])
    pdl = use_pdl(q)
    _prefill_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        tile_map,
        split_scratch.out if split_scratch is not None else None,
        split_scratch.lse if split_scratch is not None else None,
        split_scratch.count if split_scratch is not None else None,
        scale * kv_scales(k_cache, k_scale) * 1.4426950408889634,  # log2(e): the kernel uses exp2
        window or 0,
        sinks,
        (softcap or 0.0) * 1.4426950408889634,
        kv_scales(v_cache, v_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        group,
        MAP_COLUMNS=SPLIT_MAP_COLUMNS,
        PACK=pack,
        SPLITS=split_scratch is not None,
        WINDOW=window is not None,
        SINKS=sinks is not None,
        SOFTCAP=softcap is not None,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # 8 warps give each warp 16 query rows of a 128-row tile (one mma row block); 4 warps, one warpgroup,
        # is the least a 64-row wgmma needs.
        num_warps=8 if block_m == 128 else 4,
        num_stages=2,  # the key tiles' loads double-buffered
        USE_PDL=pdl,
        launch_pdl=pdl,
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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain PyTorch version of prefill_attention, in fp32, one sequence at a time."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len, group, k_scale, v_scale)
        qb = q[cu[b] : cu[b + 1]].float().transpose(0, 1)  # [H, q_len, D]
        scores = (qb @ k.transpose(1, 2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        seen = k_pos <= q_pos[:, None]
        if window is not None:
            seen &= k_pos > q_pos[:, None] - window
        scores = scores.masked_fill(~seen, float("-inf"))
        out[cu[b] : cu[b + 1]] = (softmax_with_sinks(scores, sinks) @ v).transpose(0, 1).to(q.dtype)
    return out


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of fp32 scores [H, ..., N] over the last dim; with sinks [H], head h's sink logit joins each
    denominator as a column that is dropped afterwards."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    group: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first seq_len keys and values as fp32 [num_q_heads, seq_len, head_dim] (an fp8 cache's
    scaled by k_scale and v_scale)."""
    block_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table[pos // block_size].long()
    offsets = pos % block_size
    k = dequantize_kv(k_cache[blocks, offsets], torch.float32, k_scale).transpose(0, 1)  # [num_kv_heads, seq_len, D]
    v = dequantize_kv(v_cache[blocks, offsets], torch.float32, v_scale).transpose(0, 1)
    return k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
