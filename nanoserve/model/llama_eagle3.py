"""An EAGLE-3 draft head (config.json `architectures: ["LlamaForCausalLMEagle3"]`), as published: one Llama decoder
layer over the target's hidden states, drafting tokens from a reduced vocabulary (speculative_config's eagle3
method; worker/eagle3.py runs it).

Checkpoint tensors: `fc.weight` [hidden, 3 * hidden] projects three of the target's hidden states (at the input of
its layers `aux_hidden_state_layers`) to one; `midlayer.*` is the decoder layer, whose q/k/v projections take
2 * hidden: the token's embedding, normed by `midlayer.input_layernorm`, beside the hidden state, normed by
`midlayer.hidden_norm`; the hidden state (not the embedding) is the residual. `norm.weight` and `lm_head.weight`
[draft_vocab_size, hidden] make the logits of the draft vocabulary, whose id i is target id i + d2t[i]. The
embedding is the target's (`set_embedding`): EAGLE-3 trains with the target's embedding frozen, so a checkpoint's
own `embed_tokens.weight`, where it has one, is a copy and is not read (a head trained with an embedding of its own
would draft poorly, never wrongly). `t2d` (the inverse map, as a mask) is not needed.

The head's forward reads its hidden-state input from `hidden_in` (rows in the batch's token order), a buffer the
proposer fills before each pass, so that its decode steps can run as CUDA graphs like any model's; it returns the
layer's output before the final norm, which the next draft step takes as its hidden state in place of fc's (the
EAGLE-3 paper's steps 2..k; what the published inference code feeds back).
"""

import torch
from torch import nn

from nanoserve.config import ModelConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.embedding import LMHead, VocabEmbedding
from nanoserve.layers.linear import QKVLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding
from nanoserve.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


def aux_hidden_state_layers(head: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head reads: config.json's
    `eagle_aux_hidden_state_layer_ids` (top level or under `eagle_config`, as vLLM reads it: id j is the hidden state
    entering layer j), else vLLM's and SGLang's default (2, L // 2, L - 3) for an L-layer target, which is also
    where the EAGLE-3 reference code takes them."""
    layers = head.get("eagle_aux_hidden_state_layer_ids") or (head.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = tuple(layers or (2, num_target_layers // 2, num_target_layers - 3))
    if len(layers) != 3 or any(not isinstance(i, int) or not 0 <= i < num_target_layers for i in layers):
        raise ValueError(
            f"speculative_config.model: the head's eagle_aux_hidden_state_layer_ids must be three layers of the "
            f"target's {num_target_layers}, got {list(layers)}"
        )
    # fc reads them in layer order, whatever order a config lists them in (as vLLM gathers them).
    return tuple(sorted(layers))


class Eagle3Layer(nn.Module):
    """midlayer: a Llama decoder layer whose attention reads [norm(embedding), norm(hidden)]."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, False, tp)
        self.self_attn.qkv_proj = QKVLinear(
            2 * config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.attention_bias,
            tp,
        )
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Some heads (vLLM speculators' option) take the normed hidden state as the residual.
        self.norm_before_residual = bool(config.raw.get("norm_before_residual", False))

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = self.self_attn(positions, torch.cat([self.input_layernorm(embeds), normed], dim=-1), meta)
        # (On the GPU the norm adds into its residual in place: hidden_in, which the proposer refills every pass.)
        x, residual = self.post_attention_layernorm(x, normed if self.norm_before_residual else hidden)
        return self.mlp(x, meta.plan) + residual


class Eagle3LlamaForCausalLM(nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules

    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        hidden = config.hidden_size
        self.draft_vocab_size = config.raw.get("draft_vocab_size") or config.vocab_size
        self.target_vocab_size = config.vocab_size
        rotary = RotaryEmbedding(config.head_dim, max_model_len, config.rope_theta, config.rope_scaling)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config, rotary, tp)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = LMHead(self.draft_vocab_size, hidden, tp)
        self.d2t = nn.Parameter(torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False)
        self.d2t.weight_loader = _load_d2t
        self.d2t.dummy_fill = lambda param: param.data.zero_()  # random weights: draft id i is target id i
        self.embed_tokens: VocabEmbedding | None = None  # the target's (set_embedding), not a parameter of ours
        self.hidden_in: torch.Tensor | None = None
        self._target_ids: torch.Tensor | None = None

    def set_embedding(self, embed_tokens: VocabEmbedding, max_num_tokens: int) -> None:
        """Share the target's embedding, and size hidden_in for the largest pass (before any CUDA graph capture)."""
        self.__dict__["embed_tokens"] = embed_tokens  # kept out of this module's parameters: the target owns it
        self.hidden_in = torch.zeros(
            max_num_tokens, self.fc.out_features, dtype=self.fc.weight.dtype, device=self.fc.weight.device
        )

    def map_checkpoint_name(self, ckpt_name: str) -> tuple[str, str | None] | None:
        if ckpt_name in ("t2d", "embed_tokens.weight"):
            return None
        for part, (fused, shard) in self.packed_modules.items():
            if f".{part}." in ckpt_name:
                return ckpt_name.replace(f".{part}.", f".{fused}."), shard
        return ckpt_name, None

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the target's three hidden states [T, 3 * hidden] -> [T, hidden]."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.hidden_in[: input_ids.shape[0]]
        return self.midlayer(positions, self.embed_tokens(input_ids), hidden, meta)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [T, draft_vocab_size]: draft id i is target id target_ids()[i]."""
        return self.lm_head(self.norm(hidden))

    def target_ids(self) -> torch.Tensor:
        """The target id of each draft id (made once: d2t is a loaded constant)."""
        if self._target_ids is None:
            self._target_ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        return self._target_ids

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary: the draft vocabulary's at their target ids, -inf elsewhere (so the
        sampler's processing and a sampled draft's q are the target's, over its ids)."""
        draft = self.draft_logits(hidden)
        logits = draft.new_full((hidden.shape[0], self.target_vocab_size), float("-inf"))
        return logits.index_copy_(1, self.target_ids(), draft)


def _load_d2t(param: nn.Parameter, loaded, shard: str | None = None) -> None:
    if loaded.get_shape() != list(param.shape):
        raise ValueError(f"has shape {loaded.get_shape()}, expected {list(param.shape)}")
    param.data.copy_(loaded[:])
