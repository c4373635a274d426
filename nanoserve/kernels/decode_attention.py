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

The split program's pieces are in decode_split.py, the merges in decode_merge.py and the launch planning in
decode_launch.py, all shared with decode_rope_attention.py, which does qkv_rope_store's work in the same launch.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.decode_launch import launch_reduce, plan_split_launch
from nanoserve.kernels.decode_split import attend_split, split_range
from nanoserve.kernels.kv_quant import kv_scales
from nanoserve.kernels.pdl import wait_for_prior_grids
from nanoserve.kernels.prefill.attention import gather_kv, softmax_with_sinks

LOG2E = 1.4426950408889634  # the kernels use exp2/log2: scores are scaled by scale * log2(e)


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, mid_o_ptr, mid_lse_ptr,
                         out_ptr, counters_ptr, order_ptr, qk_scale, stride_qb, stride_qh, stride_cb, stride_ct,
                         stride_ch, stride_bt, stride_ob, stride_oh, num_queries_per_kv, num_splits, window,
                         sinks_ptr, softcap, v_scale, SPLIT: tl.constexpr, FUSED: tl.constexpr,
                         HAS_ORDER: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
                         KV_FP8: tl.constexpr,
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
    seq_len, chunk, kv_start, kv_end = split_range(seq_lens_ptr, seq, split, num_splits, window, BLOCK_N, WINDOW)
    attend_split(q, None, None, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, mid_o_ptr,
                 mid_lse_ptr, out_ptr, counters_ptr, seq, kv_head, split, seq_len, chunk, kv_start, kv_end, qk_scale,
                 stride_cb, stride_ct, stride_ch, stride_ob, stride_oh, num_queries_per_kv, num_splits, -1, None, None,
                 sinks_ptr, softcap, v_scale, False, False, SPLIT, FUSED, WINDOW, SINKS, SOFTCAP, KV_FP8, DOT_PRECISION,
                 HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_N, BLOCK_G, BLOCK_S)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, scale: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                     order: torch.Tensor | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q [B, num_q_heads, head_dim], one token per sequence at position seq_lens[b] - 1; returns q's shape.

    window: a sliding window (the query sees the last `window` keys), None for none. sinks: fp32 [num_q_heads],
    each head's sink logit joining the softmax's denominator (gpt-oss), None for none. softcap: scores capped at
    softcap * tanh(score / softcap) (Gemma 2; kernels/softcap.py), None for none. k_scale, v_scale: an fp8 cache's
    scales (kernels/kv_quant.py), ignored for a cache in q's dtype.

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
    launch = plan_split_launch(q.dtype, out, k_cache, v_cache, seq_lens, block_tables, num_splits, counters, window)
    if launch is None:
        return out
    if order is not None:
        assert order.shape == (q.shape[0],) and order.is_contiguous(), "order must be a contiguous permutation [B]"
    _decode_split_kernel[launch.grid](
        q, k_cache, v_cache, seq_lens, block_tables, launch.mid_o, launch.mid_lse, out, launch.counters,
        order if order is not None else seq_lens, scale * kv_scales(k_cache, k_scale) * LOG2E, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), q.shape[1] // k_cache.shape[2],
        launch.grid[2],  # num_splits as a runtime value: one compiled kernel serves every batch's split count
        window or 0, sinks, (softcap or 0.0) * LOG2E, kv_scales(v_cache, v_scale), HAS_ORDER=order is not None,
        WINDOW=window is not None, SINKS=sinks is not None, SOFTCAP=softcap is not None, **launch.options)
    launch_reduce(launch, out)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor, scale: float, num_splits: int | None = None,
                         out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                         order: torch.Tensor | None = None, window: int | None = None,
                         sinks: torch.Tensor | None = None, softcap: float | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> torch.Tensor:
    """Plain PyTorch version of decode_attention, in fp32; num_splits, counters and order are accepted and
    ignored."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], seq_len, group, k_scale, v_scale)
        first = 0 if window is None else max(seq_len - window, 0)
        k, v = k[:, first:], v[:, first:]
        scores = (k @ q[b].float()[:, :, None]).squeeze(-1) * scale  # [H, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = (softmax_with_sinks(scores, sinks)[:, None, :] @ v).squeeze(1).to(q.dtype)
    return out
