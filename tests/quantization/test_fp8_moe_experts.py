"""FP8 routed experts kept in FP8 (quantization/moe_experts.py's keep_fp8, as on CUDA; forced here on the CPU through
moe_experts.runs_fp8, where the layer's reference path dequantizes them each step): a Qwen3-MoE FP8 checkpoint gives
the tokens of its experts dequantized while loading, each rank's fp8 values and scales are its share of those
weights, a split that cuts blocks of scales dequantizes instead, random weights are random fp8 values, and the
roofline counts a byte a weight plus the scales."""

import logging
import shutil

import pytest
import torch
from fp8_checkpoints import Format, write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve import config as config_module
from nanoserve.bench import roofline
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.moe import FusedMoE
from nanoserve.model.loader import load_model
from nanoserve.quantization import moe_experts
from nanoserve.quantization.fp8_linear import DUMMY_SCALE
from nanoserve.quantization.scheme import FP8Scheme

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Qwen3-FP8's layout (quant_method fp8, weight_scale_inv, dynamic per-group activations) in 16 x 16 blocks, and
# compressed-tensors' per-channel weights with static activations (W8A8: the experts run weight-only either way).
BLOCK = Format("block", "group", (16, 16), layout="fp8")
CHANNEL = Format("channel", None)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 30)]


@pytest.fixture(scope="module")
def block_checkpoint(checkpoints, tmp_path_factory):
    return write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path_factory.mktemp("fp8moe") / "block", BLOCK)


@pytest.fixture
def kept(monkeypatch):
    """FP8 experts kept in FP8 on the CPU, as on CUDA."""
    monkeypatch.setattr(moe_experts, "runs_fp8", lambda device: True)


def _experts(path, monkeypatch, fp8: bool, tp: TensorParallelGroup | None = None, **args) -> FusedMoE:
    monkeypatch.setattr(moe_experts, "runs_fp8", lambda device: fp8)
    config = EngineArgs(model=str(path), tensor_parallel_size=tp.size if tp else 1, **args).create_config()
    return load_model(config, tp).model.layers[0].mlp.experts


def test_kept_experts_give_the_dequantized_tokens(block_checkpoint, monkeypatch):
    want = [o.outputs[0].token_ids for o in LLM(str(block_checkpoint), num_kv_blocks=32).generate(
        prompts(), GREEDY, use_tqdm=False)]
    monkeypatch.setattr(moe_experts, "runs_fp8", lambda device: True)
    monkeypatch.setattr(config_module, "runs_fp8", lambda device: True)  # the start-up line's reading of it
    llm = LLM(str(block_checkpoint), num_kv_blocks=32)
    assert "(routed experts kept in fp8, weight-only)" in llm.engine.config.summary(32)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    # w13's scales: gate's 2 rows of 16 x 16 blocks, then up's.
    assert (experts.w13.dtype, experts.w2.dtype, tuple(experts.w13_scale.shape)) == (FP8, FP8, (8, 4, 4))
    assert experts.weight_block == (16, 16)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)] == want


@pytest.mark.parametrize("fmt", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_kept_experts_hold_the_dequantized_weights(checkpoints, tmp_path, monkeypatch, fmt):
    """Per block, or per channel (one scale a row of gate, of up and of down)."""
    ckpt = write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path, fmt)
    dequantized = _experts(ckpt, monkeypatch, fp8=False)
    experts = _experts(ckpt, monkeypatch, fp8=True)
    assert experts.w13_scale.shape == ((8, 4, 4) if fmt is BLOCK else (8, 64))
    w13, w2 = experts.reference_weights(torch.float32)
    assert torch.equal(w13, dequantized.w13) and torch.equal(w2, dequantized.w2)


@pytest.mark.parametrize("rank,expert_parallel", [(0, False), (1, False), (1, True)])
def test_kept_rank_holds_its_share(block_checkpoint, monkeypatch, rank, expert_parallel):
    """A rank's fp8 values and scales hold its share of the dequantized weights: the rows of I (tensor parallel, 16
    of 32: one block of rows of gate and of up, of columns of down) or the experts (expert parallel, 4..7 of 8)."""
    whole = _experts(block_checkpoint, monkeypatch, fp8=False)
    part = _experts(block_checkpoint, monkeypatch, True, TensorParallelGroup(rank=rank, size=2),
                    enable_expert_parallel=expert_parallel)
    assert part.w13.dtype == FP8 and part.w13_scale.shape[1] == (4 if expert_parallel else 2)
    w13, w2 = part.reference_weights(torch.float32)
    if expert_parallel:
        assert torch.equal(w13, whole.w13[4:]) and torch.equal(w2, whole.w2[4:])
    else:
        i = slice(16 * rank, 16 * rank + 16)
        assert torch.equal(w13, torch.cat([whole.w13[:, i], whole.w13[:, 32 + i.start:32 + i.stop]], dim=1))
        assert torch.equal(w2, whole.w2[:, :, i])


