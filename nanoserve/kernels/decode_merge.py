"""Flash-decoding's merge: a (sequence, query head)'s partial outputs and log-sum-exps over its key splits into
its output, each partial weighted by exp2(lse - max lse). Two ways (decode_attention.py says when each is taken):
merge_splits, inside the split kernel, by the last program of a (sequence, kv head) for all of its query heads;
decode_reduce_kernel, a second launch of one program per (sequence, query head)."""

import triton
import triton.language as tl

from nanoserve.kernels.pdl import wait_for_prior_grids

# The fused merge loads [group, splits, head_dim] fp32 partials at once (one round trip to L2 rather than
# one per split, on the critical path of every batch-1 layer); tiles are capped at this many elements, 64
# registers a thread at 4 warps, and more splits than fit are merged a chunk at a time. Compiled offline for
# sm_90 (Triton 3.9), the merge raises the kernel from 80 to 137-150 registers at 16 splits with no spills,
# 80-90 at 2 splits (batch >= 64); smaller caps barely lower that, so the cap is left generous.
MERGE_TILE = 8192


@triton.jit
def merge_splits(mid_o_ptr, mid_lse_ptr, out_ptr, first_row, out_offset, stride_oh, num_keys, chunk,
                 num_queries_per_kv, num_splits,
                 HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge the partials of the query heads first_row.. (rows of [.., num_splits, HEAD_DIM]) into out.

    Only splits that hold keys (split * chunk < num_keys, the keys the query sees) are read: the others never
    stored anything. The
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
        used = g_valid[:, None] & ((splits < num_splits) & (splits * chunk < num_keys))[None, :]
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
def decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits,
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
