"""What the engine cannot run is refused at start, naming the field and the value: config.json's
quantization_config, the `quantization` flag (also through the CLI, as a user runs it), and the checkpoint's
tensors."""

import json
import os
import subprocess
import sys

import pytest
from checkpoints import write_quantized_config
from fp8_checkpoints import Format, write_fp8_checkpoint

from nanoserve import LLM, EngineArgs
from nanoserve.quantization.detect import detect_quantization
from nanoserve.quantization.scheme import FP8Scheme

CT = Format("channel", "token").quantization_config()


def with_group(**changes) -> dict:
    config = json.loads(json.dumps(CT))
    group = config["config_groups"]["group_0"]
    for path, value in changes.items():
        part, key = path.split("__")
        group[part][key] = value
    return config


@pytest.mark.parametrize("qc, flag, message", [
    ({"quant_method": "gguf"}, None,
     "quantization_config.quant_method: 'gguf' is not supported; supported: awq, compressed-tensors, fp8, gptq, mxfp4"),
    (None, "gguf", "quantization: 'gguf' is not supported; supported: awq, compressed-tensors, fp8, gptq, mxfp4"),
    (None, "compressed-tensors", "quantization: 'compressed-tensors' needs a checkpoint written in that format"),
    (CT, "fp8", "quantization: 'fp8' does not match the checkpoint's quantization_config.quant_method "
                "'compressed-tensors'"),
    ({**CT, "format": "marlin-24"}, None, "quantization_config.format: 'marlin-24' is not supported"),
    (with_group(weights__type="int"), None, "quantization_config.config_groups.group_0.weights: only 8-bit floats"),
    (with_group(weights__strategy="group"), None,
     "quantization_config.config_groups.group_0.weights.strategy: 'group' is not supported"),
    (with_group(input_activations__dynamic=False), None,
     "quantization_config.config_groups.group_0.input_activations.strategy: 'token' with dynamic False"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8}}, None, "quantization_config.kv_cache_scheme"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, None,
     "quantization_config.activation_scheme: block-wise weights need 'dynamic' activations, got 'static'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, None,
     "quantization_config.weight_block_size: must be [rows, columns] of positive integers, got [128]"),
])
def test_refused_config(qc, flag, message):
    raw = {} if qc is None else {"quantization_config": qc}
    with pytest.raises(ValueError) as e:
        detect_quantization(raw, flag)
    assert message in str(e.value)


def test_detected_schemes():
    assert detect_quantization({}, None) is None
    assert detect_quantization({"quantization_config": CT}, "compressed-tensors") == \
        FP8Scheme("compressed-tensors", "channel", "token", ignore=("lm_head",))
    qwen3_fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128]}
    assert detect_quantization({"quantization_config": qwen3_fp8}, None) == \
        FP8Scheme("fp8", "block", "group", (128, 128), scale_name="weight_scale_inv")
    static = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    assert detect_quantization({"quantization_config": static}, "fp8") == \
        FP8Scheme("fp8", "tensor", "tensor", ignore=("lm_head",))


def write_config(path, checkpoints, arch: str, qc: dict) -> str:
    return write_quantized_config(path, checkpoints[arch], qc)


def test_block_that_does_not_divide_the_shards_is_refused(tmp_path, checkpoints):
    qc = Format("block", "group", (16, 64), layout="fp8").quantization_config()
    model = write_config(tmp_path / "a", checkpoints, "llama", qc)  # o_proj: 64 columns, 32 a rank at TP=2
    EngineArgs(model=model, load_format="dummy").create_config()
    with pytest.raises(ValueError, match=r"quantization_config.weight_block_size: \[16, 64\] does not divide the "
                                         r"model's o_proj columns 32 per rank at tensor_parallel_size 2"):
        EngineArgs(model=model, load_format="dummy", tensor_parallel_size=2).create_config()
    qc["weight_block_size"] = [64, 32]
    with pytest.raises(ValueError, match=r"weight_block_size: \[64, 32\] does not divide the model's k_proj/v_proj "
                                         "rows 32"):
        EngineArgs(model=write_config(tmp_path / "b", checkpoints, "llama", qc), load_format="dummy").create_config()


def test_gpt_oss_takes_only_mxfp4(tmp_path, checkpoints):
    with pytest.raises(ValueError, match="quantization: 'fp8' for gpt-oss: its experts run as OpenAI ships them"):
        EngineArgs(model=str(checkpoints["gpt_oss"]), quantization="fp8").create_config()


def test_ignore_list_must_name_all_of_a_fused_layer(tmp_path, checkpoints):
    fmt = Format("channel", "token", ignore=("lm_head", "model.layers.0.self_attn.k_proj"))
    ckpt = write_fp8_checkpoint(checkpoints["llama"], tmp_path / "q", fmt)
    with pytest.raises(ValueError, match=r"quantization_config: the ignore list .* names some of "
                                         r"\['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.k_proj'"):
        LLM(str(ckpt), num_kv_blocks=8)


def test_unquantized_weight_in_a_quantized_checkpoint_is_refused(tmp_path, checkpoints):
    """config.json says fp8, the tensors are fp32: named, rather than silently cast."""
    model = write_config(tmp_path / "a", checkpoints, "llama", CT)
    for f in checkpoints["llama"].iterdir():
        if f.name != "config.json":
            (tmp_path / "a" / f.name).symlink_to(f)
    with pytest.raises(ValueError, match=r"model: 'model.layers.0.[a-z_.]+_proj.weight' is F32, expected "
                                         "F8_E4M3"):
        LLM(model, num_kv_blocks=8)


def test_cli_refuses_unknown_quantization(checkpoints):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-m", "nanoserve.cli", "generate", "--model", str(checkpoints["llama"]),
                          "--quantization", "gguf", "--prompt", "hi"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode != 0
    assert "quantization: 'gguf' is not supported; supported: awq, compressed-tensors, fp8, gptq, mxfp4" in run.stderr
