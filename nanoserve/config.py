"""User knobs (EngineArgs) and the validated configuration the engine runs with (EngineConfig)."""

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def bundled_model_dir() -> str:
    return str(Path(__file__).parent / "assets")


@dataclass
class ModelConfig:
    """The architecture fields nanoserve needs, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    torch_dtype: str | None
    sliding_window: int | None
    eos_token_ids: list[int]
    raw: dict = field(repr=False)

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model: no config.json in {model_dir!r}")
        raw = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"model: config.json in {model_dir!r} names no 'architectures'")
        heads = raw["num_attention_heads"]
        model_type = raw.get("model_type", "")
        # Qwen2 has q/k/v biases without saying so in config.json; the others say it (or have none).
        attention_bias = raw.get("attention_bias", model_type == "qwen2")
        # Qwen2 keeps sliding_window set but switched off by use_sliding_window=false.
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=raw.get("rope_scaling") or _rope_scaling_from_parameters(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=bool(attention_bias),
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            eos_token_ids=_eos_ids(model_dir, raw),
            raw=raw,
        )


def _rope_scaling_from_parameters(raw: dict) -> dict | None:
    # transformers >= 5 writes rope settings as "rope_parameters"; a plain default rope is no scaling.
    params = raw.get("rope_parameters")
    if not params or params.get("rope_type", "default") == "default":
        return None
    return params


def _eos_ids(model_dir: str, raw: dict) -> list[int]:
    """All eos ids: generation_config.json's list wins over config.json's (it usually has more)."""
    ids: list[int] = []
    gen = Path(model_dir) / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    sources.append(raw.get("eos_token_id"))
    for src in sources:
        for i in src if isinstance(src, list) else [src]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


@dataclass
class EngineArgs:
    """Everything a user may set, with the same names in LLM(...), EngineArgs and the CLI."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # Plan step N+1 while step N runs (LLMEngine.step). None: on for CUDA; on the CPU a step runs
    # to its end before the host goes on, so there it would only delay each output by a step.
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    seed: int = 0
    # The server only (AsyncEngine): run the engine in a process of its own, so that its host work
    # (scheduling, detokenizing, building outputs) does not share a GIL with the HTTP event loop.
    # None (resolve_engine_process): on for CUDA, where that shared GIL is what limited the server
    # (docs/server.md has the figures); off on the CPU, where it was never measured to help.
    engine_process: bool | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_config(self) -> "EngineConfig":
        return EngineConfig.from_args(self)


@dataclass
class EngineConfig:
    """EngineArgs after validation, with every 'auto' resolved."""

    args: EngineArgs
    model_dir: str
    tokenizer_dir: str
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int

    @classmethod
    def from_args(cls, args: EngineArgs) -> "EngineConfig":
        model_dir = args.model or bundled_model_dir()
        if not os.path.isdir(model_dir):
            raise ValueError(f"model: {model_dir!r} is not a directory (no model hub is used; give a local path)")
        model = ModelConfig.from_dir(model_dir)
        _check_positive(args, "block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
        if args.block_size & (args.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {args.block_size}")
        if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {args.num_kv_blocks}")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {args.gpu_memory_utilization}")
        if args.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: must be 'auto' or 'dummy', got {args.load_format!r}")
        if args.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: only 1 is supported in this version")
        device = resolve_device(args.device)
        dtype = _resolve_dtype(args.dtype, model.torch_dtype, device)
        max_model_len = _resolve_max_model_len(args.max_model_len, model)
        return cls(args, model_dir, args.tokenizer or model_dir, model, dtype, device, max_model_len)


def _check_positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def resolve_engine_process(args: EngineArgs) -> bool:
    """args.engine_process with None decided by the device the engine will run on. The server reads it
    before any config exists (the process loads its own), so this resolves the device itself."""
    if args.engine_process is not None:
        return args.engine_process
    return resolve_device(args.device).type == "cuda"


def resolve_device(device: str) -> torch.device:
    """EngineArgs.device ("auto", "cpu" or "cuda") as the device the engine will run on."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def _resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        # Half precision matmuls on the CPU are slow and lossy; fp32 is what a laptop should run.
        return torch.float32
    return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)


def _resolve_max_model_len(asked: int | None, model: ModelConfig) -> int:
    limit = model.max_position_embeddings
    if model.sliding_window:
        # Without a sliding-window kernel, attention is exact only while the context fits the window.
        limit = min(limit, model.sliding_window)
    if asked is None:
        return limit
    if asked < 1 or asked > limit:
        raise ValueError(f"max_model_len: must be in [1, {limit}] for this model, got {asked}")
    return asked
