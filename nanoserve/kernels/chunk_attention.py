"""Attention of one sequence's new tokens over one run of its keys, merged into a running result by log-sum-exp.

Long-context mode (worker/kv_offload.py) computes a sequence's attention piece by piece: over the keys still on the
device (its window, causal), then over each chunk of older keys streamed back from CPU memory. Each call adds its
piece to fp32 accumulators `out` [M, Hq, D] and `lse` [M, Hq] (natural log): the softmax over the union of the
pieces is the pieces' outputs weighted by exp(lse_piece - lse_union), so no piece needs to see another's keys.

Keys are paged ([blocks, block_size, kv heads, head_dim], any block stride: a ring slot holding keys and values of a
block side by side works as well as the pool) and listed by `block_ids`; key j sits at position key_pos0 + j and
query i at q_pos0 + i, which sees keys up to its own position, and with a sliding window W only those after its
position - W. A layer's attention sinks (gpt-oss) are no piece's: the caller adds them once to the merged result.
softcap (Gemma 2) caps every score, kernels/softcap.py. An fp8 cache (or ring) is read with the layer's k_scale and
v_scale (kernels/kv_quant.py).
"""

import torch

from nanoserve.kernels.kv_quant import dequantize_kv, kv_scales

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch reference serves there
    triton = None
else:
    from nanoserve.kernels.softcap import softcap_scores


