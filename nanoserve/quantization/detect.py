"""The scheme a model runs: config.json's `quantization_config` (as vLLM reads it) and the `quantization` engine flag
(vLLM's --quantization). What the engine cannot run is refused here, at start, naming the field and the value.

Formats read:
- compressed-tensors (what llm-compressor writes), format "float-quantized": one config group targeting "Linear" whose
  `weights` are 8-bit floats (strategy tensor, channel, or block with block_structure) and whose `input_activations`
  are 8-bit floats, dynamic per token, static per tensor, dynamic per group (with block weights), or absent
  (weight-only); its `ignore` list; a `kv_cache_scheme` of static per-tensor 8-bit floats (the checkpoint then holds
  the fp8 KV cache's scales, which kv_cache_dtype fp8 uses: quantization/kv_scales.py), alone or beside the weights'.
- quant_method "fp8": `weight_block_size` [rows, columns] with `weight_scale_inv` tensors and dynamic activations
  (Qwen3-FP8, DeepSeek-V3); without a block size, per-tensor `weight_scale` with static `input_scale` or dynamic
  activations. Its `ignored_layers` / `modules_to_not_convert`.
- quant_method "mxfp4": gpt-oss's experts as OpenAI ships them (mxfp4.py says how they run).
- `quantization="fp8"` on an unquantized checkpoint: its linear weights quantized while loading (scheme.py says how).
- 4-bit weights (W4A16): quant_method "gptq", "awq", and compressed-tensors' format "pack-quantized", read by
  w4_detect.py.
"""

from nanoserve.quantization import w4_detect
from nanoserve.quantization.mxfp4 import MXFP4Scheme
from nanoserve.quantization.scheme import FP8Scheme
from nanoserve.quantization.w4_scheme import W4Scheme

SUPPORTED_METHODS = ("awq", "compressed-tensors", "fp8", "gptq", "mxfp4")
_SUPPORTED = ", ".join(SUPPORTED_METHODS)


def detect_quantization(raw_config: dict, flag: str | None) -> FP8Scheme | W4Scheme | MXFP4Scheme | None:
    """The scheme of a model whose config.json is raw_config, run with EngineArgs.quantization = flag; None:
    unquantized."""
    if flag is not None and flag not in SUPPORTED_METHODS:
        raise ValueError(f"quantization: {flag!r} is not supported; supported: {_SUPPORTED}")
    qc = raw_config.get("quantization_config")
    if qc is None:
        if flag is None:
            return None
        if flag != "fp8":
            raise ValueError(f"quantization: {flag!r} needs a checkpoint written in that format (its config.json "
                             "has no quantization_config); 'fp8' quantizes an unquantized one while loading")
        return online_fp8()
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config: must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config.quant_method: {method!r} is not supported; supported: {_SUPPORTED}")
    if flag is not None and flag != method:
        raise ValueError(f"quantization: {flag!r} does not match the checkpoint's quantization_config.quant_method "
                         f"{method!r}")
    if method == "gptq":
        return w4_detect.gptq(qc)
    if method == "awq":
        return w4_detect.awq(qc)
    if method == "mxfp4":
        return MXFP4Scheme()
    return _compressed_tensors(qc) if method == "compressed-tensors" else _fp8(qc)


def online_fp8() -> FP8Scheme:
    """`--quantization fp8` on an unquantized checkpoint: per-channel weight scales and dynamic per-token
    activations (llm-compressor's FP8_DYNAMIC recipe). Per-channel rather than vLLM's per-tensor weight scales: one
    outlier row then costs only its own precision, q/k/v and gate/up need no common scale, and on Hopper the
    rowwise-scaled GEMM runs as fast as the per-tensor one; per-token activations for the same reason, with no
    calibration needed."""
    return FP8Scheme("fp8", "channel", "token", serialized=False)


