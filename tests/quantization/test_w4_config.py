"""4-bit configs and checkpoints the engine cannot run are refused at start, naming the field and the value; the
ones it runs are read as their formats mean."""

import json

import pytest
from checkpoints import write_quantized_config
from safetensors.torch import load_file, save_file
from w4_checkpoints import W4Format, write_w4_checkpoint

from nanoserve import LLM, EngineArgs
from nanoserve.quantization.detect import detect_quantization
from nanoserve.quantization.w4_scheme import W4Scheme

GPTQ = W4Format("gptq", 128).quantization_config()
AWQ = W4Format("awq", 128, symmetric=False).quantization_config()
CT = W4Format("compressed-tensors", 128).quantization_config()


def ct_with(**weights) -> dict:
    config = json.loads(json.dumps(CT))
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize("qc, flag, message", [
    ({**GPTQ, "bits": 8}, None, "quantization_config.bits: 8 is not supported; supported: 4 (W4A16)"),
    ({**GPTQ, "group_size": 100}, None, "quantization_config.group_size: 100 is not supported; supported: -1"),
    ({**GPTQ, "checkpoint_format": "marlin"}, None, "quantization_config.checkpoint_format: 'marlin' is not "
                                                    "supported; supported: gptq, gptq_v2"),
    ({**GPTQ, "dynamic": {"-:.*down_proj": {}}}, None, "quantization_config.dynamic: per-module overrides"),
    ({**GPTQ, "lm_head": True}, None, "quantization_config.lm_head: a quantized LM head is not supported"),
    ({**AWQ, "version": "gemv"}, None, "quantization_config.version: 'gemv' is not supported; supported: gemm"),
    ({**AWQ, "zero_point": False}, None, "quantization_config.zero_point: False is not supported"),
    (AWQ, "gptq", "quantization: 'gptq' does not match the checkpoint's quantization_config.quant_method 'awq'"),
    (ct_with(num_bits=8), None, "quantization_config.config_groups.group_0.weights.num_bits: 8 is not supported"),
    (ct_with(type="float"), None, "quantization_config.config_groups.group_0.weights.type: 'float' is not "
                                  "supported; supported: 'int'"),
    (ct_with(strategy="tensor"), None, "group_0.weights.strategy: 'tensor' is not supported; supported: group, "
                                       "channel"),
    (ct_with(actorder="bogus"), None, "group_0.weights.actorder: 'bogus' is not supported"),
    ({**CT, "config_groups": {"group_0": {**CT["config_groups"]["group_0"],
                                          "input_activations": {"num_bits": 8, "type": "int"}}}}, None,
     "group_0.input_activations: quantized activations with 4-bit weights are not supported (W4A16 only)"),
])
def test_refused_config(qc, flag, message):
    with pytest.raises(ValueError) as e:
        detect_quantization({"quantization_config": qc}, flag)
    assert message in str(e.value)


def test_detected_schemes():
    assert detect_quantization({"quantization_config": GPTQ}, "gptq") == W4Scheme("gptq", 128, True, zero_offset=1)
    hugging_quants_awq = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq",
                          "version": "gemm", "zero_point": True}
    assert detect_quantization({"quantization_config": hugging_quants_awq}, None) == W4Scheme("awq", 128, False)
    assert detect_quantization({"quantization_config": ct_with(symmetric=False, actorder="group")}, None) == \
        W4Scheme("compressed-tensors", 128, False, act_order=True, ignore=("lm_head",))
    assert detect_quantization({"quantization_config": ct_with(strategy="channel", group_size=None)}, None) \
        .describe() == "w4a16 (compressed-tensors): int4 weights, symmetric, one group per row, activations " \
                       "unquantized"


def write_config(path, checkpoints, arch: str, qc: dict) -> str:
    return write_quantized_config(path, checkpoints[arch], qc)


def test_shapes_the_scheme_cannot_split_are_refused(tmp_path, checkpoints):
    with pytest.raises(ValueError, match=r"quantization_config.group_size: 128 does not divide the model's "
                                         "hidden_size 64, o_proj columns 64"):
        EngineArgs(model=write_config(tmp_path / "a", checkpoints, "llama", GPTQ), load_format="dummy").create_config()
    # At TP=2 a rank's 32 columns of o_proj are half a group of 64: refused in order, taken with act-order (every
    # rank keeps every group's scales).
    in_order = write_config(tmp_path / "b", checkpoints, "llama", W4Format("gptq", 64).quantization_config())
    with pytest.raises(ValueError, match=r"group_size: 64 does not divide the model's o_proj columns 32 per rank at "
                                         "tensor_parallel_size 2"):
        EngineArgs(model=in_order, load_format="dummy", tensor_parallel_size=2).create_config()
    act_order = W4Format("gptq", 64, act_order=True).quantization_config()
    model = write_config(tmp_path / "c", checkpoints, "llama", act_order)
    EngineArgs(model=model, load_format="dummy", tensor_parallel_size=2).create_config()


def _rewrite(ckpt, change) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    change(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def test_tensors_that_contradict_the_config_are_refused(tmp_path, checkpoints):
    ckpt, _, _ = write_w4_checkpoint(checkpoints["llama"], tmp_path / "a", W4Format("gptq", act_order=True))

    def different_orders(t):  # k_proj's columns in an order q_proj's are not
        t["model.layers.0.self_attn.k_proj.g_idx"] = t["model.layers.0.self_attn.k_proj.g_idx"].flip(0).contiguous()
    _rewrite(ckpt, different_orders)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj.g_idx differs between the stacked "
                                         "modules"):
        LLM(str(ckpt), num_kv_blocks=8)
    ckpt, _, _ = write_w4_checkpoint(checkpoints["llama"], tmp_path / "b", W4Format("gptq"))

    def asymmetric(t):
        t["model.layers.1.mlp.down_proj.qzeros"][0, 0] = 0x11111111
    _rewrite(ckpt, asymmetric)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.qzeros holds zero points other than 8, but "
                                         "the quantization_config says symmetric"):
        LLM(str(ckpt), num_kv_blocks=8)

    def wrong_shape(t):
        t["model.layers.0.mlp.down_proj.scales"] = t["model.layers.0.mlp.down_proj.scales"][:1].contiguous()
    _rewrite(ckpt, wrong_shape)
    with pytest.raises(ValueError, match=r"model: 'model.layers.0.mlp.down_proj.scales' has shape \(1, 64\), "
                                         r"expected \(4, 64\)"):
        LLM(str(ckpt), num_kv_blocks=8)
