"""Build a model from a checkpoint directory, loading safetensors straight into the fused layout."""

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from nanoserve.config import EngineConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.linear import load_whole
from nanoserve.model.registry import model_class
from nanoserve.quantization.kv_scales import kv_scale_target, set_kv_scale
from nanoserve.quantization.model import finish_model, prepare_model, replaces_weights


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
        raise ValueError(f"model: no *.safetensors files in {model_dir!r} (use --load-format dummy, "
                         "load_format='dummy' in Python, for random weights)")
    return files


def load_model(config: EngineConfig, tp: TensorParallelGroup | None = None) -> nn.Module:
    """The model of config, this rank's share of it under tensor parallelism (tp)."""
    cls = model_class(config.model.architecture)
    # A scheme whose layers hold other tensors than the unquantized weight (4-bit, packed MXFP4, FP8 experts) builds
    # the model on the meta device, so that the unquantized weights are never allocated: a 70B model fits one GPU at
    # 4 bits, not at 16.
    on_meta = config.quantization is not None and replaces_weights(config.quantization, config.device,
                                                                   config.model.moe is not None)
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device("meta" if on_meta else config.device):
            extra = {"expert_parallel": config.args.enable_expert_parallel} if config.model.moe else {}
            model = cls(config.model, config.max_model_len, tp, **extra)
    finally:
        torch.set_default_dtype(torch.float32)
    dummy = config.args.load_format == "dummy"
    if config.quantization is not None:
        prepare_model(model, config.quantization, dummy, config.device)
    if on_meta:
        _materialize(model, config.device)
    if dummy:
        _init_dummy(model, config.args.seed)
    else:
        _load_weights(model, checkpoint_files(config.model_dir), fp8_kv=config.kv_dtype == torch.float8_e4m3fn)
    if config.quantization is not None:
        finish_model(model, config.quantization)
    return model.eval()


def load_whole_parameter(config: EngineConfig, model: nn.Module, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole of the model's parameter `name` (shape: its checkpoint tensor's), which tensor parallelism splits,
    for one rank that needs it whole (an EAGLE-3 head's embedding), in config.dtype: read from the checkpoint (on the
    CPU, for the caller to copy where it wants it), or with random weights drawn as _init_dummy draws every rank's
    share from it (on config.device, whose generator drew those)."""
    if config.args.load_format == "dummy":
        return _DummyTensor(shape, f"{name}:None", config.args.seed, config.device, config.dtype).tensor
    for path in checkpoint_files(config.model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if model.map_checkpoint_name(ckpt_name) == (name, None):
                    return f.get_tensor(ckpt_name).to(config.dtype)
    raise ValueError(f"model: the checkpoint holds no tensor for {name}")


def _materialize(model: nn.Module, device: torch.device) -> None:
    """The parameters a model built on the meta device holds there, allocated on `device` with their attributes
    (loaders) and left uninitialized: the checkpoint, or the dummy initialization, writes every one. A tied
    parameter stays one. Buffers are recomputed by their module (RotaryEmbedding.reset_buffers)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in done:
                real = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                real.__dict__.update(param.__dict__)
                done[id(param)] = real
            module._parameters[name] = done[id(param)]
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            module.reset_buffers(device)


class _DummyTensor:
    """A checkpoint tensor of random values, as a safetensors slice looks to a weight_loader (get_shape, indexing),
    drawn whole from a generator seeded by its name: every rank's share of it, under any tensor-parallel size, is a
    slice of the same values, so TP=N runs on random weights give TP=1's tokens. Drawn on the device, one tensor
    at a time."""

    def __init__(self, shape: tuple[int, ...], name: str, seed: int, device: torch.device, dtype: torch.dtype):
        gen = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
        if not dtype.is_floating_point:  # a 4-bit format's packed values: every bit random
            self.tensor = torch.randint(-1 << 31, 1 << 31, shape, device=device, dtype=torch.int64,
                                        generator=gen).to(dtype)
            return
        # Small values keep activations finite through many layers, in bf16 too. fp8 (a quantized model's
        # weights) has no uniform_: drawn in fp32 and cast.
        draw = dtype if dtype.itemsize > 1 else torch.float32
        self.tensor = torch.empty(shape, device=device, dtype=draw).uniform_(-0.02, 0.02, generator=gen).to(dtype)

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        return self.tensor[index]


