"""Flash-decoding: one new query token per sequence attending to its whole paged KV cache.

Each sequence's keys are cut into num_splits chunks handled by separate programs, which write a partial
output and its log-sum-exp; a second kernel merges them. One program serves all the query heads that
share a kv head, so each K/V byte is read once. The grid depends only on shapes and num_splits, so a
call can be captured in a CUDA graph; splits past a sequence's end write lse = -inf and are ignored.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.prefill_attention import gather_kv

_BLOCK_N = 64


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    num_queries_per_kv,
    num_splits,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * num_queries_per_kv

    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * num_queries_per_kv + offs_g
    h_valid = offs_g < num_queries_per_kv
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_valid[:, None],
        other=0.0,
    )

    # Chunks are whole BLOCK_N tiles so that every tile but a sequence's last is full.
    seq_len = tl.load(seq_lens_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_end
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_offs = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_valid[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)

        # Every tile in [kv_start, kv_end) holds at least one valid key, so m_new is finite.
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (kv_start >= seq_len) leaves l_i = 0: it stores o = 0 and lse = -inf.
    nonempty = l_i > 0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    mid_rows = (seq * num_q_heads + heads).to(tl.int64) * num_splits + split
    tl.store(mid_lse_ptr + mid_rows, lse, mask=h_valid)
    tl.store(mid_o_ptr + mid_rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=h_valid[:, None])


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
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
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
        result.to(out_ptr.dtype.element_ty),
    )


def default_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int) -> int:
    """About 1024 programs, but 2 to 16 splits, and never a split under 64 keys.

    Measured on an H200 (scripts/bench_decode_attention.py, bf16, 8 kv heads, graph-captured): at batch 256
    two splits beat one by 4% (3.9 TB/s: long and short sequences balance better); at batch 1 with 128-640
    keys, 4-16 splits took 6.3-6.6 us where 128 took 11.8 us (empty splits and a long reduce are not free),
    and at 4,000 keys 16-32 splits were fastest. A captured graph sizes max_context_len to max_model_len,
    so the count must suit short and long contexts alike."""
    wanted = min(16, max(2, triton.cdiv(1024, batch_size * num_kv_heads)))
    return max(1, min(wanted, triton.cdiv(max_context_len, _BLOCK_N)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, num_q_heads, head_dim], one token per sequence at position seq_lens[b] - 1; returns q's shape.

    num_splits must not depend on tensor values when the call is captured in a CUDA graph; by default it
    comes from shapes only (batch, kv heads, block_tables width). out, if given, is written in place.
    A sequence with seq_lens[b] == 0 (batch padding) gets zeros.
    """
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim in (64, 128), "head_dim must be 64 or 128"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 8"
    assert num_q_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert seq_lens.shape == (batch,) and block_tables.shape[0] == batch
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size)
    group = num_q_heads // num_kv_heads
    mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        mid_o,
        mid_lse,
        scale * 1.4426950408889634,  # log2(e): the kernels use exp2/log2
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        group,
        # A runtime value, not constexpr: one compiled kernel serves every batch size's split count.
        num_splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        # tl.dot needs M >= 16: small groups are padded with zero queries, free since decode is memory bound.
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=_BLOCK_N,
        # Memory bound: 4 warps per 64-key tile and two stages keep the next tile's gather in flight.
        num_warps=4,
        num_stages=2,
    )
    _decode_reduce_kernel[(batch, num_q_heads)](
        mid_o,
        mid_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=min(16, triton.next_power_of_2(num_splits)),  # bounds registers at 16 x head_dim fp32
        num_warps=4,
    )
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch version of decode_attention, in fp32; num_splits is accepted and ignored."""
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
