"""On a GPU: a 4-bit Qwen3-MoE checkpoint (GPTQ, compressed-tensors) keeps its routed experts packed (int32s of eight
values, fp32 group scales, zero points; no 16-bit copy), and the MoE kernels' W4 variants (grouped GEMMs, decode
GEMVs, in CUDA graphs) give the greedy tokens of the eager PyTorch path on the dequantized weights and of the engine
that dequantizes them while loading, fp32; and the kernels at Qwen3-30B-A3B's shapes, groups of 128, in bf16 against
the reference on the dequantized weights."""

import pytest
import torch
from checkpoints import write_checkpoint
from moe_reference_engine import check_kept_experts, run
from w4_checkpoints import W4Format, write_w4_checkpoint

from nanoserve import LLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# head_dim 64: the attention kernels take 64 and 128. Attention left unquantized: the experts (and layer 1's dense
# MLP, a 4-bit linear layer on both sides) decide the tokens.
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
             moe_intermediate_size=64)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module", params=[W4Format("gptq", 32, symmetric=False, ignore=("self_attn",)),
                                        W4Format("compressed-tensors", 64, ignore=("self_attn",))],
                ids=["gptq-asym", "ct-sym"])
def ckpt(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-w4moe")
    src = write_checkpoint(root / "src", "qwen3_moe", **SHAPE)
    return write_w4_checkpoint(src, root / "w4", request.param)[0]


def test_w4_experts_match_eager_torch_and_dequantized(ckpt, monkeypatch):
    from nanoserve.quantization import moe_experts

    experts, want = check_kept_experts(ckpt, monkeypatch)
    assert experts.w13.dtype == torch.int32 and experts.w13_scale.dtype == torch.float32
    del experts
    monkeypatch.setattr(moe_experts, "runs_w4", lambda device: False)
    dequantized = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=60, max_num_batched_tokens=512)
    assert dequantized.engine.runner.model.model.layers[0].mlp.experts.w13.dtype == torch.float32
    assert run(dequantized) == want


@pytest.mark.parametrize("group,asymmetric", [(128, False), (128, True), (-1, False)],
                         ids=["group-sym", "group-asym", "row"])
@pytest.mark.parametrize("num_tokens", [1, 3, 300])
def test_w4_qwen3_30b_a3b(num_tokens, group, asymmetric):
    """Qwen3-30B-A3B's experts in 4 bits, rank 1 of 2 under expert parallelism: moe_gemv at one token, fused_moe
    beyond, against the reference on the dequantized bf16 weights."""
    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_gemv import moe_gemv
    from nanoserve.kernels.moe_reference import fused_moe_ref
    from nanoserve.kernels.w4_experts import dequantize_w4_experts, w4_shapes, weight_block

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i, k = 128, 2048, 768, 8

    def w4(n, fan_in):
        shape, scale_shape = w4_shapes(e // 2, n, fan_in, group)
        packed = torch.randint(-1 << 31, 1 << 31, shape, generator=gen, device="cuda", dtype=torch.int64)
        # positive scales, about where trained layers' weights are (fan_in^-0.5)
        scales = (torch.rand(scale_shape, generator=gen, device="cuda") + 0.5) / (8 * fan_in**0.5)
        zeros = (torch.randint(0, 17, scale_shape, generator=gen, device="cuda").to(torch.uint8)
                 if asymmetric else None)
        return packed.to(torch.int32), scales, zeros

    (w13, s13, z13), (w2, s2, z2) = w4(2 * i, h), w4(h, i)
    v13 = dequantize_w4_experts(w13, s13, z13, group, torch.bfloat16)
    v2 = dequantize_w4_experts(w2, s2, z2, group, torch.bfloat16)
    x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
    logits = torch.randn(num_tokens, e, generator=gen, device="cuda")
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    run = moe_gemv if num_tokens == 1 else fused_moe
    out = run(x, w13, w2, weights, ids.int(), expert_start=e // 2, w13_scale=s13, w2_scale=s2,
              weight_block=weight_block(group), w13_zeros=z13, w2_zeros=z2)
    torch.testing.assert_close(out, fused_moe_ref(x, v13, v2, weights, ids, expert_start=e // 2), **BF16_TOL)
