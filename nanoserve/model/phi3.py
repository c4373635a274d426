"""Phi-3 (mini, small-context and 128k, medium), Phi-3.5-mini, Phi-4-mini and Phi-4 (14B): the Llama layout with
q/k/v and gate/up packed in the checkpoint, partial rotary and LongRoPE.

- Checkpoints hold `qkv_proj` (the q, k and v rows stacked) and `gate_up_proj` (gate rows, then up rows). They load
  as the packed shards "q+k+v" and "gate+up" of our fused layers (layers/linear.py's FusedLinear.load_shard), so
  under tensor parallelism each rank reads its own heads' rows of q, k and v, and its share of gate and of up, as
  for checkpoints that keep them apart.
- Partial rotary: only the first head_dim * partial_rotary_factor dimensions of each head rotate (Phi-4-mini: 96 of
  128); the factor is read where transformers reads it, rope_parameters first, then the top level of config.json.
- LongRoPE: rope_scaling type "longrope" (or "su" and "yarn", which transformers' Phi3Config reads as longrope:
  config.py), with short_factor / long_factor of rotary_dim / 2 entries and the top-level
  original_max_position_embeddings; layers/rotary.py picks the factors once from max_model_len.
- sliding_window in every layer when config.json sets one, as transformers' Phi-3 applies it: a query sees W keys,
  itself included. Phi-3-mini-4k's 2047 therefore means 2047 keys (Microsoft's original code, through flash-attn's
  window_size=(2047, 2047), saw 2048; transformers 5, which the tests check tokens against, sees 2047). The 128k
  models' windows (262144) are longer than any context they run and are dropped (None), which changes no result and
  skips the window's masking.
- tie_word_embeddings (Phi-4-mini): as every model of llama.py.
"""

from nanoserve.config import ModelConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.model.llama import LlamaForCausalLM

# checkpoint module -> its packed shards, in the order the checkpoint stacks them
_PACKED = {"qkv_proj": "q+k+v", "gate_up_proj": "gate+up"}


def rotary_dim(config: ModelConfig) -> int:
    """The leading dimensions of a head that rotate: head_dim * partial_rotary_factor, as transformers rounds it."""
    raw = config.raw
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return int(config.head_dim * factor)


class Phi3ForCausalLM(LlamaForCausalLM):
    # Checkpoint modules are our fused layers themselves (the quantization ignore list names them so).
    packed_modules: dict[str, tuple[str, str]] = {}

    def __init__(self, config: ModelConfig, max_model_len: int, tp: TensorParallelGroup | None = None) -> None:
        self.max_model_len = max_model_len
        super().__init__(config, max_model_len, tp)

    def rotary_dim(self, config: ModelConfig) -> int | None:
        return rotary_dim(config)

    def attention_options(self, config: ModelConfig, layer: int) -> dict:
        window = config.sliding_window
        # A window at least max_model_len long hides no key from any query.
        return {"sliding_window": window if window is not None and window < self.max_model_len else None}

    def map_checkpoint_name(self, ckpt_name: str) -> tuple[str, str | None]:
        for module, shards in _PACKED.items():
            if f".{module}." in ckpt_name:
                if not ckpt_name.endswith(f".{module}.weight"):
                    # Scales of a quantized checkpoint would be per packed tensor, not per shard.
                    raise ValueError(
                        f"model: {ckpt_name!r}: quantized Phi-3 checkpoints are not supported; load "
                        "the unquantized one with --quantization fp8"
                    )
                return ckpt_name, shards
        return ckpt_name, None
