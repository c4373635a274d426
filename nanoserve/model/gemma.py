"""Google's Gemma 2 and Gemma 3 (the text model; Gemma 3's multimodal checkpoints served text-only).

The Llama layout's attention and projections, with Gemma's differences:
- embeddings scaled by sqrt(hidden_size), the factor rounded to the model's dtype first, as transformers does;
- RMSNorm scaling by (1 + weight) (layers/norm.py's offset), and four norms a layer: before and after attention,
  before and after the MLP (the "after" ones on the branch's output, before the residual add);
- GeGLU: the tanh-approximated GELU (gelu_pytorch_tanh) gating up_proj;
- attention scaled by query_pre_attn_scalar ** -0.5 rather than head_dim ** -0.5;
- Gemma 2: attention logits soft-capped (attn_logit_softcapping, in every attention path: layers/attention.py and
  the kernels) and final logits soft-capped (final_logit_softcapping); sliding-window layers alternating with global
  ones, the first windowed;
- Gemma 3: q/k norms (1 + weight) instead of soft-capping, five windowed layers to one global (layer_types, else
  sliding_window_pattern), the windowed layers with their own rope base (rope_local_base_freq, no scaling) and the
  global ones with rope_theta and rope_scaling (linear, factor 8 on 4B and up).
"""

import logging

import torch
from torch import nn

