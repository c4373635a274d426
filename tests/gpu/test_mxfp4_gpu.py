"""On a GPU: a gpt-oss checkpoint in MXFP4 keeps its experts packed (uint8 bytes and scales, no bf16 copy), and the
MXFP4 MoE kernels (grouped GEMMs, decode GEMVs, in CUDA graphs) give the greedy tokens of the eager PyTorch path on
the dequantized weights, fp32, for mixed-length prompts with prefix hits and preemption."""

import pytest
import torch
from moe_reference_engine import eager_torch, run
from mxfp4_layout import write_mxfp4_checkpoint

from nanoserve import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# head_dim 64: the attention kernels take 64 and 128; hidden and intermediate sizes whole 32-value blocks.
SHAPE = dict(hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("gpu-mxfp4") / "gpt_oss", **SHAPE)


def test_packed_kernels_match_eager_torch(ckpt, monkeypatch):
    from nanoserve.kernels import moe_gemv

    calls = []
    original = moe_gemv.moe_gemv
    monkeypatch.setattr(moe_gemv, "moe_gemv", lambda *a, **kw: calls.append(kw["w13_scale"]) or original(*a, **kw))
    reference = eager_torch(ckpt)
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=60, max_num_batched_tokens=512)
    experts = fast.engine.runner.model.model.layers[0].mlp.experts
    assert (experts.w13.dtype, tuple(experts.w13.shape), tuple(experts.w2_scale.shape)) == (
        torch.uint8, (8, 128, 64), (8, 128, 2))
    assert run(fast) == run(reference)
    assert fast.engine.scheduler.num_preemptions > 0 and fast.engine.block_manager.prefix_hits > 0
    # A sequence alone decodes through the GEMVs, handed the scales.
    assert run(fast, num=1) == run(reference, num=1)
    assert calls and all(scale is not None for scale in calls)
