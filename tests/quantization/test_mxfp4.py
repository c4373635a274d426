"""gpt-oss's MXFP4 experts: the dequantization against the format's definition, and a checkpoint written in MXFP4
(as OpenAI ships gpt-oss) giving transformers' greedy tokens (transformers dequantizes it on the CPU too), under
tensor and expert parallelism as well."""

import json

import pytest
import torch
from checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from nanoserve import LLM, SamplingParams
from nanoserve.quantization.mxfp4 import dequantize_mxfp4

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def e2m1(code: int) -> float:
    """The format's definition: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if sign else magnitude


def test_dequantize_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 2), dtype=torch.uint8, generator=g)
    expected = torch.empty(3, 64)
    for r in range(3):
        for b in range(2):
            for j in range(16):
                byte, scale = int(blocks[r, b, j]), 2.0 ** (int(scales[r, b]) - 127)
                expected[r, b * 32 + 2 * j] = e2m1(byte & 15) * scale  # the low nibble comes first
                expected[r, b * 32 + 2 * j + 1] = e2m1(byte >> 4) * scale
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), expected)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), expected)  # exact in bf16


def test_dequantize_refuses_unpaired_shapes():
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.float32)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """tests/checkpoints.py's gpt-oss with every expert projection replaced by random MXFP4 blocks and scales."""
    path = write_checkpoint(tmp_path_factory.mktemp("mxfp4") / "gpt_oss", "gpt_oss", intermediate_size=64)
    (file,) = path.glob("*.safetensors")
    tensors, g = load_file(file), torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # the bf16 form is [E, in, out]; MXFP4 rows are out, blocks along in
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
        # Scales near 2^-3 keep activations in range through the layers.
        tensors[f"{name}_scales"] = torch.randint(120, 126, (e, n, k // 32), dtype=torch.uint8, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (5, 19, 40)]


@pytest.fixture(scope="module")
def reference(mxfp4_checkpoint):
    hf = AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    assert hf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32  # dequantized
    return [hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            for p in prompts()]


def test_mxfp4_checkpoint_matches_transformers(mxfp4_checkpoint, reference):
    llm = LLM(str(mxfp4_checkpoint), num_kv_blocks=32)
    assert llm.engine.config.quantization.describe().startswith("mxfp4")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == reference


@pytest.mark.usefixtures("one_thread_per_rank")
def test_mxfp4_checkpoint_split_over_two_ranks(mxfp4_checkpoint, reference):
    """Each rank's experts sliced along I: the blocks are dequantized whole, then sliced as bf16 weights are."""
    llm = LLM(str(mxfp4_checkpoint), num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.model.layers[0].mlp.experts.w2.shape[2] == 32
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == reference
    finally:
        llm.shutdown()


def test_mxfp4_refused_for_other_architectures(tmp_path):
    path = write_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method: 'mxfp4' is supported for gpt-oss"):
        LLM(str(path))
