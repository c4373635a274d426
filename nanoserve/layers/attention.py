"""Paged attention over a mixed batch of decode tokens and prefill chunks.

The metadata says, for each sequence in the batch, which new tokens it brings (cu_seqlens_q), how
long its context is with them (seq_lens) and where its KV pages are (block_tables). New keys and
values are first written into the paged cache (slot_mapping); attention then reads every key from
the cache, so a cached prefix, an earlier prefill chunk and the new tokens are all treated alike. An fp8 cache
(EngineArgs.kv_cache_dtype) stores values divided by the layer's k_scale / v_scale and is read back times them
(kernels/kv_quant.py).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.chunk_attention import chunk_attention_ref
from nanoserve.kernels.kv_quant import dequantize_kv, quantize_kv
from nanoserve.kernels.prefill.split_scratch import SplitScratch
from nanoserve.layers.step_plan import EAGER, KernelPlan


class LongContext(Protocol):
    """What attention calls for the step's sequences in long-context mode (worker/kv_ring.py's
    LongContextAttention), after the batch's attention has written their rows from their window alone."""

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               scale: float, chunk_attention: Callable, window: int | None = None,
               sinks: torch.Tensor | None = None, softcap: float | None = None, k_scale: float = 1.0,
               v_scale: float = 1.0) -> None: ...


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token, -1 = not stored
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    num_decodes: int  # the first num_decodes sequences bring exactly one token each
    seq_lens_cpu: list[int] | None = None  # for the PyTorch path, which loops over sequences
    cu_seqlens_q_cpu: list[int] | None = None
    # The prefill kernel's work list for the sequences after the decodes (kernels/prefill/attention.py),
    # built on the host once per step; without it the kernel reads the lengths back at every layer. A split
    # map (long tiles' keys cut across programs) also needs the scratch its partial results go to.
    tile_map: torch.Tensor | None = None
    block_m: int | None = None
    split_scratch: SplitScratch | None = None
    # Query heads per program that tile_map was built for (GQA packing); None: all of a kv head's.
    pack: int | None = None
    # Zeroed int32 counters (>= decodes x kv heads) that let decode attention merge its splits in the same
    # launch (kernels/decode_attention.py), where plan.fused_decode_merge; None: a second launch merges them.
    decode_counters: torch.Tensor | None = None
    # The decodes longest first (a permutation of 0..num_decodes-1), the order in which decode attention dispatches
    # their programs, where plan.decode_order; None: batch order.
    decode_order: torch.Tensor | None = None
    # The step's kernel choices (layers/step_plan.py), which the layers read; the default is the plain path.
    plan: KernelPlan = EAGER
    # Sequences in long-context mode: the fields above show them their window only, and attend() then redoes their
    # rows over every key. None: no such sequence (always in graphs).
    long_context: LongContext | None = None
    # The sliding-window layers' slots and block tables, where they have a KV pool of their own
    # (engine/local_blocks.py; entries of blocks out of the window point at a zeroed null block). None: one pool.
    local_slot_mapping: torch.Tensor | None = None
    local_block_tables: torch.Tensor | None = None
    _local_view: "AttentionMetadata | None" = dataclasses.field(default=None, repr=False)

    def for_layer(self, local: bool) -> "AttentionMetadata":
        """The metadata a layer reads: for a sliding-window layer with a pool of its own, this step's with that
        pool's slots and tables in place of the global ones (made once a step, or once at a graph's capture)."""
        if not local or self.local_block_tables is None:
            return self
        if self._local_view is None:
            self._local_view = dataclasses.replace(self, slot_mapping=self.local_slot_mapping,
                                                   block_tables=self.local_block_tables, local_slot_mapping=None,
                                                   local_block_tables=None)
        return self._local_view


