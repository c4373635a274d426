"""On a GPU: a gpt-oss checkpoint in MXFP4 keeps its experts packed (uint8 bytes and scales, no bf16 copy), and the
MXFP4 MoE kernels (grouped GEMMs, decode GEMVs, in CUDA graphs) give the greedy tokens of the eager PyTorch path on
the dequantized weights, fp32, for mixed-length prompts with prefix hits and preemption."""

import pytest
import torch
from mxfp4_layout import write_mxfp4_checkpoint
from prompts import mixed_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.layers.attention import TorchBackend
from nanoserve.layers.moe import FusedMoE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# head_dim 64: the attention kernels take 64 and 128; hidden and intermediate sizes whole 32-value blocks.
SHAPE = dict(hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("gpu-mxfp4") / "gpt_oss", **SHAPE)


def run(llm: LLM, num: int = 64) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(384, 48, 200, num=num), params,
                                                         use_tqdm=False)]


def eager_torch(ckpt) -> LLM:
    llm = LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=4096)
    for layer in llm.engine.runner.attn_layers:
        layer.backend = TorchBackend
    for module in llm.engine.runner.model.modules():
        if isinstance(module, FusedMoE):
            module.use_kernel = False  # its reference path: the packed weights dequantized
    return llm


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
