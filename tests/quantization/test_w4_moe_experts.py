"""4-bit routed experts kept packed (quantization/moe_experts.py's keep_w4, as on CUDA; forced here on the CPU through
moe_experts.runs_w4, where the layer's reference path dequantizes them each step): GPTQ, AWQ and compressed-tensors
experts hold exactly the weights that dequantizing them while loading gives, and the same tokens; a rank holds its
share; act-order and a split that cuts a group dequantize instead, with a warning; random weights are random packed
values; the start-up line says which."""

import logging

import pytest
import torch
from w4_checkpoints import W4Format, write_w4_checkpoint

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve import config as config_module
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.moe import FusedMoE
from nanoserve.model.loader import load_model
from nanoserve.quantization import moe_experts

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
GPTQ = W4Format("gptq", 16, symmetric=False)


def _experts(path, monkeypatch, kept: bool, tp: TensorParallelGroup | None = None, **args) -> FusedMoE:
    monkeypatch.setattr(moe_experts, "runs_w4", lambda device: kept)
    config = EngineArgs(model=str(path), tensor_parallel_size=tp.size if tp else 1, **args).create_config()
    return load_model(config, tp).model.layers[0].mlp.experts


@pytest.fixture(scope="module")
def gptq_checkpoint(checkpoints, tmp_path_factory):
    return write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path_factory.mktemp("w4moe"), GPTQ)[0]


@pytest.mark.parametrize("fmt", [GPTQ, W4Format("awq", 32, symmetric=False), W4Format("compressed-tensors", 16),
                                 W4Format("gptq", -1)], ids=["gptq-asym", "awq", "ct-sym", "gptq-per-row"])