def _init_dummy(model: nn.Module, seed: int) -> None:
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}"
            if name.endswith("norm.weight"):
                param.data.fill_(1.0 - getattr(module, "offset", 0.0))  # a scale of 1 (Gemma's norms add 1)
                continue
            if hasattr(param, "dummy_value"):  # a quantized layer's scales (nanoserve/quantization/)
                param.data.fill_(param.dummy_value)
                continue
            if hasattr(param, "dummy_fill"):  # a quantized layer's tensors that random values would make invalid
                param.dummy_fill(param)
                continue
            loader = getattr(param, "weight_loader", load_whole)
            for shard, shape in _checkpoint_shapes(module, param):
                loader(param, _DummyTensor(shape, f"{name}:{shard}", seed, param.device, param.dtype), shard)


def _checkpoint_shapes(module: nn.Module, param: nn.Parameter) -> list[tuple[str | None, tuple[int, ...]]]:
    """(shard, shape) of each checkpoint tensor that `param` takes a share of."""
    if hasattr(param, "checkpoint_shapes"):  # a quantized layer's tensors (nanoserve/quantization/)
        return param.checkpoint_shapes()
    if hasattr(module, "checkpoint_shapes"):  # stacked experts (layers/moe.py)
        return module.checkpoint_shapes(param)
    if hasattr(module, "shards"):  # column-parallel, fused: each shard's whole tensor
        return [(shard, (total, *param.shape[1:])) for shard, (_, _, total) in module.shards.items()]
    if hasattr(module, "vocab_size"):  # vocab-parallel
        return [(None, (module.vocab_size, param.shape[1]))]
    tp = getattr(module, "tp", None)
    if tp is not None and param.dim() == 2:  # row-parallel: its input columns
        return [(None, (param.shape[0], param.shape[1] * tp.size))]
    return [(None, tuple(param.shape))]


def _load_weights(model: nn.Module, files: list[Path], fp8_kv: bool = False) -> None:
    """fp8_kv: the KV cache is fp8, and takes the checkpoint's KV scales (quantization/kv_scales.py); else they are
    skipped."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    # (An EAGLE-3 head, model/llama_eagle3.py, has no embedding of its own.)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied = embed is not None and getattr(model.lm_head, "weight", None) is embed.weight
    for path in tqdm(files, desc="loading weights", disable=len(files) < 2):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if "rotary_emb.inv_freq" in ckpt_name or (tied and ckpt_name == "lm_head.weight"):
                    continue
                if kv_scale_target(ckpt_name) is not None:
                    if fp8_kv:
                        set_kv_scale(model, ckpt_name, f.get_tensor(ckpt_name))
                    continue
                mapped = model.map_checkpoint_name(ckpt_name)
                if mapped is None:  # a part of the checkpoint the model does not serve (a vision tower)
                    continue
                name, shard = mapped
                if name not in params:
                    raise ValueError(f"model: checkpoint tensor {ckpt_name!r} matches no parameter")
                # A slice reads from the file only the rows or columns its loader indexes: this rank's share.
                param, tensor = params[name], f.get_slice(ckpt_name)
                try:
                    getattr(param, "weight_loader", load_whole)(param, tensor, shard)
                except ValueError as e:
                    raise ValueError(f"model: {ckpt_name!r} {e}") from None
                # A packed tensor ("q+k+v") fills several shards; a quantized expert's tensor ("gate:3#qweight") is
                # one part of its shard (quantization/moe_experts.py reports a shard whose parts did not all come).
                shard = shard and shard.partition("#")[0]
                loaded.update([name] if shard is None else [f"{name}:{part}" for part in shard.split("+")])
    missing, fused = [], set()
    for name, module in model.named_modules():
        for pname, shards in module.expected_shards().items() if hasattr(module, "expected_shards") else ():
            fused.add(f"{name}.{pname}")
            missing += [f"{name}.{pname} ({shard})" for shard in shards if f"{name}.{pname}:{shard}" not in loaded]
    for name in params:
        if name not in fused and name not in loaded and not (tied and name == "lm_head.weight"):
            missing.append(name)
    if missing:
        raise ValueError(f"model: checkpoint lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")

