"""FP8 checkpoints in the formats' own layouts, quantized here from the small random checkpoints of
tests/checkpoints.py, and the transformers reference that runs them: each quantized nn.Linear's weight replaced by
its dequantized fp32 weight and its input quantized and dequantized by a forward pre-hook, as the format defines.

Written independently of nanoserve/quantization/ (only the formats' definitions are shared), so that the engine is
checked against the formats rather than against itself.
"""

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Format:
    """weights: tensor | channel | block; activations: token (dynamic) | tensor (static) | group (dynamic, with
    block weights) | None (weight-only); block: (rows, columns); layout: "compressed-tensors" or "fp8"
    (quant_method fp8, weight_scale_inv); ignore: checkpoint modules left unquantized."""

    weights: str
    activations: str | None
    block: tuple[int, int] | None = None
    layout: str = "compressed-tensors"
    ignore: tuple[str, ...] = ("lm_head",)

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.layout == "fp8" else "weight_scale"

    def quantization_config(self) -> dict:
        if self.layout == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block), "ignored_layers": list(self.ignore)}
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": self.weights,
                   "group_size": None, "block_structure": list(self.block) if self.block else None}
        acts = None
        if self.activations is not None:
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": self.activations != "tensor",
                    "strategy": self.activations, "block_structure": None,
                    "group_size": self.block[1] if self.activations == "group" else None}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                              "output_activations": None}},
                "ignore": list(self.ignore), "kv_cache_scheme": None}


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=1e-10) / FP8_MAX


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _block_view(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    return F.pad(w, (0, -k % block[1], 0, -n % block[0])).unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))


def element_scale(scale: torch.Tensor, shape: tuple[int, int], fmt: Format) -> torch.Tensor:
    """The checkpoint scale of a weight as the scale of each of its elements."""
    if fmt.weights == "block":
        return scale.repeat_interleave(fmt.block[0], 0).repeat_interleave(fmt.block[1], 1)[:shape[0], :shape[1]]
    return scale.reshape(-1, 1).expand(shape) if scale.numel() > 1 else scale.reshape(()).expand(shape)


def quantize_weight(w: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt.weights == "tensor":
        scale = _scale(w.abs().max()).reshape(1)
    elif fmt.weights == "channel":
        scale = _scale(w.abs().amax(1, keepdim=True))
    else:
        scale = _scale(_block_view(w, fmt.block).abs().amax(dim=(1, 3)))
    return _cast(w, element_scale(scale, tuple(w.shape), fmt)), scale


def fake_quantize_input(x: torch.Tensor, fmt: Format, input_scale: torch.Tensor | None) -> torch.Tensor:
    if fmt.activations is None:
        return x
    if fmt.activations == "tensor":
        return _cast(x, input_scale).float() * input_scale
    if fmt.activations == "token":
        scale = _scale(x.abs().amax(-1, keepdim=True))
        return _cast(x, scale).float() * scale
    g = fmt.block[1]
    groups = x.unflatten(-1, (-1, g))  # the test models' widths are whole groups
    scale = _scale(groups.abs().amax(-1, keepdim=True))
    return (_cast(groups, scale).float() * scale).flatten(-2)


def _ignored(name: str, fmt: Format) -> bool:
    return any(re.match(e[3:], name) if e.startswith("re:") else name == e for e in fmt.ignore)


def _quantized_module(key: str, fmt: Format) -> str | None:
    module = key.removesuffix(".weight")
    if key.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS and not _ignored(module, fmt):
        return module
    return None


def calibrate_input_scales(src: Path, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Static input scales: max |input| / 448 of each projection over the prompts, run by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    amax: dict[str, torch.Tensor] = {}

    def record(name):
        return lambda mod, args: amax.__setitem__(name, torch.maximum(amax.get(name, torch.tensor(0.0)),
                                                                      args[0].abs().max()))
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            mod.register_forward_pre_hook(record(name))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    return {name: _scale(a).reshape(1) for name, a in amax.items()}


def write_fp8_checkpoint(src: Path, dst: Path, fmt: Format, input_scales: dict | None = None) -> Path:
    """src's checkpoint (one model.safetensors) with its projections in fmt's tensors and config."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    tensors = {}
    for key, t in load_file(src / "model.safetensors").items():
        module = _quantized_module(key, fmt)
        if module is None:
            tensors[key] = t
            continue
        tensors[key], tensors[f"{module}.{fmt.scale_name}"] = quantize_weight(t, fmt)
        if fmt.activations == "tensor":
            tensors[f"{module}.input_scale"] = input_scales[module]
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config()
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def reference_model(ckpt: Path, fmt: Format):
    """transformers' model of the unquantized config, running ckpt's quantized projections as fmt defines."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_file(ckpt / "model.safetensors")
    state = {}
    for key, t in tensors.items():
        if key.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        module = _quantized_module(key, fmt)
        if module is not None:
            t = t.float() * element_scale(tensors[f"{module}.{fmt.scale_name}"].float(), tuple(t.shape), fmt)
        state[key] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    for name, mod in model.named_modules():
        if _quantized_module(f"{name}.weight", fmt) is not None and isinstance(mod, torch.nn.Linear):
            input_scale = tensors.get(f"{name}.input_scale")
            mod.register_forward_pre_hook(lambda m, args, s=input_scale: (fake_quantize_input(args[0], fmt, s),))
    return model.eval()
