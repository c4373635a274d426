"""The Llama family: Llama 2/3, Mistral and Qwen2 (q/k/v bias); Qwen3 adds q/k norms (qwen3.py)."""

from collections.abc import Callable

import torch
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.embedding import LMHead, VocabEmbedding
from nanoserve.layers.linear import GateUpLinear, QKVLinear, RowParallelLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding
from nanoserve.layers.step_plan import KernelPlan


def layer_sliding_window(config: ModelConfig, layer: int) -> int | None:
    """The sliding window of `layer` (None: it sees the whole context), as transformers decides it: by layer_types
    where config.json lists them; Qwen2's window only in layers >= max_window_layers (and only with
    use_sliding_window); Mistral's in every layer."""
    window = config.sliding_window
    if window is None:
        return None
    raw = config.raw
    layer_types = raw.get("layer_types")
    if layer_types:
        return window if layer_types[layer] == "sliding_attention" else None
    if raw.get("model_type") in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        # transformers' Qwen2 defaults use_sliding_window to false (config.py's sliding_window assumes true).
        if not raw.get("use_sliding_window", False):
            return None
        return window if layer >= raw.get("max_window_layers", 28) else None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qk_norm: bool, tp: TensorParallelGroup,
                 norm_offset: float = 0.0, **attention_options) -> None:
        """attention_options: the layer's own Attention arguments (sliding_window, sinks, scale, softcap), if any.
        norm_offset: the q/k norms' (RMSNorm's offset; Gemma 3's 1.0)."""
        super().__init__()
        self.qkv_proj = QKVLinear(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                                  config.head_dim, config.attention_bias, tp)
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = self.qkv_proj.shards["k"][1] // config.head_dim
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # Llama puts the bias on o_proj too when attention_bias is set; Qwen2 biases only q/k/v.
        o_bias = config.attention_bias and config.raw.get("model_type") not in ("qwen2", "qwen2_moe")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.rotary = rotary
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, norm_offset) if qk_norm else None
        self.norm_offset = norm_offset
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, **attention_options)
        if self.attn.sinks is not None:
            self.attn.shard_sinks(tp.shard(config.num_attention_heads)[0], config.num_attention_heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x, meta.plan), meta)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention and o_proj from qkv_proj's output [T, (num_heads + 2 num_kv_heads) * head_dim]."""
        meta = meta.for_layer(self.attn.local)
        if meta.plan.fused_rope_decode:
            # Every sequence brings one token: the work of `store` and attention in one launch, not two.
            from nanoserve.kernels.decode_rope_attention import decode_rope_attention

            out = decode_rope_attention(*self._rope_args(positions, qkv, meta), meta.seq_lens, meta.block_tables,
                                        self.attn.scale, counters=meta.decode_counters,
                                        window=self.attn.sliding_window, sinks=self.attn.sink_logits(),
                                        softcap=self.attn.softcap, norm_offset=self.norm_offset,
                                        k_scale=self.attn.k_scale, v_scale=self.attn.v_scale)
        else:
            out = self.attn.attend(self.store(positions, qkv, meta), meta)
        return self.o_proj(out.flatten(1), meta.plan)

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

            qkv_rope_store(*self._rope_args(positions, qkv, meta), norm_offset=self.norm_offset,
                           k_scale=self.attn.k_scale, v_scale=self.attn.v_scale)
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
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup, intermediate_size: int | None = None,
                 reduce_results: bool = True) -> None:
        """intermediate_size: config's unless given (an MoE block's shared expert); reduce_results=False leaves the
        all-reduce of down_proj's partial output to the caller."""
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {config.hidden_act!r}")
        if config.raw.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = GateUpLinear(config.hidden_size, intermediate_size, tp)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, False, tp, reduce_results)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, plan)), plan)

    def forward_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                     plan: KernelPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and the next residual, the norm run by gate_up_proj and SiLU-and-mul by
        down_proj where the plan fuses them (LlamaDecoderLayer.fused_forward)."""
        gate_up, residual = self.gate_up_proj.forward_norm(x, residual, norm, plan)
        return self.down_proj.forward_silu_mul(gate_up, self.act, plan), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, qk_norm: bool, tp: TensorParallelGroup,
                 mlp: nn.Module, attention_options: dict) -> None:
        """mlp: LlamaMLP, or an MoE block (layers/moe.py) with the same forward and forward_norm."""
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qk_norm, tp, **attention_options)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """norm -> attention -> norm -> MLP, each norm with the residual add before it (none in the first layer);
        returns the layer's output and the residual. Where the step's plan fuses prologues (a one-row CUDA graph),
        the same computation runs as fused_forward.

        (The layer was also run in two pieces around attention, per half of a batch, by a two-batch overlap probe at
        275aa23; on an H100 it lost, 7.86 against 7.40 s in the throughput recipe, so it is not in the engine.)
        """
        if meta.plan.fused_prologues:
            return self.fused_forward(positions, x, residual, meta)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, meta.plan), residual

    def fused_forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with each norm run by the projection after it, and SiLU-and-mul by down_proj: one kernel each
        where the plan's rules take that weight (Linear.forward_norm, forward_silu_mul; layers/step_plan.py), else
        the op, then the GEMM. At batch 1 a launch costs 2-3 us while a whole Qwen3-0.6B layer streams its weights
        in about 7 us."""
        plan, attn = meta.plan, self.self_attn
        qkv, residual = attn.qkv_proj.forward_norm(x, residual, self.input_layernorm, plan)
        x = attn.attend(positions, qkv, meta)
        return self.mlp.forward_norm(x, residual, self.post_attention_layernorm, plan)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, qk_norm: bool, tp: TensorParallelGroup,
                 make_mlp: Callable[[int], nn.Module], attention_options: Callable[[int], dict],
                 rotary_dim: int | None = None) -> None:
        """rotary_dim: the leading dimensions of each head that rotary turns (all of them unless given)."""
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, max_model_len, config.rope_theta, config.rope_scaling, rotary_dim)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary, qk_norm, tp, make_mlp(i), attention_options(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3 (worker/eagle3.py): the layers whose input hidden states go to aux_hidden, in its column blocks'
        # order; empty when no head reads them.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def capture_aux_hidden_states(self, layers: tuple[int, ...], max_num_tokens: int) -> None:
        """From now on every forward pass writes the hidden state entering each of `layers` (the residual stream:
        the embedding for layer 0) into aux_hidden[:num_tokens], the layers' blocks side by side. A buffer of its
        own, so that CUDA graphs captured after this call write it too."""
        hidden = self.norm.weight.shape[0]
        self.aux_layers = tuple(layers)
        self.aux_hidden = torch.zeros(max_num_tokens, hidden * len(layers), dtype=self.norm.weight.dtype,
                                      device=self.norm.weight.device)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        aux = self.aux_layers
        for i, layer in enumerate(self.layers):
            if aux and i in aux:
                state = x if residual is None else x + residual
                for j in (j for j, listed in enumerate(aux) if listed == i):  # a small target may list one twice
                    self.aux_hidden[:x.shape[0], j * x.shape[1]:(j + 1) * x.shape[1]].copy_(state)
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

    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        self.model = LlamaModel(config, max_model_len, self.qk_norm, tp,
                                lambda layer: self.make_mlp(config, layer, tp),
                                lambda layer: self.attention_options(config, layer), self.rotary_dim(config))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config: ModelConfig, layer: int, tp: TensorParallelGroup) -> nn.Module:
        return LlamaMLP(config, tp)

    def rotary_dim(self, config: ModelConfig) -> int | None:
        """The leading dimensions of each head that rotary turns; None: all (transformers' Llama family ignores
        partial_rotary_factor)."""
        return None

    def attention_options(self, config: ModelConfig, layer: int) -> dict:
        """Layer `layer`'s own Attention arguments (layers/attention.py): its sliding window."""
        return {"sliding_window": layer_sliding_window(config, layer)}

    def map_checkpoint_name(self, ckpt_name: str) -> tuple[str, str | None] | None:
        """The parameter a checkpoint tensor loads into, and its shard in a fused parameter (None: all of it); None
        for a tensor the model skips (a multimodal checkpoint's vision tower, model/gemma.py)."""
        for part, (fused, shard) in self.packed_modules.items():
            if f".{part}." in ckpt_name:
                return ckpt_name.replace(f".{part}.", f".{fused}."), shard
        return ckpt_name, None

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