def test_a_split_that_cuts_blocks_dequantizes(checkpoints, tmp_path, monkeypatch, caplog):
    """32 x 32 blocks over I = 32 at TP=2 (16 a rank): that rank's experts are dequantized while loading, with a
    warning, and hold their share of the weights all the same."""
    ckpt = write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path, Format("block", "group", (32, 32), layout="fp8"))
    whole = _experts(ckpt, monkeypatch, fp8=False)
    with caplog.at_level(logging.WARNING):
        part = _experts(ckpt, monkeypatch, True, TensorParallelGroup(rank=1, size=2))
    assert "FP8 experts dequantized while loading" in caplog.text
    assert part.w13.dtype == torch.float32 and part.w13_scale is None
    assert torch.equal(part.w2, whole.w2[:, :, 16:])
    scheme = FP8Scheme("fp8", "block", "group", (16, 16))
    assert moe_experts.fits_fp8(FusedMoE(8, 64, 32, TensorParallelGroup(rank=1, size=2), False, 2), scheme)
    assert not moe_experts.fits_fp8(FusedMoE(8, 64, 48, TensorParallelGroup(rank=1, size=2), False, 2), scheme)
    assert moe_experts.fits_fp8(FusedMoE(8, 64, 48, TensorParallelGroup(rank=1, size=2), True, 2), scheme)


def test_start_up_line_says_dequantized_where_a_split_cuts_blocks(checkpoints, tmp_path, monkeypatch):
    """The start-up line claims fp8 experts only where every rank keeps them: 32 x 32 blocks over I = 32 at TP=2 cut
    them (each rank dequantizes), expert parallelism or TP=1 does not."""
    monkeypatch.setattr(config_module, "runs_fp8", lambda device: True)
    ckpt = write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path, Format("block", "group", (32, 32), layout="fp8"))
    for args, kept in (({"tensor_parallel_size": 2}, False), ({}, True),
                       ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, True)):
        line = EngineArgs(model=str(ckpt), **args).create_config().summary(32)
        assert ("(routed experts kept in fp8, weight-only)" in line) == kept, (args, line)
        assert ("(routed experts dequantized while loading" in line) != kept, (args, line)


@pytest.mark.usefixtures("kept")
def test_random_fp8_experts_shard_like_a_checkpoint(block_checkpoint):
    """--load-format dummy: random fp8 values drawn whole (rank 1 keeps its rows and columns), scales DUMMY_SCALE."""
    whole = load_model(EngineArgs(model=str(block_checkpoint), load_format="dummy").create_config())
    config = EngineArgs(model=str(block_checkpoint), load_format="dummy", tensor_parallel_size=2).create_config()
    half = load_model(config, TensorParallelGroup(rank=1, size=2))
    experts, experts1 = whole.model.layers[0].mlp.experts, half.model.layers[0].mlp.experts
    assert experts1.w2.dtype == FP8 and torch.equal(experts1.w2.float(), experts.w2.float()[:, :, 16:])
    assert torch.equal(experts1.w13.float()[:, :16], experts.w13.float()[:, 16:32])  # gate rows 16..31
    assert (experts1.w13_scale == DUMMY_SCALE).all() and (experts1.w2_scale == DUMMY_SCALE).all()
    # Random values (fp8_linear's dummy weights: uniform in +-0.02, which e4m3 holds as 21 values).
    assert experts.w13.float().unique().numel() > 15


def test_fp8_bytes_in_the_roofline(block_checkpoint, monkeypatch):
    """Kept experts count a byte a weight and 4 a scale, as many parameters as dequantized ones."""
    model = load_model(EngineArgs(model=str(block_checkpoint)).create_config())
    monkeypatch.setattr(moe_experts, "runs_fp8", lambda device: True)
    kept = load_model(EngineArgs(model=str(block_checkpoint)).create_config())
    experts = [m for m in kept.modules() if isinstance(m, FusedMoE)]
    weights, dequantized = roofline.weight_bytes(kept), roofline.weight_bytes(model)
    assert weights.experts == sum(e.w13.numel() + e.w2.numel() + 4 * (e.w13_scale.numel() + e.w2_scale.numel())
                                  for e in experts)
    assert dequantized.experts == 4 * sum(e.w13.numel() + e.w2.numel() for e in experts)  # fp32 on the CPU
    assert weights.expert_params == dequantized.expert_params and weights.dense == dequantized.dense


@pytest.mark.usefixtures("kept")
def test_missing_or_misshapen_scales_are_named(block_checkpoint, tmp_path):
    tensors = load_file(block_checkpoint / "model.safetensors")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(block_checkpoint, ckpt)
    scale = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    save_file({k: v for k, v in tensors.items() if k != scale}, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="expert projection up:3 lacks weight_scale_inv"):
        LLM(str(ckpt), num_kv_blocks=16)
    save_file(tensors | {scale: tensors[scale][:1]}, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj.weight_scale_inv' has shape \(1, 4\), expected \(2, 4\)"):
        LLM(str(ckpt), num_kv_blocks=16)