def test_kept_experts_hold_the_dequantized_weights(checkpoints, tmp_path, monkeypatch, fmt):
    ckpt = write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path, fmt)[0]
    dequantized = _experts(ckpt, monkeypatch, kept=False)
    experts = _experts(ckpt, monkeypatch, kept=True)
    groups = 1 if fmt.group_size == -1 else 64 // fmt.group_size
    assert experts.w13.dtype == torch.int32 and tuple(experts.w13.shape) == (8, 64, 64 // 8)
    assert experts.w13_scale.shape[:2] == (8, 64) and experts.w13_scale.numel() == 8 * 64 * groups
    assert (experts.w13_zeros is None) == fmt.symmetric
    w13, w2 = experts.reference_weights(torch.float32)
    assert torch.equal(w13, dequantized.w13) and torch.equal(w2, dequantized.w2)


def test_kept_experts_give_the_dequantized_tokens(gptq_checkpoint, monkeypatch):
    prompts = [[5, 9, 100, 7], list(range(20, 45))]
    want = [o.outputs[0].token_ids for o in LLM(str(gptq_checkpoint), num_kv_blocks=32).generate(
        prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setattr(moe_experts, "runs_w4", lambda device: True)
    monkeypatch.setattr(config_module, "runs_w4", lambda device: True)  # the start-up line's reading of it
    llm = LLM(str(gptq_checkpoint), num_kv_blocks=32)
    assert "(routed experts kept packed in 4 bits, weight-only)" in llm.engine.config.summary(32)
    assert llm.engine.runner.model.model.layers[0].mlp.experts.w2.dtype == torch.int32
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want


@pytest.mark.parametrize("rank,expert_parallel", [(1, False), (1, True)])
def test_kept_rank_holds_its_share(gptq_checkpoint, monkeypatch, rank, expert_parallel):
    """Tensor parallel: rows 16..31 of I (gate's and up's), columns 16..31 (down's: one group of 16); expert
    parallel: experts 4..7."""
    whole = _experts(gptq_checkpoint, monkeypatch, kept=False)
    part = _experts(gptq_checkpoint, monkeypatch, True, TensorParallelGroup(rank=rank, size=2),
                    enable_expert_parallel=expert_parallel)
    assert part.w13.dtype == torch.int32
    w13, w2 = part.reference_weights(torch.float32)
    if expert_parallel:
        assert torch.equal(w13, whole.w13[4:]) and torch.equal(w2, whole.w2[4:])
    else:
        assert torch.equal(w13, torch.cat([whole.w13[:, 16:32], whole.w13[:, 48:64]], dim=1))
        assert torch.equal(w2, whole.w2[:, :, 16:32])


@pytest.mark.parametrize("fmt,reason", [(W4Format("gptq", 32, symmetric=False), "not whole groups of 32"),
                                        (W4Format("gptq", 16, act_order=True), "act-order")],
                         ids=["cut-group", "act-order"])
def test_what_the_kernels_cannot_take_dequantizes(checkpoints, tmp_path, monkeypatch, caplog, fmt, reason):
    """Groups of 32 over I = 32 at TP=2 (16 a rank) cut a group of down's columns; act-order groups are not runs
    of columns. Either way the experts are dequantized while loading, with a warning, and hold their weights."""
    ckpt = write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path, fmt)[0]
    whole = _experts(ckpt, monkeypatch, kept=False)
    tp = TensorParallelGroup(rank=1, size=2) if not fmt.act_order else None
    with caplog.at_level(logging.WARNING):
        part = _experts(ckpt, monkeypatch, True, tp)
    assert "4-bit experts dequantized while loading" in caplog.text and reason in caplog.text
    assert part.w13.dtype == torch.float32 and part.w13_scale is None
    assert torch.equal(part.w2, whole.w2[:, :, 16:] if tp else whole.w2)


def test_random_weights_are_random_packed_values(gptq_checkpoint, monkeypatch):
    """--load-format dummy: packed experts with every bit random (valid 4-bit values), scales of w4_linear's
    DUMMY_SCALE and zero points of 8, so a bench run needs no weights; a rank's share is a slice of TP=1's."""
    whole = _experts(gptq_checkpoint, monkeypatch, True, load_format="dummy")
    part = _experts(gptq_checkpoint, monkeypatch, True, TensorParallelGroup(rank=1, size=2), load_format="dummy")
    assert whole.w13.dtype == torch.int32 and len(whole.w13.unique()) > 1000
    assert torch.all(whole.w13_zeros == 8) and torch.all(whole.w2_scale == whole.w2_scale.flatten()[0])
    assert torch.equal(part.w13, torch.cat([whole.w13[:, 16:32], whole.w13[:, 48:64]], dim=1))
    assert torch.equal(part.w2, whole.w2[:, :, 2:4])
    w13, w2 = whole.reference_weights(torch.float32)
    assert w13.abs().max() <= 0.02 + 1e-6 and w2.abs().max() > 0
    # The roofline counts weights, eight an int32 (the scales and zero points none): gate, up and down of 8 experts.
    assert whole.num_weights() == 8 * 3 * 64 * 32


def test_start_up_line_says_dequantized_where_a_split_cuts_groups(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(config_module, "runs_w4", lambda device: True)
    ckpt = write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path, W4Format("gptq", 32, symmetric=False))[0]
    for args, kept in (({"tensor_parallel_size": 2}, False), ({}, True),
                       ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, True)):
        line = EngineArgs(model=str(ckpt), **args).create_config().summary(32)
        assert ("(routed experts kept packed in 4 bits, weight-only)" in line) == kept, args


def test_start_up_line_says_which_ranks_keep_them(checkpoints, tmp_path, monkeypatch):
    """A TP split whose shares cut groups on some ranks only (e.g. I = 576 in groups of 128 at TP=3: the last rank's
    share starts on a group and ends the experts): the line says how many keep them packed."""
    monkeypatch.setattr(config_module, "runs_w4", lambda device: True)
    monkeypatch.setattr(config_module, "w4_experts_fit", lambda scheme, start, size, total: start > 0)
    ckpt = write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path, W4Format("gptq", 32, symmetric=False))[0]
    line = EngineArgs(model=str(ckpt), tensor_parallel_size=2).create_config().summary(32)
    assert "(routed experts kept packed in 4 bits on 1 of 2 ranks, dequantized while loading on the others)" in line
