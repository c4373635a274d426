"""The Llama family: Llama 2/3, Mistral and Qwen2 (q/k/v bias); Qwen3 adds q/k norms (qwen3.py)."""

import os

import torch
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention, AttentionMetadata, TritonBackend
from nanoserve.layers.embedding import LMHead
from nanoserve.layers.linear import GateUpLinear, Linear, QKVLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding
from nanoserve.worker.cuda_graphs import FUSED_DECODE_MERGE_MAX_BATCH

# Whether steps that are all decodes do q/k norm, rotary and the KV store inside decode attention's launch
# (kernels/decode_rope_attention.py) instead of a launch of their own (qkv_rope_store). NANOSERVE_FUSED_ROPE_DECODE
# "1": always, "0": never, unset or "auto": for models without q/k norms at up to FUSED_ROPE_DECODE_MAX_BATCH
# sequences, and for models with them at one. Measured on an H100 (bench latency, A/B): Llama-3.1-8B batch-1 decode
# 6.11 -> 6.01 ms/token and Qwen2.5-0.5B 0.88 -> 0.83 (f763de1); the throughput run (Qwen3-0.6B, batch 256) fell
# from 76 to 73 % of bound (e01b115; on an H200 77.4 -> 72.8 % at 72f5345, with the plain kernel's longest-first
# order). Qwen3-0.6B at batch 1 went 1.04 -> 1.17 until its qkv GEMV started attention's programs late
# (late_dependents in kernels/gemv.py): against the unfused pair, H200 0.922 -> 0.901, H100 1.024 -> 0.989 (medians
# of interleaved runs on one machine each). Read once, at import.
FUSED_ROPE_DECODE = os.environ.get("NANOSERVE_FUSED_ROPE_DECODE", "auto")
if FUSED_ROPE_DECODE not in ("auto", "0", "1"):
    raise ValueError(f"NANOSERVE_FUSED_ROPE_DECODE must be auto, 0 or 1, got {FUSED_ROPE_DECODE!r}")
# Up to the batch size whose decode graphs merge attention's splits in the split kernel, where the fused launch is
# one kernel, not two; at batch 4 it measured 29.0 -> 27.8 us a Llama-3.1-8B layer (128 keys).
FUSED_ROPE_DECODE_MAX_BATCH = FUSED_DECODE_MERGE_MAX_BATCH


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                                  config.attention_bias)
        # Llama puts the bias on o_proj too when attention_bias is set; Qwen2 biases only q/k/v.
        o_bias = config.attention_bias and config.raw.get("model_type") != "qwen2"
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.rotary = rotary
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention from qkv_proj's output (which the decoder layer computes, fused with its input norm), before
        o_proj: [T, num_heads, head_dim]."""
        if self.fuses_rope_into_attention(qkv, meta):
            # Every sequence brings one token: the work of `store` and attention in one launch, not two.
            from nanoserve.kernels.decode_rope_attention import decode_rope_attention

            return decode_rope_attention(*self._rope_args(positions, qkv, meta), meta.seq_lens, meta.block_tables,
                                         self.attn.scale, counters=meta.decode_counters)
        return self.attn.attend(self.store(positions, qkv, meta), meta)

    def fuses_rope_into_attention(self, qkv: torch.Tensor, meta: AttentionMetadata) -> bool:
        """FUSED_ROPE_DECODE's choice for this step (only with the Triton backend: a reference run may put the
        PyTorch one on a GPU); qkv may be any tensor with the step's rows (the layer asks before projecting)."""
        if not (qkv.is_cuda and meta.num_decodes == qkv.shape[0] and self.attn.backend is TritonBackend):
            return False
        if FUSED_ROPE_DECODE == "auto":
            return qkv.shape[0] <= (FUSED_ROPE_DECODE_MAX_BATCH if self.q_norm is None else 1)
        return FUSED_ROPE_DECODE == "1"

    def _rope_args(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> tuple:
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        return (qkv, self.num_heads, self.num_kv_heads, positions, self.rotary.cos_half, self.rotary.sin_half,
                *norms, self.q_norm.eps if self.q_norm is not None else 0.0, self.attn.k_cache, self.attn.v_cache,
                meta.slot_mapping)

    def store(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q/k norms and rotary, k and v written into the KV cache; returns the queries [T, num_heads, head_dim]."""
        if qkv.is_cuda:
            # One launch for q/k norm, rotary and the KV store (four separately): decode is launch-bound.
            from nanoserve.kernels.qkv_rope_store import qkv_rope_store

            qkv_rope_store(*self._rope_args(positions, qkv, meta))
            return qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        self.attn.store(k, v, meta)
        return q


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {config.hidden_act!r}")
        if config.raw.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up) from gate_up_proj's output (computed by the decoder layer, fused with its
        input norm); SiLU-and-mul runs inside down_proj's GEMM where that can take it."""
        return self.down_proj.forward_silu_mul(gate_up, self.act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta: AttentionMetadata):
        qkv, residual = self.project_qkv(x, residual, meta)
        return self.after_attention(self.self_attn(positions, qkv, meta), residual)

    def project_qkv(self, x: torch.Tensor, residual: torch.Tensor | None,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv_proj(input_layernorm(x + residual)) and the next residual."""
        # Each norm (with the residual add before it; none in the first layer) is applied by the projection that
        # consumes it: in a batch-1 decode graph the two run as one kernel (Linear.forward_norm), since there
        # each launch costs 2-3 us while a whole Qwen3-0.6B layer streams its weights in about 7 us. Elsewhere:
        # the norm module, then the projection. Before the fused rope decode of a model with q/k norms, whose
        # programs would otherwise wait beside the GEMV's from its start, that one kernel lets them start once its
        # weight is loaded (only there: the CUDA-core GEMV of a batch-1 graph, under PDL; measured for Qwen3-0.6B,
        # see kernels/gemv.py, skinny_norm_linear).
        attn = self.self_attn
        late = attn.q_norm is not None and attn.fuses_rope_into_attention(x, meta)
        return attn.qkv_proj.forward_norm(x, residual, self.input_layernorm, late_dependents=late)

    # The layer in the two pieces around attention (a two-batch overlap probe at 275aa23 ran them per half of a
    # batch; on an H100 it lost, 7.86 against 7.40 s in the throughput recipe, so it is not in the engine):
    # before_attention, then self_attn.attn.attend, then after_attention is the same computation as forward.
    def before_attention(self, positions, x, residual, meta: AttentionMetadata):
        """The queries [T, num_heads, head_dim] (this step's K/V now in the cache) and the residual."""
        qkv, residual = self.self_attn.qkv_proj.forward_norm(x, residual, self.input_layernorm)
        return self.self_attn.store(positions, qkv, meta), residual

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """The layer's output and the residual, from attention's output [T, num_heads, head_dim]."""
        x = self.self_attn.o_proj(attn_out.flatten(1))
        gate_up, residual = self.mlp.gate_up_proj.forward_norm(x, residual, self.post_attention_layernorm)
        return self.mlp(gate_up), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, qk_norm: bool) -> None:
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, max_model_len, config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # checkpoint name part -> (our parameter name part, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig, max_model_len: int) -> None:
        super().__init__()
        self.model = LlamaModel(config, max_model_len, self.qk_norm)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
