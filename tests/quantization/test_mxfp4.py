"""gpt-oss's MXFP4 experts: the dequantization against the format's definition, and a checkpoint written in MXFP4
(as OpenAI ships gpt-oss) giving transformers' greedy tokens (transformers dequantizes it on the CPU too), under
tensor and expert parallelism as well; kept packed (as on CUDA, forced here on the CPU through mxfp4.runs_packed),
each rank's share of the bytes and scales is the share of the dequantized weights, and the roofline counts 4.25 bits
a weight."""

import json

import pytest
import torch
from checkpoints import write_checkpoint
from mxfp4_layout import write_mxfp4_checkpoint
from transformers import AutoModelForCausalLM, Mxfp4Config

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.bench import roofline
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.model.gpt_oss import DUMMY_SCALE, GptOssExperts
from nanoserve.model.loader import load_model
from nanoserve.quantization import mxfp4
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
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4") / "gpt_oss", intermediate_size=64)


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


@pytest.fixture
def packed(monkeypatch):
    """MXFP4 experts kept packed on the CPU, as on CUDA (their forward there dequantizes them for the reference)."""
    monkeypatch.setattr(mxfp4, "runs_packed", lambda device: True)


@pytest.mark.usefixtures("packed")
def test_packed_checkpoint_matches_transformers(mxfp4_checkpoint, reference):
    llm = LLM(str(mxfp4_checkpoint), num_kv_blocks=32)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert (experts.w13.dtype, experts.w13.shape, experts.w2_scale.shape) == (torch.uint8, (8, 128, 32), (8, 64, 2))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == reference


@pytest.mark.usefixtures("packed")
@pytest.mark.parametrize("rank,expert_parallel", [(0, False), (1, False), (1, True)])
def test_packed_rank_holds_its_share(mxfp4_checkpoint, monkeypatch, rank, expert_parallel):
    """A rank's packed bytes and scales hold its share of the weights: the rows of I (tensor parallel, 32 of 64, one
    block of w2's K) or the experts (expert parallel, 4..7 of 8) of the dequantized model."""
    monkeypatch.setattr(mxfp4, "runs_packed", lambda device: False)
    whole = load_model(EngineArgs(model=str(mxfp4_checkpoint)).create_config()).model.layers[1].mlp.experts
    monkeypatch.setattr(mxfp4, "runs_packed", lambda device: True)
    config = EngineArgs(model=str(mxfp4_checkpoint), tensor_parallel_size=2,
                        enable_expert_parallel=expert_parallel).create_config()
    part = load_model(config, TensorParallelGroup(rank=rank, size=2)).model.layers[1].mlp.experts
    w13, w2 = part.reference_weights(torch.float32)
    if expert_parallel:
        assert torch.equal(w13, whole.w13[4:]) and torch.equal(w2, whole.w2[4:])
        assert torch.equal(part.w13_bias, whole.w13_bias[4:]) and torch.equal(part.w2_bias, whole.w2_bias[4:])
    else:
        i = slice(32 * rank, 32 * rank + 32)
        assert torch.equal(w13, torch.cat([whole.w13[:, i], whole.w13[:, 64 + i.start:64 + i.stop]], dim=1))
        assert torch.equal(w2, whole.w2[:, :, i])
        assert torch.equal(part.w13_bias, torch.cat([whole.w13_bias[:, i], whole.w13_bias[:, 64 + i.start:64 + i.stop]],
                                                    dim=1))


@pytest.mark.usefixtures("packed")
def test_packed_bytes_in_the_roofline(mxfp4_checkpoint, monkeypatch):
    """Packed experts count 4.25 bits a weight (and their bf16 biases), as many parameters as dequantized ones."""
    model = load_model(EngineArgs(model=str(mxfp4_checkpoint)).create_config())
    monkeypatch.setattr(mxfp4, "runs_packed", lambda device: False)
    unpacked = roofline.weight_bytes(load_model(EngineArgs(model=str(mxfp4_checkpoint)).create_config()))
    weights = roofline.weight_bytes(model)
    experts = [layer.mlp.experts for layer in model.model.layers]
    values = sum(e.w13.numel() * 2 + e.w2.numel() * 2 for e in experts)
    biases = sum(e.w13_bias.numel() * e.w13_bias.element_size() + e.w2_bias.nbytes for e in experts)
    assert weights.experts == values * 4.25 / 8 + biases
    assert weights.expert_params == unpacked.expert_params and weights.dense == unpacked.dense
    assert roofline.model_params(model) == pytest.approx(roofline.model_params(
        load_model(EngineArgs(model=str(mxfp4_checkpoint)).create_config())))


@pytest.mark.usefixtures("packed")
def test_packed_random_weights_shard_like_a_checkpoint(mxfp4_checkpoint):
    """--load-format dummy: random blocks drawn whole (rank 1 keeps its rows and blocks), scales a constant 2^-8."""
    whole = load_model(EngineArgs(model=str(mxfp4_checkpoint), load_format="dummy").create_config())
    config = EngineArgs(model=str(mxfp4_checkpoint), load_format="dummy", tensor_parallel_size=2).create_config()
    half = load_model(config, TensorParallelGroup(rank=1, size=2))
    experts, experts1 = whole.model.layers[0].mlp.experts, half.model.layers[0].mlp.experts
    assert experts1.w2.dtype == torch.uint8 and torch.equal(experts1.w2, experts.w2[:, :, 16:])
    assert torch.equal(experts1.w13[:, :32], experts.w13[:, 32:64])  # gate rows 32..63
    assert (experts1.w13_scale == DUMMY_SCALE).all() and (experts1.w2_scale == DUMMY_SCALE).all()
    assert experts.w13.unique().numel() > 200  # random bytes


def test_a_split_that_cuts_blocks_dequantizes():
    """I = 64 over 4 ranks is 16 a rank: w2's K would split a 32-value block, so that rank dequantizes while loading
    (any split works so)."""
    experts = GptOssExperts(8, 64, 64, TensorParallelGroup(rank=1, size=4), False, top_k=2)
    experts.expect_mxfp4(True, torch.device("cpu"))
    assert experts.mxfp4 and not experts.packed
    halves = GptOssExperts(8, 64, 64, TensorParallelGroup(rank=1, size=2), False, top_k=2)
    halves.expect_mxfp4(True, torch.device("cpu"))
    assert halves.packed and halves.w2.dtype == torch.uint8


def test_mxfp4_refused_for_other_architectures(tmp_path):
    path = write_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method: 'mxfp4' is supported for gpt-oss"):
        LLM(str(path))
