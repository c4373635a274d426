"""Rotary position embeddings (rotate-half layout, as in Hugging Face) and the rope_scaling types checkpoints use.

Each type's inverse frequencies and attention factor follow transformers' modeling_rope_utils.py (its
ROPE_INIT_FUNCTIONS), operation for operation, so the tables equal transformers' bit for bit. The attention factor
(yarn's mscale, longrope's) multiplies the cos and sin tables, as transformers does; the GPU kernels read only
cos_half/sin_half, so every path (prefill, decode, the fused kernels) gets it without knowing about it.

Two types depend, in transformers, on the length of the sequence being run, which a paged cache cannot follow: keys
are rotated once when stored, and a table that changed with the length would leave cached keys rotated by another one.
Both are decided once, from max_model_len (the `max_position` this layer is built for), as vLLM does:
- longrope: transformers uses short_factor while the sequence is at most original_max_position_embeddings long and
  long_factor for every position once it is longer. Here long_factor is used for all positions when max_model_len
  exceeds original_max_position_embeddings, short_factor otherwise (vLLM's Phi3LongRoPEScaledRotaryEmbedding picks
  by max_model_len for this reason). So with --max-model-len at most the original length, or for sequences longer
  than it, the rotation is transformers'; a short sequence on an engine allowing longer ones is rotated with
  long_factor where transformers would use short_factor.
- dynamic (dynamic NTK): transformers keeps the base until the sequence passes max_position_embeddings, then
  recomputes it for the current length. Here the base is computed once for max(max_model_len,
  max_position_embeddings), with transformers' formula (vLLM's DynamicNTKScalingRotaryEmbedding computes it once
  for the served length since vllm-project/vllm#41277). Up to max_position_embeddings, the base is unchanged, exactly
  as in transformers; max_model_len never exceeds max_position_embeddings today, so every sequence matches.

Partial rotary (`partial_rotary_factor`, Phi-3/Phi-4-mini): only the first rotary_dim dimensions of each head rotate,
in rotate-half layout among themselves, and the rest pass through, as transformers' Phi-3 does. Every type's
frequencies are then those of a rotary_dim-wide head (longrope's factor lists have rotary_dim / 2 entries), and the
tables are rotary_dim wide: the kernels take the rotary dimension from their width.

`scaling` is config.py's ModelConfig.rope_scaling: the checkpoint's fields plus rope_type,
original_max_position_embeddings (for llama3, yarn and longrope) and the model's max_position_embeddings, which
yarn's and longrope's default factor and dynamic's base are computed from.
"""

import math

import torch
from torch import nn

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_frequencies(dim: int, base: float, scaling: dict | None, max_model_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] of a `dim`-wide rotation and the attention factor multiplying cos and sin."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"rope_scaling: type {kind!r} is not supported ({', '.join(SUPPORTED)} are)")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "default":
        return 1.0 / base**exponents, 1.0
    if kind == "linear":
        return 1.0 / base**exponents / _field(scaling, "factor"), 1.0
    if kind == "llama3":
        return _llama3(1.0 / base**exponents, scaling), 1.0
    if kind == "yarn":
        return _yarn(dim, base, exponents, scaling)
    if kind == "longrope":
        return _longrope(dim, base, exponents, scaling, max_model_len)
    trained = _field(scaling, "max_position_embeddings")
    factor = _field(scaling, "factor")
    length = max(max_model_len, trained)
    base = base * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base**exponents, 1.0


def _field(scaling: dict, name: str):
    if scaling.get(name) is None:
        raise ValueError(f"rope_scaling: type {scaling.get('rope_type', scaling.get('type'))!r} needs {name!r}")
    return scaling[name]


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = _field(scaling, "factor")
    low, high = _field(scaling, "low_freq_factor"), _field(scaling, "high_freq_factor")
    old_len = _field(scaling, "original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _extension(scaling: dict) -> tuple[int, float]:
    """(original_max_position_embeddings, factor) of yarn and longrope; without a factor (DeepSeek-V3's and Phi-3's
    configs) the extension is implied by the two lengths."""
    old_len = _field(scaling, "original_max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        factor = _field(scaling, "max_position_embeddings") / old_len
    return old_len, factor


def _yarn(dim: int, base: float, exponents: torch.Tensor, scaling: dict) -> tuple[torch.Tensor, float]:
    old_len, factor = _extension(scaling)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention = _yarn_mscale(factor, 1)
    # transformers treats 0 (and None) as unset here.
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    pos_freqs = base**exponents
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    # Dimensions that turn more than beta_fast times over the original length keep their frequency, those that turn
    # fewer than beta_slow times are interpolated by `factor`, and a linear ramp blends the ones between.
    low = _yarn_dim(beta_fast, dim, base, old_len)
    high = _yarn_dim(beta_slow, dim, base, old_len)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, attention


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_dim(rotations: float, dim: int, base: float, length: int) -> float:
    """The dimension whose wavelength fits `rotations` times in `length` tokens (fractional)."""
    return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _longrope(dim: int, base: float, exponents: torch.Tensor, scaling: dict,
              max_model_len: int) -> tuple[torch.Tensor, float]:
    old_len, factor = _extension(scaling)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    # Both are checked, so that a config is refused or served whatever --max-model-len picks.
    for name in ("short_factor", "long_factor"):
        if len(_field(scaling, name)) != dim // 2:
            raise ValueError(f"rope_scaling: {name} has {len(scaling[name])} values; the rotary dimension {dim} "
                             f"needs {dim // 2}")
    factors = scaling["long_factor" if max_model_len > old_len else "short_factor"]
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents), attention


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None,
                 rotary_dim: int | None = None) -> None:
        """rotary_dim: the leading dimensions of each head that rotate (partial rotary, Phi-3's
        partial_rotary_factor); the others pass through. head_dim unless given."""
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor: the rotary dimension {rotary_dim} must be even and at most "
                             f"head_dim {head_dim}")
        self._args = (rotary_dim, max_position, base, scaling)
        for name, table in self._tables().items():
            self.register_buffer(name, table, persistent=False)

    def _tables(self) -> dict[str, torch.Tensor]:
        rotary_dim, max_position, base, scaling = self._args
        inv_freq, attention = rope_frequencies(rotary_dim, base, scaling, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # The GPU kernels read one half: the two halves of cat(freqs, freqs) are equal. Their width says the
        # rotary dimension (kernels/rotary.py, qkv_rope_store.py, decode_rope_attention.py).
        return {"cos": emb.cos() * attention, "sin": emb.sin() * attention,
                "cos_half": freqs.cos() * attention, "sin_half": freqs.sin() * attention}

    def reset_buffers(self, device: torch.device) -> None:
        """The tables computed on `device`: for a model built on the meta device (model/loader.py builds a 4-bit
        one there, so that no unquantized weight is ever allocated)."""
        with torch.device(device):
            for name, table in self._tables().items():
                self._buffers[name] = table

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (in place on the GPU, copies on the CPU)."""
        if q.is_cuda:
            from nanoserve.kernels.rotary import apply_rotary

            apply_rotary(q, k, self.cos_half, self.sin_half, positions)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))