def _compressed_tensors(qc: dict) -> FP8Scheme | W4Scheme | None:
    field = "quantization_config"
    groups = qc.get("config_groups") or {}
    if qc.get("kv_cache_scheme"):
        _check_kv_cache_scheme(qc["kv_cache_scheme"], f"{field}.kv_cache_scheme")
        if not groups:  # the KV cache's scales only: the weights are as they are
            return None
    if len(groups) != 1:
        raise ValueError(f"{field}.config_groups: exactly one group is supported, got {len(groups)}")
    (gname, group), = groups.items()
    gfield = f"{field}.config_groups.{gname}"
    fmt = group.get("format") or qc.get("format")
    if fmt not in ("float-quantized", "pack-quantized"):
        raise ValueError(f"{field}.format: {fmt!r} is not supported; supported: 'float-quantized' (FP8), "
                         "'pack-quantized' (4-bit ints)")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{gfield}.targets: only ['Linear'] is supported, got {group.get('targets')!r}")
    if group.get("output_activations"):
        raise ValueError(f"{gfield}.output_activations: output quantization is not supported")
    if fmt == "pack-quantized":
        return w4_detect.pack_quantized(qc, gname, group)
    weights = group.get("weights") or {}
    _check_fp8_args(weights, f"{gfield}.weights")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"{gfield}.weights.strategy: {strategy!r} is not supported; supported: tensor, channel, "
                         "block")
    if weights.get("dynamic"):
        raise ValueError(f"{gfield}.weights.dynamic: weights must be quantized in the checkpoint (false)")
    block = None
    if strategy == "block":
        block = _block(weights.get("block_structure"), f"{gfield}.weights.block_structure")
    acts = group.get("input_activations")
    activations = None if acts is None else _activations(acts, f"{gfield}.input_activations", block)
    return FP8Scheme("compressed-tensors", strategy, activations, block, ignore=tuple(qc.get("ignore") or ()))


def _check_kv_cache_scheme(scheme: dict, field: str) -> None:
    """The scheme whose scales an fp8 KV cache reads: one static scale per layer for keys and one for values."""
    if not isinstance(scheme, dict):
        raise ValueError(f"{field}: must be an object, got {scheme!r}")
    _check_fp8_args(scheme, field)
    if scheme.get("strategy") != "tensor" or scheme.get("dynamic"):
        raise ValueError(f"{field}.strategy: only static per-tensor scales (strategy 'tensor', dynamic false) are "
                         f"supported, got strategy {scheme.get('strategy')!r} dynamic {scheme.get('dynamic')!r}")


def _check_fp8_args(args: dict, field: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise ValueError(f"{field}: only 8-bit floats (type 'float', num_bits 8) are supported, got type "
                         f"{args.get('type')!r} num_bits {args.get('num_bits')!r}")
    if args.get("symmetric") is False:
        raise ValueError(f"{field}.symmetric: FP8 is symmetric, got false")


def _activations(acts: dict, field: str, block: tuple[int, int] | None) -> str:
    _check_fp8_args(acts, field)
    strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if strategy == "token" and dynamic:
        return "token"
    if strategy == "tensor" and not dynamic:
        return "tensor"
    if strategy == "group" and dynamic:
        if block is None or acts.get("group_size") != block[1]:
            raise ValueError(f"{field}.group_size: dynamic groups are supported with block weights, one group per "
                             f"block column ({block[1] if block else 'no block'}), got {acts.get('group_size')!r}")
        return "group"
    raise ValueError(f"{field}.strategy: {strategy!r} with dynamic {dynamic} is not supported; supported: token "
                     "(dynamic), tensor (static), group (dynamic, with block weights)")


def _block(value, field: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0
                                                                       for v in value)):
        raise ValueError(f"{field}: must be [rows, columns] of positive integers, got {value!r}")
    return value[0], value[1]


def _fp8(qc: dict) -> FP8Scheme:
    field = "quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{field}.fmt: {qc.get('fmt')!r} is not supported; supported: 'e4m3'")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"{field}.activation_scheme: must be 'dynamic' or 'static', got {act!r}")
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    if qc.get("weight_block_size") is None:
        return FP8Scheme("fp8", "tensor", "tensor" if act == "static" else "token", ignore=ignore)
    block = _block(qc["weight_block_size"], f"{field}.weight_block_size")
    if act != "dynamic":
        raise ValueError(f"{field}.activation_scheme: block-wise weights need 'dynamic' activations, got {act!r}")
    return FP8Scheme("fp8", "block", "group", block, scale_name="weight_scale_inv", ignore=ignore)
