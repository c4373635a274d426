"""The device side of prefill attention's key splits (prefill/attention.py): a program that ran one key
range of a query tile leaves its partial output and log-sum-exp in scratch (prefill/split_scratch.py), and the
last of the tile's programs to finish merges them all. Merging there, not in a second kernel, keeps steps that
split nothing free of an extra launch in every layer of every captured graph.
"""

import triton
import triton.language as tl


@triton.jit
def _publish_and_merge(
    o,
    lse,
    split_out_ptr,
    split_lse_ptr,
    split_count_ptr,
    first_slot,
    split,
    num_splits,
    head,
    num_heads,
    rows_valid,
    EMPTY_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SLOT_ROWS: tl.constexpr,
):
    """Store this split's partial output o and lse (log2 domain) of BLOCK_M rows in its scratch slot (of SLOT_ROWS
    rows); the tile's last split to finish returns the merge of all of them and True, the others o and False.
    EMPTY_SPLITS: a split may have no key for a row (a sliding window), its lse -inf."""
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    part = (first_slot + split).to(tl.int64) * num_heads + head
    tl.store(split_lse_ptr + part * SLOT_ROWS + offs_r, lse, mask=rows_valid)
    # (Rounded to the scratch's dtype: fp32, or the inputs' 16-bit one.)
    tl.store(
        split_out_ptr + (part * SLOT_ROWS + offs_r)[:, None] * HEAD_DIM + offs_d[None, :],
        o.to(split_out_ptr.dtype.element_ty),
        mask=rows_valid[:, None],
    )
    # Ordering, CUTLASS's semaphore pattern (as in decode_attention's one-launch path). Release: the barrier puts
    # every thread's stores above before the atomic, which Triton issues from one thread, acq_rel at gpu scope.
    # The splits' atomics on one counter form one modification order, so the split that reads num_splits - 1
    # acquires after every other split's release. Acquire: the atomic's result reaches the other threads through
    # shared memory behind a barrier (restated below), so their loads of the partials come after it.
    tl.debug_barrier()
    counter = split_count_ptr + first_slot.to(tl.int64) * num_heads + head
    last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1
    if last:
        tl.debug_barrier()
        # Partials two per round trip to L2 (their loads issue together), so a merge of n splits waits on n / 2
        # trips, not n; always in split order, whichever split merges, so the result is the same every run.
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        w_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for s in range(0, num_splits, 2):
            b_ok = tl.where(s + 1 < num_splits, rows_valid, False)  # (& with a scalar is int32 in the interpreter)
            part_a = (first_slot + s).to(tl.int64) * num_heads + head
            part_b = part_a + num_heads
            # .cg reads L2, where the other programs' stores went, never a stale line of this SM's L1.
            lse_a = tl.load(split_lse_ptr + part_a * SLOT_ROWS + offs_r, mask=rows_valid, other=0.0,
                            cache_modifier=".cg")  # fmt: skip
            lse_b = tl.load(split_lse_ptr + part_b * SLOT_ROWS + offs_r, mask=b_ok, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
            o_a = tl.load(split_out_ptr + (part_a * SLOT_ROWS + offs_r)[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=rows_valid[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)  # fmt: skip
            o_b = tl.load(split_out_ptr + (part_b * SLOT_ROWS + offs_r)[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=b_ok[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)  # fmt: skip
            # Without EMPTY_SPLITS every split has a key for every row, so lse_a is finite and m_new never -inf; a
            # missing b weighs 0. With them, a row whose first splits saw nothing subtracts 0, for weights of 0.
            m_new = tl.maximum(m, tl.maximum(lse_a, lse_b))
            if EMPTY_SPLITS:
                m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
            else:
                m_sub = m_new
            alpha = tl.exp2(m - m_sub)
            w_a = tl.exp2(lse_a - m_sub)
            w_b = tl.exp2(lse_b - m_sub)
            acc = acc * alpha[:, None] + o_a * w_a[:, None] + o_b * w_b[:, None]
            w_sum = w_sum * alpha + w_a + w_b
            m = m_new
        o = acc / w_sum[:, None]
        # Back to zero for the next launch (the next layer), which starts only after this one ends.
        tl.store(counter, 0)
    return o, last