from nanoserve.config import ModelConfig, complete_rope_scaling, rope_theta
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.activation import GeluTanhAndMul
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.embedding import LMHead, VocabEmbedding
from nanoserve.layers.linear import GateUpLinear, RowParallelLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding
from nanoserve.layers.step_plan import KernelPlan
from nanoserve.model.llama import LlamaAttention, LlamaForCausalLM

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma_layer_types(config: ModelConfig) -> list[str]:
    """Each layer's attention, as transformers' Gemma configs decide it: layer_types where config.json lists them;
    else Gemma 2's alternation (even layers windowed) or Gemma 3's pattern (every sliding_window_pattern-th layer
    global, the others windowed)."""
    raw, n = config.raw, config.num_hidden_layers
    if raw.get("layer_types"):
        if len(raw["layer_types"]) != n:
            raise ValueError(f"layer_types: {len(raw['layer_types'])} entries for {n} layers")
        return list(raw["layer_types"])
    period = 2 if raw.get("model_type") == "gemma2" else raw.get("sliding_window_pattern", 6)
    return [SLIDING if (i + 1) % period else FULL for i in range(n)]


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        act = config.raw.get("hidden_activation") or config.raw.get("hidden_act")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation: only 'gelu_pytorch_tanh' is supported for Gemma, got {act!r}")
        self.gate_up_proj = GateUpLinear(config.hidden_size, config.intermediate_size, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp)
        self.act = GeluTanhAndMul()

    def forward(self, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, plan)), plan)


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        qk_norm: bool,
        tp: TensorParallelGroup,
        attention_options: dict,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, qk_norm, tp, norm_offset=1.0, **attention_options)
        self.mlp = GemmaMLP(config, tp)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(size, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(size, eps, offset=1.0)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: the residual add runs inside the next norm (the fused add + norm), here
        input_layernorm and pre_feedforward_layernorm; the post-norms see their branch's output alone."""
        if meta.plan.fused_prologues:
            return self.fused_forward(positions, x, residual, meta)
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x, meta.plan)), residual

    def fused_forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with the add + norm before qkv_proj and gate_up_proj run by those GEMMs and GELU-and-mul by
        down_proj, where the plan fuses them (one-row graphs; LlamaDecoderLayer.fused_forward has the why). The
        post-norms stay kernels of their own: nothing after them would take them as a prologue."""
        plan, attn = meta.plan, self.self_attn
        qkv, residual = attn.qkv_proj.forward_norm(x, residual, self.input_layernorm, plan)
        x = self.post_attention_layernorm(attn.attend(positions, qkv, meta))
        gate_up, residual = self.mlp.gate_up_proj.forward_norm(x, residual, self.pre_feedforward_layernorm, plan)
        x = self.mlp.down_proj.forward_silu_mul(gate_up, self.mlp.act, plan)
        return self.post_feedforward_layernorm(x), residual


class GemmaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotaries: dict[str, RotaryEmbedding],
        layer_types: list[str],
        qk_norm: bool,
        tp: TensorParallelGroup,
        attention_options,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        # sqrt(hidden_size) rounded to the model's dtype (the default dtype while the model is built), as transformers
        # multiplies by it: sqrt(3584) is 59.75 in bf16. A Python float, so that CUDA graphs capture no tensor of it.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.get_default_dtype()).item()
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, rotaries[kind], qk_norm, tp, attention_options(i))
            for i, kind in enumerate(layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; Gemma3ForCausalLM below adds its differences. The checkpoint's names are Llama's."""

    qk_norm = False

    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        nn.Module.__init__(self)
        tp = tp or TensorParallelGroup()
        raw = config.raw
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: Gemma's bidirectional (embedding) variant is not supported")
        self.layer_types = gemma_layer_types(config)
        self.final_softcap = raw.get("final_logit_softcapping")
        rotaries = self.rotaries(config, max_model_len)
        self.model = GemmaModel(
            config, rotaries, self.layer_types, self.qk_norm, tp, lambda layer: self.attention_options(config, layer)
        )
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tp)
        # Gemma ties the head to the embedding unless config.json says otherwise (its checkpoints hold no lm_head).
        if raw.get("tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight

    def rotaries(self, config: ModelConfig, max_model_len: int) -> dict[str, RotaryEmbedding]:
        """The rotary embedding of each kind of layer: one for all in Gemma 2."""
        rotary = RotaryEmbedding(config.head_dim, max_model_len, config.rope_theta, config.rope_scaling)
        return {SLIDING: rotary, FULL: rotary}

    def attention_options(self, config: ModelConfig, layer: int) -> dict:
        raw = config.raw
        window = config.sliding_window if self.layer_types[layer] == SLIDING else None
        return {
            "sliding_window": window,
            "scale": raw.get("query_pre_attn_scalar", config.head_dim) ** -0.5,
            "softcap": raw.get("attn_logit_softcapping"),
        }

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            # In the logits' dtype, as transformers caps them.
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    def rotaries(self, config: ModelConfig, max_model_len: int) -> dict[str, RotaryEmbedding]:
        """Global layers: rope_theta and rope_scaling (ModelConfig's, the full-attention parameters); windowed ones:
        rope_local_base_freq, unscaled. transformers >= 5 writes both under rope_parameters, per layer type."""
        raw = config.raw
        local = (raw.get("rope_parameters") or {}).get(SLIDING)
        base = rope_theta(local, {}, raw.get("rope_local_base_freq", 10000.0))
        full = RotaryEmbedding(config.head_dim, max_model_len, config.rope_theta, config.rope_scaling)
        return {
            FULL: full,
            SLIDING: RotaryEmbedding(config.head_dim, max_model_len, base, complete_rope_scaling(local, raw)),
        }

    def attention_options(self, config: ModelConfig, layer: int) -> dict:
        if config.raw.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping: Gemma 3 has none; a config with it is not a Gemma 3 checkpoint")
        return super().attention_options(config, layer)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 multimodal checkpoint (4B, 12B, 27B), served text-only: its vision tower and
    projector are not loaded. config.py's language_model_config has put text_config's fields at the top."""

    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__(config, max_model_len, tp)
        logger.warning(
            "%s: serving the language model only (text in, text out); the vision tower and projector "
            "weights are skipped, not loaded",
            config.architecture,
        )

    def map_checkpoint_name(self, ckpt_name: str) -> tuple[str, str | None] | None:
        """transformers < 5 writes language_model.model.* and language_model.lm_head.*, 5 model.language_model.*
        and lm_head.*; vision_tower.* and multi_modal_projector.* (under model. in 5) are skipped (None)."""
        for prefix, ours in (
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
        ):
            if ckpt_name.startswith(prefix):
                return super().map_checkpoint_name(ours + ckpt_name[len(prefix) :])
        if ckpt_name.startswith("lm_head."):
            return super().map_checkpoint_name(ckpt_name)
        return None
