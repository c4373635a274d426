"""Build a model from a checkpoint directory, loading safetensors straight into the fused layout."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.model.registry import model_class


def checkpoint_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise ValueError(f"model: shards named in {index.name} are missing: {', '.join(missing)}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir!r} (use load_format='dummy' "
                         "for random weights)")
    return files


def load_model(config: EngineConfig) -> nn.Module:
    cls = model_class(config.model.architecture)
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(config.device):
            model = cls(config.model, config.max_model_len)
    finally:
        torch.set_default_dtype(torch.float32)
    if config.args.load_format == "dummy":
        _init_dummy(model, config.args.seed)
    else:
        _load_weights(model, checkpoint_files(config.model_dir))
    return model.eval()


def _init_dummy(model: nn.Module, seed: int) -> None:
    gen = None
    for name, param in model.named_parameters():
        gen = gen or torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            # Small values keep activations finite through many layers, in bf16 too.
            param.data.uniform_(-0.02, 0.02, generator=gen)


def _load_weights(model: nn.Module, files: list[Path]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = getattr(model.lm_head, "weight", None) is model.model.embed_tokens.weight
    for path in tqdm(files, desc="loading weights", disable=len(files) < 2):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if "rotary_emb.inv_freq" in ckpt_name or (tied and ckpt_name == "lm_head.weight"):
                    continue
                name, shard = _map_name(model, ckpt_name)
                if name not in params:
                    raise ValueError(f"model: checkpoint tensor {ckpt_name!r} matches no parameter")
                param, tensor = params[name], f.get_tensor(ckpt_name)
                loader = getattr(param, "weight_loader", None)
                if shard is not None:
                    loader(param, tensor, shard)
                    loaded.add(f"{name}:{shard}")
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(f"model: {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(param.shape)}")
                    param.data.copy_(tensor)
                    loaded.add(name)
    missing = []
    for name, module in model.named_modules():
        for shard in getattr(module, "shard_offsets", {}):
            for pname, _ in module.named_parameters(recurse=False):
                if f"{name}.{pname}:{shard}" not in loaded:
                    missing.append(f"{name}.{pname} ({shard})")
    for name, param in params.items():
        if not hasattr(param, "weight_loader") and name not in loaded and not (tied and name == "lm_head.weight"):
            missing.append(name)
    if missing:
        raise ValueError(f"model: checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def _map_name(model: nn.Module, ckpt_name: str) -> tuple[str, str | None]:
    for part, (fused, shard) in model.packed_modules.items():
        if f".{part}." in ckpt_name:
            return ckpt_name.replace(f".{part}.", f".{fused}."), shard
    return ckpt_name, None
