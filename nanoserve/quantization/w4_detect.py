"""config.json's quantization_config of a 4-bit weight-only checkpoint -> W4Scheme, refusing at start, with the
field and the value, what the engine does not run.

Read:
- quant_method "gptq" (AutoGPTQ, GPTQModel): bits 4, group_size (-1: one group per row), sym, desc_act (act-order:
  the g_idx tensor gives each input column's group), checkpoint_format "gptq" (zeros stored minus one) or "gptq_v2";
- quant_method "awq" (AutoAWQ): bits 4, group_size, zero_point true, version "gemm" (the packing of the GEMM kernels;
  "gemv" packs differently), modules_to_not_convert;
- quant_method "compressed-tensors", format "pack-quantized": one config group targeting "Linear" whose weights are
  4-bit ints, strategy "group" or "channel", symmetric or not, actorder none, "weight" (no g_idx) or "group"
  (weight_g_idx), and no input activations (W4A16); its `ignore` list.
"""

from nanoserve.quantization.w4_scheme import W4Scheme

FIELD = "quantization_config"


def _bits(value, field: str) -> None:
    if value != 4:
        raise ValueError(f"{field}: {value!r} is not supported; supported: 4 (W4A16)")


def _group_size(value, field: str) -> int:
    # The W4A16 kernel multiplies a tile of 16 or more input columns by one group's scales (kernels/w4a16_gemm.py).
    if value == -1 or (isinstance(value, int) and value > 0 and value % 16 == 0):
        return value
    raise ValueError(f"{field}: {value!r} is not supported; supported: -1 (one group per row) or a multiple of 16")


def gptq(qc: dict) -> W4Scheme:
    _bits(qc.get("bits"), f"{FIELD}.bits")
    group = _group_size(qc.get("group_size", -1), f"{FIELD}.group_size")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{FIELD}.checkpoint_format: {fmt!r} is not supported; supported: gptq, gptq_v2")
    if qc.get("dynamic"):
        raise ValueError(f"{FIELD}.dynamic: per-module overrides are not supported, got {qc['dynamic']!r}")
    if qc.get("lm_head"):
        raise ValueError(f"{FIELD}.lm_head: a quantized LM head is not supported (true)")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise ValueError(f"{FIELD}.sym: must be true or false, got {sym!r}")
    # The original format stores each zero point minus one (AutoGPTQ's packing); gptq_v2 stores it as it is.
    return W4Scheme("gptq", group, sym, act_order=bool(qc.get("desc_act")), zero_offset=1 if fmt == "gptq" else 0,
                    ignore=tuple(qc.get("modules_to_not_convert") or ()))


def awq(qc: dict) -> W4Scheme:
    _bits(qc.get("bits", qc.get("w_bit")), f"{FIELD}.bits")
    group = _group_size(qc.get("group_size", qc.get("q_group_size")), f"{FIELD}.group_size")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{FIELD}.version: {qc.get('version')!r} is not supported; supported: gemm (GEMV and "
                         "other versions pack their weights differently)")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{FIELD}.zero_point: {qc.get('zero_point')!r} is not supported; supported: true")
    return W4Scheme("awq", group, symmetric=False, ignore=tuple(qc.get("modules_to_not_convert") or ()))


def pack_quantized(qc: dict, gname: str, group: dict) -> W4Scheme:
    """compressed-tensors' pack-quantized group `gname` (detect.py checked the group count, targets and the rest of
    the config)."""
    gfield = f"{FIELD}.config_groups.{gname}"
    weights = group.get("weights") or {}
    wfield = f"{gfield}.weights"
    if weights.get("type") != "int":
        raise ValueError(f"{wfield}.type: {weights.get('type')!r} is not supported; supported: 'int'")
    _bits(weights.get("num_bits"), f"{wfield}.num_bits")
    if group.get("input_activations"):
        raise ValueError(f"{gfield}.input_activations: quantized activations with 4-bit weights are not supported "
                         "(W4A16 only)")
    if weights.get("dynamic"):
        raise ValueError(f"{wfield}.dynamic: weights must be quantized in the checkpoint (false)")
    strategy = weights.get("strategy")
    if strategy == "group":
        size = _group_size(weights.get("group_size"), f"{wfield}.group_size")
    elif strategy == "channel":
        size = -1
    else:
        raise ValueError(f"{wfield}.strategy: {strategy!r} is not supported; supported: group, channel")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{wfield}.symmetric: must be true or false, got {symmetric!r}")
    actorder = weights.get("actorder")
    # "weight" (alias "static") only ordered the quantizer's work, groups stay contiguous; "group" (alias
    # "dynamic") stores weight_g_idx.
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise ValueError(f"{wfield}.actorder: {actorder!r} is not supported; supported: null, weight, group")
    act_order = actorder in ("group", "dynamic")
    if act_order and strategy != "group":
        raise ValueError(f"{wfield}.actorder: {actorder!r} needs strategy 'group', got {strategy!r}")
    return W4Scheme("compressed-tensors", size, symmetric, act_order, ignore=tuple(qc.get("ignore") or ()))