def chunk_attention_ref(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_ids: torch.Tensor,
                        num_keys: int, key_pos0: int, q_pos0: int, scale: float, out: torch.Tensor,
                        lse: torch.Tensor, accumulate: bool, window: int | None = None,
                        softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """PyTorch reference (and the CPU path): same contract as chunk_attention."""
    group = q.shape[1] // k_blocks.shape[2]
    k = dequantize_kv(k_blocks[block_ids.long()].flatten(0, 1)[:num_keys], torch.float32, k_scale)
    v = dequantize_kv(v_blocks[block_ids.long()].flatten(0, 1)[:num_keys], torch.float32, v_scale)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [N, Hq, D]
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = q_pos0 + torch.arange(q.shape[0], device=q.device)
    k_pos = key_pos0 + torch.arange(num_keys, device=q.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if window is not None:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    piece_lse = torch.logsumexp(scores, dim=-1)  # [Hq, M]; -inf where a query sees no key here
    probs = torch.exp(scores - piece_lse.clamp_min(-1e30)[..., None])
    piece = torch.einsum("hmn,nhd->mhd", probs, v)
    piece_lse = piece_lse.transpose(0, 1)
    if not accumulate:
        out.copy_(piece)
        lse.copy_(piece_lse)
        return
    merged = torch.logaddexp(lse, piece_lse)
    safe = merged.clamp_min(-1e30)  # both -inf: weights 0, not NaN
    out.mul_(torch.exp(lse - safe)[..., None]).add_(piece * torch.exp(piece_lse - safe)[..., None])
    lse.copy_(merged)


if triton is not None:

    @triton.jit
    def _chunk_attention_kernel(q_ptr, k_ptr, v_ptr, block_ids_ptr, out_ptr, lse_ptr, num_keys, key_pos0, q_pos0,
                                num_rows, qk_scale, stride_qm, stride_qh, stride_kb, stride_kt, stride_kh,
                                group, num_q_heads, window, softcap, v_scale, ACCUMULATE: tl.constexpr,
                                WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr,
                                DOT_PRECISION: tl.constexpr,
                                HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr):
        # GQA packing: a program serves one kv head, and its tile's entries are (query row, query head of the group)
        # pairs, row-major, so each key tile is read once for the whole group.
        kv_head = tl.program_id(1)
        offs_e = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row = offs_e // group
        head = kv_head * group + offs_e % group
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_e < num_rows * group
        q = tl.load(q_ptr + row[:, None] * stride_qm + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        q_pos = q_pos0 + row
        # Keys past the tile's last query are masked for every entry: stop before them.
        hi = tl.minimum(num_keys, q_pos0 + (tl.program_id(0) * BLOCK_M + BLOCK_M - 1) // group + 1 - key_pos0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        lo = 0
        if WINDOW:
            # Keys before the tile's first query's window are masked for every entry: start at their tile.
            lo = tl.maximum(q_pos0 + tl.program_id(0) * BLOCK_M // group - window + 1 - key_pos0, 0)
            lo = lo // BLOCK_N * BLOCK_N
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi
            blocks = tl.load(block_ids_ptr + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            kv_offs = blocks * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(v_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
            # An fp8 cache's tiles widened to q's dtype (exactly); k_scale is in qk_scale, v_scale applied below.
            k, v = k.to(q.dtype), v.to(q.dtype)
            # Products in the inputs' precision, accumulated in fp32; the softmax is fp32 throughout.
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # log2 units: qk_scale holds log2(e)
            if SOFTCAP:
                qk = softcap_scores(qk, softcap)
            seen = (key_pos0 + offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
            if WINDOW:
                seen = seen & (key_pos0 + offs_n[None, :] > q_pos[:, None] - window)
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        nonempty = l_i > 0
        piece = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        if KV_FP8:
            piece = piece * v_scale
        ln2 = 0.6931471805599453
        piece_lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * ln2, float("-inf"))
        o_ptrs = out_ptr + (row * num_q_heads + head)[:, None] * HEAD_DIM + offs_d[None, :]
        lse_ptrs = lse_ptr + row * num_q_heads + head
        if ACCUMULATE:
            old_lse = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
            top = tl.maximum(old_lse, piece_lse)
            top_safe = tl.where(top > float("-inf"), top, 0.0)
            w_old = tl.exp(old_lse - top_safe)
            w_new = tl.exp(piece_lse - top_safe)
            total = w_old + w_new
            old = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
            piece = (old * w_old[:, None] + piece * w_new[:, None]) / tl.where(total > 0, total, 1.0)[:, None]
            piece_lse = tl.where(total > 0, top_safe + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(o_ptrs, piece, mask=row_ok[:, None])
        tl.store(lse_ptrs, piece_lse, mask=row_ok)


def chunk_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_ids: torch.Tensor,
                    num_keys: int, key_pos0: int, q_pos0: int, scale: float, out: torch.Tensor, lse: torch.Tensor,
                    accumulate: bool, window: int | None = None, softcap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """q [M, Hq, D] over keys 0..num_keys-1 of k/v_blocks[block_ids] ([blocks, block_size, Hkv, D], the last two
    dims contiguous; k and v with the same strides), into fp32 out [M, Hq, D] and lse [M, Hq] (contiguous): replaced,
    or with accumulate merged with what they hold. window: the sliding window (module docstring), None for none;
    softcap: the scores' cap, None for none. k_scale, v_scale: an fp8 cache's scales, ignored for others."""
    assert k_blocks.stride() == v_blocks.stride() and k_blocks.stride(3) == 1 and q.stride(2) == 1
    assert out.is_contiguous() and lse.is_contiguous() and out.dtype == lse.dtype == torch.float32
    rows, heads, head_dim = q.shape
    kv_heads = k_blocks.shape[2]
    group = heads // kv_heads
    # A decode's one row (its group's query heads) takes a 16-entry tile, the smallest a matrix product takes. For
    # prefill chunks 64-entry tiles (4 warps, 2 stages) ran `bench long-context` faster than 128-row ones (8 warps, 3
    # stages) on an H100, before GQA packing: 5,294 vs 4,611 prefill tok/s at 64k, 4,972 vs 3,755 at 128k. The
    # packing (each key tile read once per kv head, not once per query head) is not measured on a GPU yet.
    block_m, warps, stages = (64, 4, 2) if rows * group > 16 else (16, 4, 2)
    grid = (triton.cdiv(rows * group, block_m), kv_heads)
    _chunk_attention_kernel[grid](
        q, k_blocks, v_blocks, block_ids, out, lse, num_keys, key_pos0, q_pos0, rows,
        scale * kv_scales(k_blocks, k_scale) * 1.4426950408889634,
        q.stride(0), q.stride(1), k_blocks.stride(0), k_blocks.stride(1), k_blocks.stride(2),
        group, heads, window or 0, (softcap or 0.0) * 1.4426950408889634, kv_scales(v_blocks, v_scale),
        ACCUMULATE=accumulate, WINDOW=window is not None, SOFTCAP=softcap is not None,
        KV_FP8=k_blocks.dtype == torch.float8_e4m3fn,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEAD_DIM=head_dim, BLOCK_SIZE=k_blocks.shape[1],
        BLOCK_M=block_m, BLOCK_N=64, num_warps=warps, num_stages=stages)
