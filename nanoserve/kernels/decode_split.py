"""A flash-decoding split program's device pieces: its key range, one tile of keys loaded and attended to (online
softmax), the loop over its tiles, and its result handed on (the output, or a partial for the merge). The split
kernel of decode_attention.py and that of decode_rope_attention.py (qkv_rope_store's work in the same launch) are
both built of them."""

import triton
import triton.language as tl

from nanoserve.kernels.decode_merge import merge_splits
from nanoserve.kernels.softcap import softcap_scores


@triton.jit
def split_range(seq_lens_ptr, seq, split, num_splits, window, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """seq_len, the split size (chunk) and this split's keys [kv_start, kv_end) of sequence seq. WINDOW: the query
    (at seq_len - 1) sees the last `window` keys only, and the splits share those out."""
    # Chunks are whole BLOCK_N tiles so that every tile but a sequence's last is full.
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW:
        kv_base = tl.maximum(seq_len - window, 0)
    else:
        kv_base = 0
    chunk = tl.cdiv(tl.cdiv(seq_len - kv_base, num_splits), BLOCK_N) * BLOCK_N
    kv_start = kv_base + split * chunk
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
def attend_tile(q, k, v, start_n, kv_end, m_i, l_i, acc, qk_scale, new_pos, qk_new, new_v, softcap,
                NEW_KV: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step of q [BLOCK_H, HEAD_DIM] over a tile of keys start_n.. holding at least one
    below kv_end (so m_new is finite). NEW_KV: the key at position new_pos, if in the tile, is not the cache's
    (load_kv_tile left zeros there) but one given by its scaled scores qk_new [BLOCK_H] and value new_v
    [1, HEAD_DIM]. Patching the scores and the sums, rather than the K/V tiles, keeps the tiles' loads going
    straight to shared memory in the pipelined loop: a select on the tiles cost ~100 registers a thread.
    SOFTCAP: the scores are capped (kernels/softcap.py; softcap in log2 units; qk_new comes capped). An fp8 cache's
    tiles are widened to q's dtype (exactly) for the dots; its scales are applied outside (qk_scale, write_split)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k, v = k.to(q.dtype), v.to(q.dtype)
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:
        qk = softcap_scores(qk, softcap)
    if NEW_KV:
        is_new = (offs_n == new_pos)[None, :]
        qk = tl.where(is_new, qk_new[:, None], qk)
    qk = tl.where((offs_n < kv_end)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the dot's inputs are in q's dtype: p is rounded here, the new key's weight too
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    if NEW_KV:
        p_new = tl.sum(tl.where(is_new, p.to(tl.float32), 0.0), 1)  # the new key's column (or zeros)
        acc += p_new[:, None] * new_v.to(v.dtype).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def write_split(acc, m_i, l_i, seq, kv_head, split, seq_len, chunk, kv_start, mid_o_ptr, mid_lse_ptr, out_ptr,
                counters_ptr, stride_ob, stride_oh, num_queries_per_kv, num_splits, v_scale, SPLIT: tl.constexpr,
                FUSED: tl.constexpr, WINDOW: tl.constexpr, KV_FP8: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Hand a (sequence, kv head, split) program's result on. SPLIT=False: it is the output (num_splits is 1).
    SPLIT, not FUSED: a partial for the reduce kernel. SPLIT and FUSED: a partial, and the last program of the
    (sequence, kv head) merges them all. KV_FP8: the values were summed as stored, so the result takes v_scale
    (the merge is linear in the partials)."""
    num_kv_heads = tl.num_programs(1)
    num_q_heads = num_kv_heads * num_queries_per_kv
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * num_queries_per_kv + offs_g
    h_valid = offs_g < num_queries_per_kv
    # An empty split (kv_start >= seq_len) leaves l_i = 0: o = 0 and lse = -inf.
    nonempty = l_i > 0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * v_scale
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
                # The merge counts splits from the first key the query sees (split_range's kv_base).
                num_keys = seq_len - (kv_start - split * chunk) if WINDOW else seq_len
                merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, seq * num_q_heads + kv_head * num_queries_per_kv,
                             seq.to(tl.int64) * stride_ob + (kv_head * num_queries_per_kv) * stride_oh,
                             stride_oh, num_keys, chunk, num_queries_per_kv, num_splits,
                             HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G, BLOCK_S=BLOCK_S)


@triton.jit
def attend_split(q, k0, v0, k_cache_ptr, v_cache_ptr, bt_row, mid_o_ptr, mid_lse_ptr, out_ptr, counters_ptr, seq,
                 kv_head, split, seq_len, chunk, kv_start, kv_end, qk_scale, stride_cb, stride_ct, stride_ch,
                 stride_ob, stride_oh, num_queries_per_kv, num_splits, new_pos, qk_new, new_v, sinks_ptr, softcap,
                 v_scale, PREFETCHED: tl.constexpr, NEW_KV: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
                 WINDOW: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """A (sequence, kv head, split) program's work once its queries q [BLOCK_H, HEAD_DIM] are known: the online
    softmax over its keys [kv_start, kv_end) (PREFETCHED: the first tile is k0/v0, loaded by the caller), then
    the result handed on (write_split). NEW_KV: see attend_tile. SINKS: the group's sink logits (fp32, natural
    log, at sinks_ptr by query head) join the first split's sums, so the merge counts each once. WINDOW: the
    splits' ranges start at the window (split_range). SOFTCAP: see attend_tile. KV_FP8: the cache is fp8, whose
    k_scale the caller folded into qk_scale and whose v_scale write_split applies."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    begin = kv_start
    if PREFETCHED:
        if kv_start < kv_end:  # an empty split has no tile
            m_i, l_i, acc = attend_tile(q, k0, v0, kv_start, kv_end, m_i, l_i, acc, qk_scale, new_pos, qk_new, new_v,
                                        softcap, NEW_KV, SOFTCAP, DOT_PRECISION, BLOCK_N)
        begin = kv_start + BLOCK_N
    for start_n in range(begin, kv_end, BLOCK_N):
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start_n, kv_end, new_pos, stride_cb,
                            stride_ct, stride_ch, NEW_KV, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = attend_tile(q, k, v, start_n, kv_end, m_i, l_i, acc, qk_scale, new_pos, qk_new, new_v,
                                    softcap, NEW_KV, SOFTCAP, DOT_PRECISION, BLOCK_N)
    if SINKS:
        if split == 0:
            offs_g = tl.arange(0, BLOCK_H)
            sink = tl.load(sinks_ptr + kv_head * num_queries_per_kv + offs_g, mask=offs_g < num_queries_per_kv,
                           other=0.0).to(tl.float32) * 1.4426950408889634  # log2 units, as the scores
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            m_i = m_new
    write_split(acc, m_i, l_i, seq, kv_head, split, seq_len, chunk, kv_start, mid_o_ptr, mid_lse_ptr, out_ptr,
                counters_ptr, stride_ob, stride_oh, num_queries_per_kv, num_splits, v_scale, SPLIT, FUSED, WINDOW,
                KV_FP8, HEAD_DIM, BLOCK_H, BLOCK_G, BLOCK_S)
