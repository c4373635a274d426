"""Flash-decoding: one new query token per sequence attending to its whole paged KV cache.

Each sequence's keys are cut into num_splits chunks handled by separate programs, each writing a partial
output and its log-sum-exp. One program serves all the query heads that share a kv head, so each K/V byte
is read once. The partials are merged in one of two ways:

- fused (a `counters` buffer is given): every program bumps an atomic counter for its (sequence, kv head)
  after storing its partial, and the program that finds it was the last one merges all the partials and
  writes the output, then resets the counter. One launch per call: inside a CUDA graph at batch 1 each
  kernel boundary costs about 2 us, a sizeable part of a layer's decode attention.
- two launches (no `counters`): a second kernel merges the partials, as flash-decoding first did.

With num_splits == 1 the single program per (sequence, kv head) writes the output directly. The grid
depends only on shapes and num_splits, so a call can be captured in a CUDA graph; splits past a sequence's
end hold no keys and are skipped by the merge (in the fused path they still bump the counter).

The pieces of a split program (its key range, the key loop, handing its result on) and the launch planning
are shared with decode_rope_attention.py, which does qkv_rope_store's work in the same launch.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids
from nanoserve.kernels.prefill.attention import gather_kv

_BLOCK_N = 64
_LARGE_BATCH = 64
LOG2E = 1.4426950408889634  # the kernels use exp2/log2: scores are scaled by scale * log2(e)
# The fused merge loads [group, splits, head_dim] fp32 partials at once (one round trip to L2 rather than
# one per split, on the critical path of every batch-1 layer); tiles are capped at this many elements, 64
# registers a thread at 4 warps, and more splits than fit are merged a chunk at a time. Compiled offline for
# sm_90 (Triton 3.9), the merge raises the kernel from 80 to 137-150 registers at 16 splits with no spills,
# 80-90 at 2 splits (batch >= 64); smaller caps barely lower that, so the cap is left generous.
_MERGE_TILE = 8192


@triton.jit
def _merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, first_row, out_offset, stride_oh, seq_len, chunk,
                  num_queries_per_kv, num_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the partials of the query heads first_row.. (rows of [.., num_splits, HEAD_DIM]) into out.

    Only splits that hold keys (split * chunk < seq_len) are read: the others never stored anything. The
    loads use .cg (L2, not L1) because the partials were written by other programs on other SMs; see the
    ordering argument in write_split."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < num_queries_per_kv
    # 64-bit row base once; offsets within the group's [group, num_splits, HEAD_DIM] block fit in 32 bits.
    first = first_row.to(tl.int64) * num_splits
    lse_base = mid_lse_ptr + first
    o_base = mid_o_ptr + first * HEAD_DIM

    # Online merge over chunks of BLOCK_S splits; with num_splits <= BLOCK_S (the common case) one chunk.
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        splits = s0 + offs_s
        used = g_valid[:, None] & ((splits < num_splits) & (splits * chunk < seq_len))[None, :]
        mid_rows = offs_g[:, None] * num_splits + splits[None, :]  # [BLOCK_G, BLOCK_S]
        lse = tl.load(lse_base + mid_rows, mask=used, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_base + mid_rows[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=used[:, :, None],
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        # A sequence of length 0 (a CUDA-graph padding row) or a padded head has no used split: m stays
        # -inf, so subtract 0 instead to get weights of 0 rather than NaN, and zeros out.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        m_i = m_new
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + out_offset + offs_g[:, None] * stride_oh + offs_d[None, :],
             result.to(out_ptr.dtype.element_ty), mask=g_valid[:, None])


@triton.jit
def split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """seq_len, the split size (chunk) and this split's keys [kv_start, kv_end) of sequence seq."""
    # Chunks are whole BLOCK_N tiles so that every tile but a sequence's last is full.
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    kv_start = split * chunk
    return seq_len, chunk, kv_start, tl.minimum(kv_start + chunk, seq_len)


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start_n, kv_end, new_pos, stride_cb, stride_ct,
                 stride_ch, NEW_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Keys start_n.. of one kv head from the paged cache (bt_row: the sequence's block table row): K as
    [HEAD_DIM, BLOCK_N], V as [BLOCK_N, HEAD_DIM], zeros from kv_end on and, with NEW_KV, at new_pos."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_valid = offs_n < kv_end
    block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    if NEW_KV:
        n_valid = n_valid & (offs_n != new_pos)
    kv_offs = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    k = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)
    v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
    return k, v


