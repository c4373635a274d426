"""The device side of one row of prefill attention's map (prefill/attention.py, prefill/tile_map.py): a
tile's query rows against one range of keys, gathered page by page through the block table, with an online
softmax; then the rows' output, written out, or for one split of a tile published for the tile's merge
(prefill/split.py).
"""

import triton
import triton.language as tl

from nanoserve.kernels.prefill.split import _publish_and_merge
from nanoserve.kernels.softcap import softcap_scores


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
    window,
    softcap,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Online-softmax accumulation over key tiles [lo, hi); MASKED applies causality and the end bound, WINDOW the
    sliding window (keys after q_pos - window only), under which a row may see no key of a tile at all. SOFTCAP caps
    the scores (kernels/softcap.py; softcap in log2 units)."""
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
        # An fp8 cache's tiles widened to q's dtype (exactly); its scales are applied outside (qk_scale, v_scale).
        k, v = k.to(q.dtype), v.to(q.dtype)

        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            qk = softcap_scores(qk, softcap)
        if MASKED:
            causal = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            qk = tl.where(causal, qk, float("-inf"))
        if WINDOW:
            qk = tl.where(offs_n[None, :] > q_pos[:, None] - window, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if WINDOW:
            # A row with no key yet keeps m = -inf: subtract 0 there, for weights of 0 rather than NaN.
            m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(qk - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_rows(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, split_out_ptr, split_lse_ptr, split_count_ptr,
    qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
    kv_head, head, seq, start_r, kv_lo, kv_hi, first_slot, split, num_splits, q_start, q_rows, pos0, window, sinks_ptr,
    softcap, v_scale, PACK: tl.constexpr, SPLITS: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROWS: tl.constexpr, SLOT_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One map row's work: query rows start_r .. start_r + ROWS over keys [kv_lo, kv_hi); a split's partial
    result goes to scratch slots of SLOT_ROWS rows. WINDOW: only keys after each row's position - window; SINKS:
    each query head's sink logit (fp32, natural log) joins the softmax's denominator, in the first split only.
    KV_FP8: the values were summed as an fp8 cache stores them, so the rows' output takes v_scale (before a split's
    merge, which is linear in it)."""
    # Rows run in token order, so the first row has the tile's least position.
    first_pos = pos0 + start_r // PACK
    # The map starts a range at or below first_pos, so every row of the tile sees its first key and no row max
    # stays -inf (which would give NaN from -inf - -inf); and on a multiple of the key tile, which written out
    # lets the compiler see whole pages and contiguous keys in each key tile (else 128-row tiles spill).
    # With a window, key tiles wholly before the first row's window are seen by no row: skipped. Rows, and whole
    # ranges of a split tile, may then see no key (handled where their sums are used).
    if WINDOW:
        kv_lo = tl.maximum(kv_lo, first_pos - window + 1)
    kv_lo = kv_lo // BLOCK_N * BLOCK_N

    offs_r = start_r + tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    r_valid = offs_r < q_rows
    tok = offs_r // PACK
    q_pos = pos0 + tok
    q_tokens = (q_start + tok).to(tl.int64)
    q_heads = head * PACK + offs_r % PACK
    q_offs = q_tokens[:, None] * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=r_valid[:, None], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Whole key tiles below this tile's first position are visible to every row: no masks there. Rows past the
    # sequence's sit further on and see at least as much.
    unmasked_end = kv_lo + tl.maximum(tl.minimum(first_pos, kv_hi) - kv_lo, 0) // BLOCK_N * BLOCK_N
    if WINDOW:
        # Below the tile's last row's window some rows lose keys: those tiles take the window's mask; from the first
        # key tile every row's window holds on, none.
        last_pos = pos0 + (tl.minimum(start_r + ROWS, q_rows) - 1) // PACK
        window_end = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        window_end = tl.minimum(tl.maximum(window_end, kv_lo), unmasked_end)
        acc, l_i, m_i = _attend_tiles(
            acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, stride_cb, stride_ct, stride_ch,
            kv_lo, window_end, qk_scale, window, softcap, DOT_PRECISION, False, True, SOFTCAP, HEAD_DIM, BLOCK_SIZE,
            BLOCK_N,
        )  # fmt: skip
        kv_lo = window_end
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, stride_cb, stride_ct, stride_ch,
        kv_lo, unmasked_end, qk_scale, window, softcap, DOT_PRECISION, False, False, SOFTCAP, HEAD_DIM, BLOCK_SIZE,
        BLOCK_N,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, bt_row, kv_head, stride_cb, stride_ct, stride_ch,
        unmasked_end, kv_hi, qk_scale, window, softcap, DOT_PRECISION, True, WINDOW, SOFTCAP, HEAD_DIM, BLOCK_SIZE,
        BLOCK_N,
    )  # fmt: skip

    if SINKS:
        if split == 0:
            # The sink as one more logit (log2 units, as the scores): it raises the max and the sum, not acc.
            sink = tl.load(sinks_ptr + q_heads).to(tl.float32) * 1.4426950408889634
            m_new = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_new)
            m_i = m_new
    if WINDOW:
        # A split range wholly outside a row's window leaves it l = 0: output 0 and lse -inf (weight 0 in the merge).
        seen = l_i > 0
        acc = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    else:
        acc = acc / l_i[:, None]
        lse = m_i + tl.log2(l_i)
    if KV_FP8:
        acc = acc * v_scale
    write = r_valid
    if SPLITS:
        if num_splits > 1:
            acc, last = _publish_and_merge(
                acc, lse, split_out_ptr, split_lse_ptr, split_count_ptr, first_slot, split,
                num_splits, head, tl.num_programs(0), r_valid, WINDOW, HEAD_DIM, ROWS, SLOT_ROWS,
            )  # fmt: skip
            write = tl.where(last, r_valid, False)  # (r_valid & last is int32 in the interpreter)
    out_offs = q_tokens[:, None] * stride_ot + q_heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=write[:, None])
