"""An fp8 KV cache's scales (EngineArgs.kv_cache_dtype fp8) as FP8 checkpoints carry them: one scalar per layer for
keys and one for values, the cache storing x / scale (kernels/kv_quant.py). Their names, as vLLM reads them:

- `<layer>.self_attn.k_scale`, `.v_scale`: llm-compressor's (compressed-tensors with a kv_cache_scheme);
- `<layer>.self_attn.k_proj.k_scale`, `.v_proj.v_scale`: NVIDIA ModelOpt's;
- `<layer>.self_attn.kv_scale`: an older single scale, used for both.

A layer without them keeps 1.0 (vLLM's default). With a cache in the model's dtype the tensors are skipped."""

import torch
from torch import nn

# Checkpoint name suffix -> which of the layer's scales it sets.
_SUFFIXES = {
    ".self_attn.k_scale": ("k_scale",),
    ".self_attn.v_scale": ("v_scale",),
    ".self_attn.k_proj.k_scale": ("k_scale",),
    ".self_attn.v_proj.v_scale": ("v_scale",),
    ".self_attn.kv_scale": ("k_scale", "v_scale"),
}


def kv_scale_target(ckpt_name: str) -> tuple[str, tuple[str, ...]] | None:
    """For a KV scale tensor: its layer's attention prefix (`....self_attn`) and the scales it sets; else None."""
    for suffix, names in _SUFFIXES.items():
        if ckpt_name.endswith(suffix):
            return ckpt_name[: -len(suffix)] + ".self_attn", names
    return None


def set_kv_scale(model: nn.Module, ckpt_name: str, tensor: torch.Tensor) -> None:
    """Give the attention layer that ckpt_name (a kv_scale_target) belongs to the scale in tensor."""
    prefix, names = kv_scale_target(ckpt_name)
    # A prefix the model renames (a multimodal checkpoint's language model) is found as one of its weights would be.
    mapped = model.map_checkpoint_name(f"{prefix}.o_proj.weight")
    if mapped is None:
        return
    attn = dict(model.named_modules()).get(mapped[0].removesuffix(".o_proj.weight") + ".attn")
    if attn is None:
        raise ValueError(f"model: checkpoint tensor {ckpt_name!r} matches no attention layer")
    if tensor.numel() != 1:
        raise ValueError(
            f"model: {ckpt_name!r} has shape {tuple(tensor.shape)}: only one KV cache scale per layer "
            "(per-tensor) is supported, not per-head ones"
        )
    value = float(tensor.float().item())
    if not 0 < value < float("inf"):
        raise ValueError(f"model: {ckpt_name!r} must be a positive finite scale, got {value}")
    for name in names:
        setattr(attn, name, value)