@triton.jit
def attend_tile(q, k, v, start_n, kv_end, m_i, l_i, acc, qk_scale, new_pos, qk_new, new_v,
                NEW_KV: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step of q [BLOCK_H, HEAD_DIM] over a tile of keys start_n.. holding at least one
    below kv_end (so m_new is finite). NEW_KV: the key at position new_pos, if in the tile, is not the cache's
    (load_kv_tile left zeros there) but one given by its scaled scores qk_new [BLOCK_H] and value new_v
    [1, HEAD_DIM]. Patching the scores and the sums, rather than the K/V tiles, keeps the tiles' loads going
    straight to shared memory in the pipelined loop: a select on the tiles cost ~100 registers a thread."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if NEW_KV:
        is_new = (offs_n == new_pos)[None, :]
        qk = tl.where(is_new, qk_new[:, None], qk)
    qk = tl.where((offs_n < kv_end)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the dot's inputs are in the cache's dtype: p is rounded here, the new key's weight too
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    if NEW_KV:
        p_new = tl.sum(tl.where(is_new, p.to(tl.float32), 0.0), 1)  # the new key's column (or zeros)
        acc += p_new[:, None] * new_v.to(v.dtype).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def write_split(acc, m_i, l_i, seq, kv_head, split, seq_len, chunk, kv_start, mid_o_ptr, mid_lse_ptr, out_ptr,
                counters_ptr, stride_ob, stride_oh, num_queries_per_kv, num_splits, SPLIT: tl.constexpr,
                FUSED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """Hand a (sequence, kv head, split) program's result on. SPLIT=False: it is the output (num_splits is 1).
    SPLIT, not FUSED: a partial for the reduce kernel. SPLIT and FUSED: a partial, and the last program of the
    (sequence, kv head) merges them all."""
    num_kv_heads = tl.num_programs(1)
    num_q_heads = num_kv_heads * num_queries_per_kv
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * num_queries_per_kv + offs_g
    h_valid = offs_g < num_queries_per_kv
    # An empty split (kv_start >= seq_len) leaves l_i = 0: o = 0 and lse = -inf.
    nonempty = l_i > 0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if not SPLIT:
        # The only split: acc is the output (zeros for a length-0 padding row).
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=h_valid[:, None])
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        mid_rows = (seq * num_q_heads + heads).to(tl.int64) * num_splits + split
        # The reduce kernel reads every split's partial; the fused merge skips empty splits (it knows them
        # from seq_len), so they need not store anything. (A head-count bound rather than `h_valid & scalar`:
        # the interpreter mis-types a splatted scalar bool.)
        store_mask = offs_g < tl.where(kv_start < seq_len, num_queries_per_kv, 0) if FUSED else h_valid
        tl.store(mid_lse_ptr + mid_rows, lse, mask=store_mask)
        tl.store(mid_o_ptr + mid_rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask[:, None])
        if FUSED:
            # Ordering (the CUTLASS semaphore pattern). Release: the barrier orders every thread's partial
            # stores above before the atomic, which Triton issues from one thread; acq_rel at gpu scope makes
            # that release cumulative, so the stores are visible GPU-wide to whoever acquires the counter
            # later. All num_splits atomics on one counter form a single modification order, so the program
            # that reads num_splits - 1 acquires after every other program's release. Acquire: Triton hands
            # the atomic's result to the other threads through shared memory behind a barrier (the explicit
            # barrier below restates it), so their loads come after the acquire; those loads use .cg to read
            # L2, the GPU's point of coherence, rather than an L1 line that is not kept coherent across SMs.
            tl.debug_barrier()
            counter = counters_ptr + seq * num_kv_heads + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                tl.debug_barrier()
                # Every other program of this (sequence, kv head) has bumped the counter and is done with
                # it, so a plain store resets it; the kernel boundary publishes it to the next launch (the
                # next layer, or the next replay of a CUDA graph).
                tl.store(counter, 0)
                _merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, seq * num_q_heads + kv_head * num_queries_per_kv,
                              seq.to(tl.int64) * stride_ob + (kv_head * num_queries_per_kv) * stride_oh,
                              stride_oh, seq_len, chunk, num_queries_per_kv, num_splits,
                              HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_S=BLOCK_S)


@triton.jit
def attend_split(q, k0, v0, k_cache_ptr, v_cache_ptr, bt_row, mid_o_ptr, mid_lse_ptr, out_ptr, counters_ptr, seq,
                 kv_head, split, seq_len, chunk, kv_start, kv_end, qk_scale, stride_cb, stride_ct, stride_ch,
                 stride_ob, stride_oh, num_queries_per_kv, num_splits, new_pos, qk_new, new_v,
                 PREFETCHED: tl.constexpr, NEW_KV: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """A (sequence, kv head, split) program's work once its queries q [BLOCK_H, HEAD_DIM] are known: the online
    softmax over its keys [kv_start, kv_end) (PREFETCHED: the first tile is k0/v0, loaded by the caller), then
    the result handed on (write_split). NEW_KV: see attend_tile."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    begin = kv_start
    if PREFETCHED:
        if kv_start < kv_end:  # an empty split has no tile
            m_i, l_i, acc = attend_tile(q, k0, v0, kv_start, kv_end, m_i, l_i, acc, qk_scale, new_pos, qk_new, new_v,
                                        NEW_KV, DOT_PRECISION, BLOCK_N)
        begin = kv_start + BLOCK_N
    for start_n in range(begin, kv_end, BLOCK_N):
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start_n, kv_end, new_pos, stride_cb,
                            stride_ct, stride_ch, NEW_KV, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = attend_tile(q, k, v, start_n, kv_end, m_i, l_i, acc, qk_scale, new_pos, qk_new, new_v,
                                    NEW_KV, DOT_PRECISION, BLOCK_N)
    write_split(acc, m_i, l_i, seq, kv_head, split, seq_len, chunk, kv_start, mid_o_ptr, mid_lse_ptr, out_ptr,
                counters_ptr, stride_ob, stride_oh, num_queries_per_kv, num_splits, SPLIT, FUSED, HEAD_DIM, BLOCK_H,
                BLOCK_G, BLOCK_S)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, mid_o_ptr, mid_lse_ptr,
                         out_ptr, counters_ptr, order_ptr, qk_scale, stride_qb, stride_qh, stride_cb, stride_ct,
                         stride_ch, stride_bt, stride_ob, stride_oh, num_queries_per_kv, num_splits,
                         SPLIT: tl.constexpr, FUSED: tl.constexpr, HAS_ORDER: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """One (sequence, kv head, split): the group's query heads over the split's keys."""
    wait_for_prior_grids(USE_PDL)
    if HAS_ORDER:
        seq = tl.load(order_ptr + tl.program_id(0)).to(tl.int32)
    else:
        seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * num_queries_per_kv + offs_g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < num_queries_per_kv)[:, None], other=0.0)
    seq_len, chunk, kv_start, kv_end = split_range(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    attend_split(q, None, None, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, mid_o_ptr,
                 mid_lse_ptr, out_ptr, counters_ptr, seq, kv_head, split, seq_len, chunk, kv_start, kv_end, qk_scale,
                 stride_cb, stride_ct, stride_ch, stride_ob, stride_oh, num_queries_per_kv, num_splits, -1, None, None,
                 False, False, SPLIT, FUSED, DOT_PRECISION, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_N, BLOCK_G, BLOCK_S)


@triton.jit
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    lse_row = mid_lse_ptr + row * num_splits
    o_row = mid_o_ptr + row * num_splits * HEAD_DIM
    offs_d = tl.arange(0, HEAD_DIM)

    lse_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s in range(0, num_splits, BLOCK_S):
        offs_s = s + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    # A sequence of length 0 (a CUDA-graph padding row) has every lse = -inf: it gets zeros, not NaN.
    lse_max = tl.max(lse_max, 0)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)

    w_sum = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(0, num_splits, BLOCK_S):
        offs_s = s + tl.arange(0, BLOCK_S)
        lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        used = lse > float("-inf")
        # Empty splits' partial outputs are never read.
        o = tl.load(o_row + offs_s[:, None] * HEAD_DIM + offs_d[None, :], mask=used[:, None], other=0.0)
        w = tl.exp2(lse - lse_max)
        w_sum += w
        acc += tl.sum(o * w[:, None], 0)
    w_total = tl.sum(w_sum, 0)
    result = acc / tl.where(w_total > 0, w_total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d, result.to(out_ptr.dtype.element_ty))


def default_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int) -> int:
    """About 1024 programs, but 2 to 16 splits, and never a split under 64 keys; one split past 1024 programs.

    Measured on an H200 (bf16, 8 kv heads, graph-captured; probe at 275aa23): at batch 256
    two splits beat one by 4% (3.9 TB/s: long and short sequences balance better); at batch 1 with 128-640
    keys, 4-16 splits took 6.3-6.6 us where 128 took 11.8 us (empty splits and a long reduce are not free),
    and at 4,000 keys 16-32 splits were fastest. A captured graph sizes max_context_len to max_model_len,
    so the count must suit short and long contexts alike."""
    # Past 1,024 programs the GPU is full without splits, and the reduce launch is saved: on an H100 with
    # 128-key tiles, one split at batches over 128 (8 kv heads) cut the throughput recipe's GPU time 1.2-1.5 %
    # (probe at 275aa23).
    if batch_size * num_kv_heads > 1024:
        return 1
    wanted = min(16, max(2, triton.cdiv(1024, batch_size * num_kv_heads)))
    return max(1, min(wanted, triton.cdiv(max_context_len, _BLOCK_N)))


class SplitLaunch(NamedTuple):
    """A split kernel's launch: its grid (sequences, kv heads, splits), the partials' fp32 scratch, the counters
    pointer (seq_lens stands in when there are none), and the constexprs and options every split kernel takes."""

    grid: tuple[int, int, int]
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    counters: torch.Tensor
    options: dict


def plan_split_launch(dtype: torch.dtype, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, num_splits: int | None,
                      counters: torch.Tensor | None) -> SplitLaunch | None:
    """Check the arguments (as decode_attention takes them) against out [B, num_q_heads, head_dim] and plan the
    launch; dtype is the queries' (fp32 gets an exact dot). None when there is nothing to launch (B == 0)."""
    batch, num_q_heads, head_dim = out.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim in (64, 128), "head_dim must be 64 or 128"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 8"
    assert num_q_heads % num_kv_heads == 0 and out.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert seq_lens.shape == (batch,) and block_tables.shape[0] == batch
    if counters is not None:
        assert counters.dtype == torch.int32 and counters.is_contiguous(), "counters must be contiguous int32"
        assert counters.numel() >= batch * num_kv_heads, "counters needs one slot per (sequence, kv head)"
        assert counters.device == out.device
    if batch == 0:
        return None
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size)
    group = num_q_heads // num_kv_heads
    split = num_splits > 1
    fused = split and counters is not None
    if split:
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=out.device)
    else:
        mid_o = mid_lse = out  # never read or written: the kernel writes the output directly
    block_g = triton.next_power_of_2(group)
    pdl = use_pdl(out)
    # Memory bound: two stages of 64-key tiles keep the next tile's gather in flight. Large 16-bit batches stream
    # more bytes per program with 128-key tiles in three stages (192 KB of shared memory at head_dim 128, too
    # much in fp32): on an H100, 3 % faster at batch 128 and 256, and the throughput recipe's run 2.7 % shorter
    # (probes at 275aa23).
    block_n, num_stages = (128, 3) if batch >= _LARGE_BATCH and k_cache.element_size() == 2 else (_BLOCK_N, 2)
    options = dict(
        SPLIT=split, FUSED=fused,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        # tl.dot needs M >= 16: small groups are padded with zero queries, free since decode is memory bound.
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        # The fused merge needs no tl.dot, so its head tile is just the group (4 for Llama-3.1-8B).
        BLOCK_G=block_g,
        BLOCK_S=min(triton.next_power_of_2(num_splits), max(1, _MERGE_TILE // (block_g * head_dim))),
        USE_PDL=pdl, launch_pdl=pdl,
        num_warps=4, num_stages=num_stages,
    )
    return SplitLaunch((batch, num_kv_heads, num_splits), mid_o, mid_lse, counters if fused else seq_lens, options)


def launch_reduce(launch: SplitLaunch, out: torch.Tensor) -> None:
    """The second launch, merging the partials, where the split kernel stored some and did not merge them."""
    if not launch.options["SPLIT"] or launch.options["FUSED"]:
        return
    num_splits, pdl = launch.grid[2], launch.options["USE_PDL"]
    _decode_reduce_kernel[(out.shape[0], out.shape[1])](
        launch.mid_o, launch.mid_lse, out, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=out.shape[2],
        BLOCK_S=min(16, triton.next_power_of_2(num_splits)),  # bounds registers at 16 x head_dim fp32
        USE_PDL=pdl, launch_pdl=pdl, num_warps=4)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                     order: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, num_q_heads, head_dim], one token per sequence at position seq_lens[b] - 1; returns q's shape.

    num_splits must not depend on tensor values when the call is captured in a CUDA graph; by default it
    comes from shapes only (batch, kv heads, block_tables width). out, if given, is written in place.
    A sequence with seq_lens[b] == 0 (batch padding) gets zeros.

    counters, if given, selects the one-launch path: an int32 buffer of at least B * num_kv_heads elements,
    all zero, owned by the caller (so that a CUDA graph capture allocates nothing) and left all zero again
    by the kernel, so one buffer serves every layer and replay. Calls sharing a buffer must not run
    concurrently (on two streams). Without it the partials are merged by a second launch.

    order, if given, is a permutation of 0..B-1 [B] (int64 or int32): the order in which the sequences' programs
    are dispatched. Longest first keeps a long sequence's programs from starting last, when the rest of the
    launch has drained (1.3 % faster at batch 256 over 100-2,048 keys on an H100; probe at 275aa23).
    """
    assert q.stride(2) == 1
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape
    launch = plan_split_launch(q.dtype, out, k_cache, v_cache, seq_lens, block_tables, num_splits, counters)
    if launch is None:
        return out
    if order is not None:
        assert order.shape == (q.shape[0],) and order.is_contiguous(), "order must be a contiguous permutation [B]"
    _decode_split_kernel[launch.grid](
        q, k_cache, v_cache, seq_lens, block_tables, launch.mid_o, launch.mid_lse, out, launch.counters,
        order if order is not None else seq_lens, scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        q.shape[1] // k_cache.shape[2],
        launch.grid[2],  # num_splits as a runtime value: one compiled kernel serves every batch's split count
        HAS_ORDER=order is not None, **launch.options)
    launch_reduce(launch, out)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float, num_splits: int | None = None,
                         out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                         order: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch version of decode_attention, in fp32; num_splits, counters and order are accepted and
    ignored."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len, group)
        scores = (k @ q[b].float()[:, :, None]).squeeze(-1) * scale  # [H, seq_len]
        out[b] = (scores.softmax(-1)[:, None, :] @ v).squeeze(1).to(q.dtype)
    return out
