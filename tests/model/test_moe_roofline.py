"""The mixture-of-experts roofline: a step reads the dense weights and only the experts its tokens touch."""

import pytest

from nanoserve import LLM
from nanoserve.bench import roofline


def test_weight_bytes_split_dense_and_experts(checkpoints):
    model = LLM(str(checkpoints["qwen3_moe"]), num_kv_blocks=16).engine.runner.model
    weights = roofline.weight_bytes(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # untied: no parameter shared
    experts = model.model.layers[0].mlp.experts  # layer 1 is dense (mlp_only_layers)
    assert weights.experts == (experts.w13.numel() + experts.w2.numel()) * 4
    assert weights.dense + weights.experts == total
    assert (weights.num_experts, weights.top_k) == (8, 2)
    assert weights.read_by(1) == pytest.approx(weights.dense + weights.experts * 2 / 8)
    assert weights.read_by(10_000) == pytest.approx(total)
    # A token runs through 2 of the 8 experts.
    params = sum(p.numel() for p in model.parameters())
    assert roofline.model_params(model) == pytest.approx(params - weights.expert_params * 6 / 8)


def test_dense_model_reads_every_weight_at_any_batch(checkpoints):
    model = LLM(str(checkpoints["qwen3"]), num_kv_blocks=16).engine.runner.model
    weights = roofline.weight_bytes(model)
    assert weights.experts == 0 and weights.read_by(1) == weights.read_by(256) == weights.dense


def test_expected_experts_touched_by_a_step():
    """Qwen3-30B-A3B's routing (128 experts, top 8): 10 tokens touch about 61 experts of a layer."""
    weights = roofline.WeightBytes(dense=0, experts=128, num_experts=128, top_k=8)
    assert weights.read_by(10) == pytest.approx(60.9, abs=0.1)
    assert weights.read_by(1) == pytest.approx(8)
