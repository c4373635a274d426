"""User knobs (EngineArgs) and the validated configuration the engine runs with (EngineConfig)."""

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from nanoserve.quantization.detect import detect_quantization
from nanoserve.quantization.mxfp4 import MXFP4Scheme
from nanoserve.quantization.scheme import FP8Scheme, fp8_experts_fit, runs_fp8
from nanoserve.quantization.w4_scheme import W4Scheme, runs_w4, w4_experts_fit
from nanoserve.spec_decode.config import SpeculativeConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# kv_cache_dtype values that store the cache as float8_e4m3fn (vLLM's names; fp8 means e4m3 there too).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")

# The other names vLLM's --dtype takes.
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
# config.json keys nanoserve cannot guess.
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' defaults for the fields a config.json may leave out, by model_type, where nanoserve cannot take its
# own: Gemma 3's multimodal checkpoints (4B-27B) list in text_config only what differs from Gemma3TextConfig's.
_TEXT_DEFAULTS = {
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                        sliding_window=4096, sliding_window_pattern=6, tie_word_embeddings=True),
    "gemma2": dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                   sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   tie_word_embeddings=True, rms_norm_eps=1e-6),
}


def bundled_model_dir() -> str:
    return str(Path(__file__).parent / "assets")


@dataclass
class MoEConfig:
    """A mixture-of-experts model's routed experts (Qwen2-MoE, Qwen3-MoE, Mixtral), read from config.json."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    norm_topk_prob: bool  # renormalize the top-k routing weights to sum to one
    sparse_layers: list[bool]  # per layer: routed experts (True) or the dense MLP
    shared_expert_intermediate_size: int  # Qwen2-MoE's gated shared expert beside the routed ones; 0: none

    @classmethod
    def from_raw(cls, raw: dict) -> "MoEConfig | None":
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        if not num_experts:
            return None
        # Mixtral's and gpt-oss's intermediate_size is an expert's, and both renormalize the top-k weights (gpt-oss's
        # softmax over the top-k logits is the same); Qwen's MoE layers: every decoder_sparse_step-th layer not listed
        # in mlp_only_layers, the others' all.
        mixtral = raw.get("model_type") in ("mixtral", "gpt_oss")
        step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or [])
        return cls(
            num_experts=num_experts,
            top_k=raw["num_experts_per_tok"],
            intermediate_size=raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"],
            norm_topk_prob=True if mixtral else bool(raw.get("norm_topk_prob", False)),
            sparse_layers=[i not in dense and (i + 1) % step == 0 for i in range(raw["num_hidden_layers"])],
            shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0,
        )


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
    moe: MoEConfig | None = None

    @property
    def dense_layers(self) -> int:
        return self.num_hidden_layers - sum(self.moe.sparse_layers if self.moe else [])

    @property
    def active_intermediate_size(self) -> float:
        """MLP width a token runs through, averaged over the layers: the routed experts it picks and any shared
        expert in MoE layers (what its FLOPs and a batch-1 step's expert bytes scale with)."""
        if self.moe is None:
            return self.intermediate_size
        moe = self.moe
        sparse = moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size
        return (sparse * (self.num_hidden_layers - self.dense_layers)
                + self.intermediate_size * self.dense_layers) / self.num_hidden_layers

    @classmethod
    def from_dir(cls, model_dir: str, generation_config: str = "auto") -> "ModelConfig":
        """config.json of `model_dir`, with the eos ids of the generation_config.json that
        `generation_config` (EngineArgs') names."""
        raw = language_model_config(read_config_json(model_dir))
        missing = [key for key in _REQUIRED_KEYS if key not in raw]
        if missing:
            raise ValueError(f"model: config.json in {model_dir!r} has no {missing[0]!r}")
        heads = raw["num_attention_heads"]
        model_type = raw.get("model_type", "")
        # Qwen2 has q/k/v biases without saying so in config.json (Qwen2-MoE as qkv_bias); the others say it.
        attention_bias = raw.get("attention_bias", raw.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))
        # Qwen2 keeps sliding_window set but switched off by use_sliding_window=false.
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=raw["architectures"][0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(_global_rope(raw.get("rope_parameters")), raw),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=bool(attention_bias),
            hidden_act=raw.get("hidden_act", "silu"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=sliding,
            eos_token_ids=_eos_ids(_generation_config_dir(generation_config, model_dir), raw),
            raw=raw,
            moe=MoEConfig.from_raw(raw),
        )


def read_config_json(model_dir: str) -> dict:
    """config.json of `model_dir`, which must name its architecture (whether nanoserve runs it is model/'s to say:
    engine/frontend.py's engine_config asks before this module reads the rest)."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"model: {model_dir!r} is not a directory (no model hub is used; give a local path)")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: no config.json in {model_dir!r}")
    raw = json.loads(path.read_text())
    if not raw.get("architectures"):
        raise ValueError(f"model: config.json in {model_dir!r} names no 'architectures'")
    return raw


def language_model_config(raw: dict) -> dict:
    """The fields of the language model: a multimodal checkpoint's (Gemma3ForConditionalGeneration) text_config over
    its top level (architectures stays the top level's), and transformers' defaults for what it leaves out."""
    if raw.get("text_config"):
        top = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        raw = top | raw["text_config"] | {"architectures": raw["architectures"]}
    return _TEXT_DEFAULTS.get(raw.get("model_type"), {}) | raw


def _global_rope(params: dict | None) -> dict | None:
    """The rope parameters of the full-attention layers: transformers >= 5 writes Gemma 3's per layer type."""
    return params.get("full_attention", params) if params else params


def _rope_scaling(raw: dict) -> dict | None:
    """rope_scaling (transformers >= 5 writes it as rope_parameters) completed as transformers completes it, with the
    model's max_position_embeddings beside it for layers/rotary.py's formulas; None for a plain rope. Where the
    parameters are per layer type (Gemma 3), the full-attention layers'."""
    return complete_rope_scaling(raw.get("rope_scaling") or _global_rope(raw.get("rope_parameters")), raw)


def rope_theta(params: dict | None, raw: dict, default: float = 10000.0) -> float:
    """The rope base of one rope parameters dict (transformers >= 5 keeps it there), else config.json's rope_theta."""
    return (params or {}).get("rope_theta") or raw.get("rope_theta", default)


def complete_rope_scaling(params: dict | None, raw: dict) -> dict | None:
    """One rope parameters dict (rope_scaling's form) of config.json `raw`, completed as _rope_scaling says."""
    if not params:
        return None
    scaling = dict(params)
    kind = scaling.setdefault("rope_type", scaling.get("type", "default"))
    if raw.get("model_type") == "phi3" and kind in ("su", "yarn"):
        # transformers' Phi3Config reads the names early Phi-3 checkpoints used ("su" for LongRoPE) as longrope.
        kind = scaling["rope_type"] = "longrope"
    if kind == "default":
        return None
    if kind in ("llama3", "yarn", "longrope"):
        # Phi-3 keeps the pretraining length beside rope_scaling, and transformers lets that copy win.
        if "original_max_position_embeddings" in raw:
            scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            scaling.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    scaling["max_position_embeddings"] = raw.get("max_position_embeddings", 2048)
    return scaling


def _eos_ids(generation_config_dir: str | None, raw: dict) -> list[int]:
    """All eos ids: generation_config.json's list wins over config.json's (it usually has more)."""
    ids: list[int] = []
    gen = Path(generation_config_dir) / "generation_config.json" if generation_config_dir else None
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen and gen.is_file() else []
    sources.append(raw.get("eos_token_id"))
    for src in sources:
        for i in src if isinstance(src, list) else [src]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


# Which replica or backend takes a request (runtime/routing.py): --data-parallel-routing, `nanoserve router --policy`.
ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")


def _check_speculative(args: "EngineArgs") -> SpeculativeConfig | None:
    """The speculative config, checked (SpeculativeConfig.from_dict refuses a bad one naming its key)."""
    if args.speculative_config is None:
        return None
    return SpeculativeConfig.from_dict(args.speculative_config)


def _arg(default, help: str):
    """An EngineArgs field with the one-line help its command-line flag shows."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineArgs:
    """Everything a user may set, with the same names in LLM(...), EngineArgs and the CLI."""

    model: str | None = _arg(None, "a local Hugging Face model directory (config.json, *.safetensors, tokenizer); "
                                   "None: the bundled tiny chat model")
    tokenizer: str | None = _arg(None, "the tokenizer's directory; None: the model's")
    dtype: str = _arg("auto", "weights and activations: auto (the checkpoint's on CUDA, float32 on the CPU), "
                              "float16 (half, fp16), bfloat16 (bf16) or float32 (float, fp32)")
    device: str = _arg("auto", "auto (cuda when torch sees a GPU), cuda or cpu")
    load_format: str = _arg("auto", "auto (the checkpoint's *.safetensors) or dummy (random weights: only "
                                    "config.json is read)")
    block_size: int = _arg(16, "tokens per KV-cache block (a power of two)")
    num_kv_blocks: int | None = _arg(None, "KV-cache blocks; None: as many as fit in --gpu-memory-utilization "
                                           "(1 GiB on the CPU)")
    gpu_memory_utilization: float = _arg(0.9, "share of the GPU's memory the engine may use: weights, "
                                              "activations and the KV cache")
    max_num_seqs: int = _arg(256, "most sequences in one step")
    max_num_batched_tokens: int = _arg(8192, "most tokens in one step (prompts are prefilled in chunks)")
    max_model_len: int | None = _arg(None, "context length, prompt and output; None: the model's "
                                           "max_position_embeddings, capped by the KV cache")
    enable_prefix_caching: bool = _arg(True, "share the KV blocks of common prompt prefixes between requests")
    kv_offload_gb: float = _arg(0.0, "GiB of CPU memory (pinned, per GPU) for KV blocks: a tier under the prefix "
                                     "cache (evicted prefix blocks are loaded back on a hit, which also serves "
                                     "preempted requests), and the older blocks of requests longer than the GPU "
                                     "pool (long-context mode); 0: none")
    disable_hybrid_kv_cache_manager: bool = _arg(False, "models with sliding-window layers (Gemma 2/3, gpt-oss, "
                                                         "Mistral-7B-v0.1): keep every token's KV in every layer, "
                                                         "instead of a pool for the window layers that frees the "
                                                         "blocks out of their window")
    enforce_eager: bool = _arg(False, "run without CUDA graphs (quicker start, slower steps)")
    # Plan step N+1 while step N runs (LLMEngine.step). None: on for CUDA; on the CPU a step runs
    # to its end before the host goes on, so there it would only delay each output by a step.
    async_scheduling: bool | None = _arg(None, "schedule step N+1 while the GPU runs step N; None: on for CUDA")
    # The mask threads run beside the engine's own thread (structured/manager.py): on a machine whose cores are
    # shared (hyperthreads, other jobs), fewer of them can leave that thread more of its core.
    mask_threads: int | None = _arg(None, "structured output: threads computing token masks; None: 4 in 5 of the "
                                          "CPUs this process may use, at most 32 (llguidance's default)")
    tensor_parallel_size: int = _arg(1, "ranks the model is split over: one process per GPU (rank 0 is the engine's "
                                        "own), or per CPU process with gloo on the CPU")
    distributed_init_method: str | None = _arg(None, "tensor parallel: where the ranks meet (torch.distributed's "
                                                     "init_method), tcp://HOST:PORT or env:// (MASTER_ADDR, "
                                                     "MASTER_PORT); None: a free port on 127.0.0.1 (one node)")
    nnodes: int = _arg(1, "tensor parallel: machines the ranks are spread over, tensor_parallel_size / nnodes each; "
                          "the others run `nanoserve worker` with the same engine flags")
    node_rank: int = _arg(0, "tensor parallel: this machine's place among nnodes (0: the one that runs the engine)")
    data_parallel_size: int = _arg(1, "serve only: replicas of the engine, each in a process of its own on its own "
                                      "GPU (tensor_parallel_size GPUs each), or on its share of the CPU's threads; "
                                      "each request goes to one replica (cache-aware routing, docs/scale_out.md)")
    data_parallel_routing: str = _arg("cache_aware", "serve only, with data_parallel_size > 1: which replica takes a "
                                                     "request: cache_aware (where its prompt's prefix went before, "
                                                     "unless that replica is much busier), least_load or round_robin")
    enable_expert_parallel: bool = _arg(False, "mixture-of-experts models under tensor parallelism: each rank holds "
                                               "whole experts (num_experts / tensor_parallel_size of them) instead "
                                               "of a slice of every expert")
    disable_custom_all_reduce: bool = _arg(False, "tensor parallel on GPUs: NCCL for every all-reduce, instead of "
                                                   "peer-to-peer (symmetric memory) ones for small messages")
    seed: int = _arg(0, "seed of random weights (--load-format dummy) and of sampling without a seed")
    # The server only (AsyncEngine): run the engine in a process of its own, so that its host work
    # (scheduling, detokenizing, building outputs) does not share a GIL with the HTTP event loop.
    # None (resolve_engine_process): on for CUDA, where that shared GIL is what limited the server
    # (docs/server.md has the figures); off on the CPU, where it was never measured to help.
    engine_process: bool | None = _arg(None, "serve only: run the engine in a process of its own; "
                                             "None: on for CUDA")
    # Where the engine process's host time goes under load (runtime/engine_core_process.py).
    profile_engine: str | None = _arg(None, "serve with the engine process only: cProfile its loop and write the "
                                            "stats to this file when it stops (`python -m pstats FILE` reads "
                                            "them); None: no profile")
    chat_template: str | None = _arg(None, "a Jinja chat template, as a file or as the template's text, used "
                                           "in place of the tokenizer's")
    generation_config: str = _arg("auto", "where eos ids beyond config.json's come from: auto (the model "
                                          "directory's generation_config.json), vllm or none (not read), or a "
                                          "directory holding a generation_config.json. Only eos_token_id is "
                                          "read: its sampling values (temperature, top_p, ...) are not defaults "
                                          "here, each request sets its own")
    fused_rope_decode: str = _arg("auto", "CUDA: q/k norm, rotary and the KV store inside decode attention's launch "
                                          "for steps that are all decodes: auto (up to 4 sequences of a model "
                                          "without q/k norms, 1 of a model with them, as measured), on (every such "
                                          "step) or off (none)")
    quantization: str | None = _arg(None, "fp8: quantize an unquantized checkpoint's linear weights to FP8 while "
                                          "loading (per-channel weight scales, dynamic per-token activations); "
                                          "compressed-tensors, fp8, gptq, awq or mxfp4: what a quantized "
                                          "checkpoint's quantization_config says, which is read without this flag; "
                                          "None: as the checkpoint is")
    kv_cache_dtype: str = _arg("auto", "the KV cache's storage: auto (the model's dtype), fp8 or fp8_e4m3 (both "
                                       "float8_e4m3fn with a scale per layer for keys and one for values, from the "
                                       "checkpoint where it has them, else 1.0: half the bytes, twice the tokens; "
                                       "CUDA needs compute capability 8.9 or later)")
    pdl: bool = _arg(True, "CUDA: launch kernels with programmatic dependent launch on compute capability 9.0+ "
                           "(--no-pdl to measure what it gives or rule it out)")
    speculative_config: dict | None = _arg(None, "speculative decoding, as a JSON object: {\"method\": \"ngram\", "
                                                 "\"num_speculative_tokens\": k, \"prompt_lookup_max\": n, "
                                                 "\"prompt_lookup_min\": m} (prompt lookup), {\"model\": DIR, "
                                                 "\"num_speculative_tokens\": k} (a draft model) or {\"method\": "
                                                 "\"eagle3\", \"model\": DIR, ...} (an EAGLE-3 head); exact; "
                                                 "None: off")

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
    # What set max_model_len, for the start-up summary: the model's limit, the user, or the KV pool.
    max_model_len_source: str = "the model's max_position_embeddings"
    chat_template: str | None = None  # the template's text (args.chat_template may name a file)
    # What config.json's quantization_config and args.quantization ask for.
    quantization: FP8Scheme | W4Scheme | MXFP4Scheme | None = None
    speculative: SpeculativeConfig | None = None  # args.speculative_config, checked
    # A draft model's KV bytes per block (worker/draft_model.py), set once it is loaded: its pool has the target's
    # block count, out of the same memory budget.
    draft_kv_bytes_per_block: int = 0
    # EAGLE-3: the target layers whose input hidden states the head reads (worker/eagle3.py sets them before the
    # target's runner is built); empty otherwise.
    aux_hidden_state_layers: tuple[int, ...] = ()

    @classmethod
    def from_args(cls, args: EngineArgs) -> "EngineConfig":
        model_dir = args.model or bundled_model_dir()
        model = ModelConfig.from_dir(model_dir, args.generation_config)
        _check_positive(args, "block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                        "nnodes")
        if args.mask_threads is not None:
            _check_positive(args, "mask_threads")
        if args.block_size & (args.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {args.block_size}")
        if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {args.num_kv_blocks}")
        if not isinstance(args.kv_offload_gb, int | float) or not 0 <= args.kv_offload_gb < float("inf"):
            raise ValueError(f"kv_offload_gb: must be a number >= 0, got {args.kv_offload_gb!r}")
        if not 0 < args.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {args.gpu_memory_utilization}")
        if args.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: must be 'auto' or 'dummy', got {args.load_format!r}")
        _check_data_parallel(args)
        speculative = _check_speculative(args)
        _check_tensor_parallel(args, model)
        quantization = detect_quantization(model.raw, args.quantization)
        if quantization is not None:
            _check_quantization(quantization, model, args.tensor_parallel_size)
        if args.enable_expert_parallel and model.moe is None:
            raise ValueError(f"enable_expert_parallel: {model.architecture} has no experts")
        if args.fused_rope_decode not in ("auto", "on", "off"):
            raise ValueError(f"fused_rope_decode: must be auto, on or off, got {args.fused_rope_decode!r}")
        if not isinstance(args.pdl, bool):
            raise ValueError(f"pdl: must be True or False, got {args.pdl!r}")
        _check_profile_engine(args)
        _check_kv_cache_dtype(args.kv_cache_dtype)
        device = resolve_device(args.device)
        if device.type == "cuda":
            _check_kernel_shapes(args, model)
            if args.kv_cache_dtype in FP8_KV_CACHE_DTYPES and torch.cuda.get_device_capability(device) < (8, 9):
                raise ValueError(f"kv_cache_dtype: {args.kv_cache_dtype!r} needs a GPU of compute capability 8.9 or "
                                 f"later (fp8 arithmetic), this one is {torch.cuda.get_device_capability(device)}")
            ranks_here = args.tensor_parallel_size // args.nnodes
            if ranks_here > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size: {ranks_here} ranks on this node, but torch sees "
                                 f"{torch.cuda.device_count()} GPUs")
        dtype = _resolve_dtype(args.dtype, model.torch_dtype, device)
        max_model_len, source = _resolve_max_model_len(args.max_model_len, model)
        return cls(args, model_dir, args.tokenizer or model_dir, model, dtype, device, max_model_len, source,
                   _load_chat_template(args.chat_template), quantization, speculative)

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or fp8 (e4m3) for kv_cache_dtype fp8."""
        return torch.float8_e4m3fn if self.args.kv_cache_dtype in FP8_KV_CACHE_DTYPES else self.dtype

    @property
    def num_kv_heads_per_rank(self) -> int:
        """KV heads in one rank's cache: its share, or one replicated head when there are fewer than ranks."""
        return max(1, self.model.num_key_value_heads // self.args.tensor_parallel_size)

    def fit_kv_pool(self, num_kv_blocks: int) -> None:
        """Lower max_model_len to what the KV pool holds: one sequence must fit in it alone."""
        pool_tokens = num_kv_blocks * self.args.block_size
        if pool_tokens >= self.max_model_len:
            return
        if self.args.max_model_len is not None:
            raise ValueError(f"max_model_len: {self.max_model_len} does not fit the KV pool of "
                             f"{pool_tokens} tokens (num_kv_blocks={num_kv_blocks})")
        self.max_model_len = pool_tokens
        self.max_model_len_source = f"the KV pool's size; the model allows {_model_limit(self.model)[0]}"

    def summary(self, num_kv_blocks: int, local_pool: tuple[int, int, bool] | None = None) -> str:
        """One line on what the engine loaded, for the log at start. local_pool: (blocks, window, every layer
        windowed) of the sliding-window layers' own pool, if they have one."""
        weights = "random weights" if self.args.load_format == "dummy" else "weights"
        dtype = str(self.dtype).removeprefix("torch.")
        quantized = f"; {self.quantization.describe()}" if self.quantization else ""
        if self.model.moe is not None and self.quantization is not None and \
                not isinstance(self.quantization, MXFP4Scheme):
            # quantization/moe_experts.py
            done = "dequantized while loading" if self.quantization.serialized else "left unquantized"
            kept, ranks, form = self._ranks_keeping_experts()
            if kept == ranks:
                quantized += f" (routed experts kept {form}, weight-only)"
            elif kept:  # a TP share that cuts blocks or groups on some ranks (prepare_model warns on each)
                quantized += f" (routed experts kept {form} on {kept} of {ranks} ranks, {done} on the others)"
            elif isinstance(self.quantization, W4Scheme) and self.quantization.act_order and runs_w4(self.device):
                quantized += f" (routed experts {done}: {dtype}; act-order experts have no 4-bit MoE kernel)"
            else:
                quantized += f" (routed experts {done}: {dtype})"
        kv_dtype = str(self.kv_dtype).removeprefix("torch.")
        return (f"loaded {self.model.architecture} {weights} from {self.model_dir} as {dtype} on {self.device}"
                f"{quantized}; {_kv_pool_text(num_kv_blocks, local_pool, self.args.block_size, kv_dtype)}; "
                f"max_model_len {self.max_model_len} ({self.max_model_len_source})")

    def _ranks_keeping_experts(self) -> tuple[int, int, str]:
        """(ranks, of how many, that keep an FP8 or 4-bit checkpoint's routed experts in their quantized form, that
        form): quantization/model.py's prepare_model keeps them on a device that runs them, on each rank whose equal
        share of the intermediate size is whole blocks of scales (FP8) or whole groups (4-bit); the others dequantize
        while loading, with a warning."""
        scheme = self.quantization
        total, tp = self.model.moe.intermediate_size, self.args.tensor_parallel_size
        ranks = tp
        if self.args.enable_expert_parallel:
            tp = 1  # each rank holds whole experts
        if isinstance(scheme, FP8Scheme) and scheme.serialized and runs_fp8(self.device):
            form = "in fp8"
            kept = sum(fp8_experts_fit(scheme.block, r * (total // tp), total // tp, total) for r in range(tp))
        elif isinstance(scheme, W4Scheme) and runs_w4(self.device):
            form = "packed in 4 bits"
            kept = sum(w4_experts_fit(scheme, r * (total // tp), total // tp, total) for r in range(tp))
        else:
            return 0, ranks, ""
        return (ranks if kept == tp else kept), ranks, form


def _kv_pool_text(num_kv_blocks: int, local_pool: tuple[int, int, bool] | None, block: int, kv_dtype: str) -> str:
    tokens = f"{num_kv_blocks} blocks x {block} = {num_kv_blocks * block} tokens"
    if local_pool is None:
        return f"KV cache {tokens} in {kv_dtype}"
    blocks, window, all_local = local_pool
    freed = f"{blocks} blocks = {blocks * block} tokens, out-of-window blocks freed"
    if all_local:
        # The global pool's blocks hold no layer's KV (worker/kv_cache.py): they only number the context's blocks.
        return (f"KV cache in {kv_dtype}, every layer sliding-window (window {window}): {freed}; block tables of "
                f"{tokens} (no KV)")
    return f"KV cache {tokens} in {kv_dtype} (global layers), sliding-window layers (window {window}) {freed}"


def _check_kv_cache_dtype(value: str) -> None:
    if value not in ("auto", *FP8_KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype: must be auto, fp8 or fp8_e4m3, got {value!r}")


def _check_kernel_shapes(args: EngineArgs, model: ModelConfig) -> None:
    """What the Triton attention kernels take (kernels/decode_attention.py, kernels/prefill/): refused at
    start, naming the field, rather than by an assert inside the first step."""
    if model.head_dim not in (64, 128, 256):
        raise ValueError(f"model: head_dim {model.head_dim} is not supported on CUDA (the attention kernels take "
                         "64, 128 or 256)")
    if args.block_size < 8:
        raise ValueError(f"block_size: must be at least 8 on CUDA, got {args.block_size}")


def _check_tensor_parallel(args: EngineArgs, model: ModelConfig) -> None:
    """What the shards need (layers/linear.py, layers/embedding.py): equal shares of heads, of the intermediate
    size and of the vocabulary; kv heads split evenly, or each replicated on an equal number of ranks."""
    tp = args.tensor_parallel_size
    if not isinstance(args.node_rank, int) or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"node_rank: must be in [0, nnodes={args.nnodes}), got {args.node_rank!r}")
    if tp % args.nnodes:
        raise ValueError(f"nnodes: tensor_parallel_size={tp} ranks do not split evenly over {args.nnodes} nodes")
    if args.nnodes > 1 and not args.distributed_init_method:
        raise ValueError("distributed_init_method: several nodes need an address all of them reach "
                         "(tcp://HOST:PORT of node 0, or env:// with MASTER_ADDR and MASTER_PORT)")
    if tp == 1:
        return
    kv = model.num_key_value_heads
    shares = [("num_attention_heads", model.num_attention_heads), ("vocab_size", model.vocab_size)]
    if model.dense_layers:
        shares.append(("intermediate_size", model.intermediate_size))
    if model.moe is not None:
        # Expert parallel: whole experts per rank; else every expert sliced like a dense MLP.
        shares.append(("num_experts", model.moe.num_experts) if args.enable_expert_parallel
                      else ("moe_intermediate_size", model.moe.intermediate_size))
        if model.moe.shared_expert_intermediate_size:
            shares.append(("shared_expert_intermediate_size", model.moe.shared_expert_intermediate_size))
    uneven = [f"{name} {n}" for name, n in shares if n % tp]
    if kv % tp and tp % kv:
        uneven.append(f"num_key_value_heads {kv} (nor does {tp} divide by it)")
    if uneven:
        raise ValueError(f"tensor_parallel_size: {tp} does not divide the model's {', '.join(uneven)}")


def _check_quantization(scheme: FP8Scheme | W4Scheme | MXFP4Scheme, model: ModelConfig, tp_size: int) -> None:
    """Refuse, naming the field, a model this scheme cannot run or split: MXFP4 is gpt-oss's; with FP8, stacked
    shards (q/k/v, gate/up) must each be whole blocks of rows, and under tensor parallelism each rank's input
    columns of o_proj and down_proj whole blocks of columns; 4-bit weights as _check_w4 says."""
    if isinstance(scheme, MXFP4Scheme):
        if model.architecture != "GptOssForCausalLM":
            raise ValueError(f"quantization_config.quant_method: 'mxfp4' is supported for gpt-oss's experts "
                             f"(GptOssForCausalLM), not {model.architecture}")
        return
    if model.architecture == "GptOssForCausalLM":
        raise ValueError(f"quantization: {scheme.method!r} for gpt-oss: its experts run as OpenAI ships them, in "
                         "mxfp4 (quant_method 'mxfp4')")
    if isinstance(scheme, W4Scheme):
        _check_w4(scheme, model, tp_size)
        return
    if scheme.block is None:
        return
    rows, cols = scheme.block
    field = scheme.block_field
    if any(size < 16 or size & (size - 1) for size in scheme.block):
        # The block GEMM's tiles are one block of columns wide (kernels/fp8_block_gemm.py).
        raise ValueError(f"{field}: must be powers of two >= 16, got {list(scheme.block)}")
    heads = model.num_attention_heads * model.head_dim // tp_size
    kv = max(1, model.num_key_value_heads // tp_size) * model.head_dim
    ffn = model.intermediate_size // tp_size
    uneven = [f"{what} {n}" for what, n in (("q_proj rows", heads), ("k_proj/v_proj rows", kv),
                                            ("gate_proj/up_proj rows", ffn)) if n % rows]
    if tp_size > 1:
        uneven += [f"{what} {n}" for what, n in (("o_proj columns", heads), ("down_proj columns", ffn))
                   if n % cols]
    if uneven:
        where = f" per rank at tensor_parallel_size {tp_size}" if tp_size > 1 else ""
        raise ValueError(f"{field}: {list(scheme.block)} does not divide the "
                         f"model's {', '.join(uneven)}{where}")


def _check_w4(scheme: W4Scheme, model: ModelConfig, tp_size: int) -> None:
    """Refuse, naming the field, a model whose layers a 4-bit scheme cannot split (quantization/w4_linear.py): each
    stacked shard's rows (a rank's share) whole int32s of eight (AWQ and compressed-tensors pack rows), and each
    layer's input columns (a rank's share of o_proj's and down_proj's) whole groups; with act-order, whole int32s of
    eight (GPTQ and compressed-tensors pack them), the whole layer's whole groups."""
    heads = model.num_attention_heads * model.head_dim // tp_size
    kv = max(1, model.num_key_value_heads // tp_size) * model.head_dim
    ffn = model.intermediate_size // tp_size
    rows = [f"{what} {n}" for what, n in (("q_proj rows", heads), ("k_proj/v_proj rows", kv),
                                          ("gate_proj/up_proj rows", ffn)) if n % 8]
    where = f" per rank at tensor_parallel_size {tp_size}" if tp_size > 1 else ""
    if rows:
        raise ValueError(f"quantization_config: 4-bit weights pack eight rows an int32, which does not divide the "
                         f"model's {', '.join(rows)}{where}")
    whole = [("o_proj columns", model.num_attention_heads * model.head_dim), ("down_proj columns",
                                                                             model.intermediate_size)]
    if model.moe is not None and model.moe.shared_expert_intermediate_size:  # a linear layer too (Qwen2-MoE)
        whole.append(("shared_expert down_proj columns", model.moe.shared_expert_intermediate_size))
    columns = [(what, n // tp_size) for what, n in whole]
    if scheme.act_order and tp_size > 1:
        # g_idx puts a rank's columns in any group, so every rank keeps every group's scales (w4_linear.py): its
        # share need not be whole groups, only whole int32s of GPTQ's and compressed-tensors' packing along them.
        cut = [f"{what} {n}" for what, n in columns if n % 8]
        if cut:
            raise ValueError(f"quantization_config: act-order 4-bit weights pack eight input columns an int32, which "
                             f"does not divide the model's {', '.join(cut)}{where}")
        columns, where = whole, ""
    if scheme.group_size == -1:
        return
    uneven = [f"{what} {n}" for what, n in [("hidden_size", model.hidden_size), *columns] if n % scheme.group_size]
    if uneven:
        raise ValueError(f"{scheme.group_field}: {scheme.group_size} does not divide the model's "
                         f"{', '.join(uneven)}{where}")


def _check_profile_engine(args: EngineArgs) -> None:
    """A profile is written by the engine process (run_engine_core_process), when it stops: a path it could not
    write would be found out only then."""
    path = args.profile_engine
    if path is None:
        return
    if not isinstance(path, str) or not path:
        raise ValueError(f"profile_engine: must be a file path, got {path!r}")
    if args.engine_process is not True:
        raise ValueError("profile_engine: only the engine process is profiled (serve with --engine-process)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"profile_engine: the directory of {path!r} does not exist")


def _check_data_parallel(args: EngineArgs) -> None:
    """What the replicas of `serve --data-parallel-size N` (runtime/data_parallel.py) cannot share."""
    _check_positive(args, "data_parallel_size")
    if args.data_parallel_routing not in ROUTING_POLICIES:
        raise ValueError(f"data_parallel_routing: must be one of {', '.join(ROUTING_POLICIES)}, got "
                         f"{args.data_parallel_routing!r}")
    if args.data_parallel_size == 1:
        return
    if args.engine_process is False:
        raise ValueError("engine_process: data parallelism runs every replica in a process of its own; drop "
                         "--no-engine-process")
    # Replicas on other machines are what `nanoserve router` is for: one mechanism, not two.
    if args.nnodes > 1:
        raise ValueError("data_parallel_size: replicas run on this machine only; for several machines run "
                         "`nanoserve serve` on each and `nanoserve router` in front of them")
    if args.distributed_init_method:
        raise ValueError("distributed_init_method: each replica's tensor-parallel ranks meet on a free port of "
                         "their own; a fixed address would be shared by every replica")


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
    if args.data_parallel_size > 1:
        return True
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
        name = _DTYPE_ALIASES.get(dtype, dtype)
        if name not in _DTYPES:
            raise ValueError(f"dtype: must be auto, float16 (or half, fp16), bfloat16 (or bf16) or float32 "
                             f"(or float, fp32); got {dtype!r}")
        return _DTYPES[name]
    if device.type == "cpu":
        # Half precision matmuls on the CPU are slow and lossy; fp32 is what a laptop should run.
        return torch.float32
    return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)


def _model_limit(model: ModelConfig) -> tuple[int, str]:
    """The longest context the model runs exactly, and which of its fields says so. (A sliding window does not
    cap it: every attention path masks keys outside a layer's window, layers/attention.py.)"""
    return model.max_position_embeddings, "the model's max_position_embeddings"


def _resolve_max_model_len(asked: int | None, model: ModelConfig) -> tuple[int, str]:
    """max_model_len, and what set it."""
    limit, source = _model_limit(model)
    if asked is None:
        return limit, source
    if asked < 1 or asked > limit:
        raise ValueError(f"max_model_len: must be in [1, {limit}] for this model, got {asked}")
    return asked, "asked for with --max-model-len"


def _generation_config_dir(generation_config: str, model_dir: str) -> str | None:
    """The directory whose generation_config.json is read (for eos ids), or None for none."""
    if generation_config == "auto":
        return model_dir
    if generation_config in ("vllm", "none"):
        return None
    if not (Path(generation_config) / "generation_config.json").is_file():
        raise ValueError(f"generation_config: must be auto, vllm, none or a directory with a "
                         f"generation_config.json; got {generation_config!r}")
    return generation_config


def _load_chat_template(chat_template: str | None) -> str | None:
    """The template's text, from a file or given inline (as vLLM's --chat-template takes it). Its syntax is
    checked where it is rendered, by transformers' Jinja environment (it has tags plain Jinja lacks)."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        return Path(chat_template).read_text()
    if "{" not in chat_template:
        raise ValueError(f"chat_template: {chat_template!r} is neither a file nor a Jinja template")
    return chat_template