class TorchBackend:
    """Plain PyTorch: correct everywhere, used on the CPU."""

    chunk_attention = staticmethod(chunk_attention_ref)  # long-context mode's pieces (kernels/chunk_attention.py)

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize_kv(k[keep], k_cache.dtype, k_scale)
        v_cache.view(-1, *v_cache.shape[2:])[slots] = quantize_kv(v[keep], v_cache.dtype, v_scale)

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
               softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        group = q.shape[1] // k_cache.shape[2]
        cu = meta.cu_seqlens_q_cpu or meta.cu_seqlens_q.tolist()
        lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        for b, seq_len in enumerate(lens):
            start, end = cu[b], cu[b + 1]
            pages = meta.block_tables[b, :-(-seq_len // block_size)].long()
            k = dequantize_kv(k_cache[pages].flatten(0, 1)[:seq_len], q.dtype, k_scale).transpose(0, 1)  # [Hkv, S, D]
            v = dequantize_kv(v_cache[pages].flatten(0, 1)[:seq_len], q.dtype, v_scale).transpose(0, 1)
            qb = q[start:end].transpose(0, 1)  # [Hq, L, D]
            q_len = end - start
            # Query i sits at position seq_len - q_len + i and sees keys up to there (and, with a window, the
            # window - 1 keys before it only).
            mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q_len)
            if window is not None:
                mask &= ~torch.ones_like(mask).tril(seq_len - q_len - window)
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            if sinks is None and softcap is None:
                o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
            else:
                o = _explicit_softmax(qb, k, v, mask, scale, sinks, softcap)
            out[start:end] = o.transpose(0, 1)
        return out


def _explicit_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                      sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """Attention of q [H, L, D] over k/v [H, S, D] with the scores written out: soft-capped (Gemma 2: softcap *
    tanh(score / softcap), before the mask, as transformers does), and with head h's sink logit sinks[h] joining each
    softmax's denominator (gpt-oss): a column that takes weight but contributes no value. Scores and softmax are
    fp32, as the kernels and SDPA compute them: a bf16 softmax made this reference the less exact side of the GPU's
    bf16 comparison (53 of 64 first tokens agreed where the other MoE models agree on 56+)."""
    scores = (q.float() @ k.float().transpose(1, 2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1).to(v.dtype) @ v
    sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return probs.to(v.dtype) @ v


class TritonBackend:
    """The Triton kernels: decodes through flash-decoding, prefill chunks through the varlen kernel."""

    @staticmethod
    def chunk_attention(*args, **kwargs) -> None:
        from nanoserve.kernels.chunk_attention import chunk_attention

        chunk_attention(*args, **kwargs)

    @staticmethod
    def store(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        from nanoserve.kernels.kv_store import store_kvcache

        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
               softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        from nanoserve.kernels.decode_attention import decode_attention
        from nanoserve.kernels.prefill.attention import prefill_attention

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, meta.seq_lens[:nd], meta.block_tables[:nd], scale,
                             out=out[:nd], counters=meta.decode_counters, order=meta.decode_order, window=window,
                             sinks=sinks, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
        if nd < meta.seq_lens.shape[0]:
            # Decodes come first with one token each, so the prefill part starts at token nd.
            cu = meta.cu_seqlens_q if nd == 0 else meta.cu_seqlens_q[nd:] - nd
            prefill_attention(q[nd:], k_cache, v_cache, cu, meta.seq_lens[nd:],
                              meta.block_tables[nd:], meta.max_seqlen_q, scale, out=out[nd:],
                              tile_map=meta.tile_map, block_m=meta.block_m, split_scratch=meta.split_scratch,
                              pack=meta.pack, window=window, sinks=sinks, softcap=softcap, k_scale=k_scale,
                              v_scale=v_scale)
        return out


def backend_for(device: torch.device):
    return TritonBackend if device.type == "cuda" else TorchBackend


class Attention(nn.Module):
    """One layer's attention over the paged cache. sliding_window W: a query at position p sees keys at positions
    p - W + 1 .. p only (W keys with itself: transformers' convention, masking_utils' `kv_idx > q_idx - W`).
    sinks: the layer owns one learned logit per query head of this rank (gpt-oss), which joins every softmax's
    denominator but adds no value; kept in fp32, as the kernels read it, so no step casts it. Under tensor
    parallelism the model says which of the checkpoint's heads are this rank's (shard_sinks).
    scale: the scores' factor, head_dim ** -0.5 unless given (Gemma's query_pre_attn_scalar ** -0.5).
    softcap: scores s (scaled) become softcap * tanh(s / softcap) before the mask and softmax (Gemma 2's
    attn_logit_softcapping); None for none. k_scale, v_scale: an fp8 cache's scales (kernels/kv_quant.py), 1.0 unless
    the checkpoint has them (quantization/kv_scales.py); a cache in the model's dtype ignores them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 sinks: bool = False, scale: float | None = None, softcap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be at least 1, got {sliding_window}")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"attn_logit_softcapping: must be positive, got {softcap}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.sliding_window = sliding_window
        self.sinks = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self.load_sinks
            self.shard_sinks(0, num_heads)
        self.layer_index = 0  # which layer's CPU blocks long-context attention reads (set by the model runner)
        # Whether this layer's KV lives in the sliding-window pool (set by the model runner): it then reads the
        # metadata's local slots and tables (AttentionMetadata.for_layer).
        self.local = False
        # Set by the model runner once the pool is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale, self.v_scale = 1.0, 1.0
        self.backend = TorchBackend

    def store(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """This step's keys and values, k/v [T, Hkv, D], into the cache at meta.slot_mapping (-1: not stored)."""
        meta = meta.for_layer(self.local)
        self.backend.store(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def shard_sinks(self, start: int, total: int) -> None:
        """This rank's heads are start .. start + num_heads of the checkpoint's `total` heads."""
        self.sinks_start, self.sinks_total = start, total

    def load_sinks(self, param: nn.Parameter, loaded, shard: str | None = None) -> None:
        if tuple(loaded.get_shape()) != (self.sinks_total,):
            raise ValueError(f"has shape {tuple(loaded.get_shape())}, expected {(self.sinks_total,)}")
        param.data.copy_(loaded[self.sinks_start:self.sinks_start + param.shape[0]])

    def checkpoint_shapes(self, param: nn.Parameter) -> list[tuple[str | None, tuple[int, ...]]]:
        """(shard, shape of the whole checkpoint tensor) of the sinks, for random weights: every rank draws all
        heads and keeps its own, so TP=N on random weights gives TP=1's."""
        return [(None, (self.sinks_total,))]

    def sink_logits(self) -> torch.Tensor | None:
        """The sinks as the kernels read them (fp32, contiguous), or None without sinks."""
        return None if self.sinks is None else self.sinks.float().contiguous()

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D] over the cache, which already holds this step's keys and values -> [T, Hq, D]."""
        meta = meta.for_layer(self.local)
        sinks = self.sink_logits()
        out = self.backend.attend(q, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window, sinks,
                                  self.softcap, self.k_scale, self.v_scale)
        if meta.long_context is not None:
            meta.long_context.attend(self.layer_index, q, self.k_cache, self.v_cache, out, self.scale,
                                     self.backend.chunk_attention, self.sliding_window, sinks, self.softcap,
                                     self.k_scale, self.v_scale)
        return out
