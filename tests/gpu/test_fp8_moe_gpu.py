"""On a GPU: an FP8 Qwen3-MoE checkpoint keeps its routed experts in FP8 (float8_e4m3fn values and fp32 scales, no
16-bit copy), and the MoE kernels' FP8 variants (grouped GEMMs, decode GEMVs, in CUDA graphs) give the greedy tokens
of the eager PyTorch path on the dequantized weights, fp32; and the kernels at Qwen3-30B-A3B's shapes, 128 x 128
blocks and per-row scales, in bf16 against the reference on the dequantized weights."""

import pytest
import torch
from checkpoints import write_checkpoint
from fp8_checkpoints import Format, write_fp8_checkpoint
from moe_reference_engine import check_kept_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU of compute capability 8.9 or later (e4m3 in Triton)")

# head_dim 64: the attention kernels take 64 and 128. Only the experts quantized: they alone decide the tokens.
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
             moe_intermediate_size=64)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module", params=[(16, 16), None], ids=["block", "channel"])
def ckpt(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-fp8moe")
    src = write_checkpoint(root / "src", "qwen3_moe", **SHAPE)
    block = request.param
    fmt = (Format("block", "group", block, layout="fp8", ignore=("re:^(?!.*experts).*",)) if block else
           Format("channel", None, ignore=("re:^(?!.*experts).*",)))
    return write_fp8_checkpoint(src, root / "fp8", fmt)


def test_fp8_experts_match_eager_torch(ckpt, monkeypatch):
    experts, _ = check_kept_experts(ckpt, monkeypatch)
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w13_scale.dtype == torch.float32


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "row"])
@pytest.mark.parametrize("num_tokens", [1, 3, 300])
def test_fp8_qwen3_30b_a3b(num_tokens, block):
    """Qwen3-30B-A3B's experts in FP8, rank 1 of 2 under expert parallelism: moe_gemv at one token, fused_moe
    beyond, against the reference on the dequantized bf16 weights."""
    from nanoserve.kernels.fp8_experts import dequantize_fp8_experts, scale_shape, stacked_scale_shape
    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_gemv import moe_gemv
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i, k = 128, 2048, 768, 8

    def fp8(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)

    def scales(shape, fan_in):  # positive, about where trained layers' weights are (fan_in^-0.5)
        return (torch.rand(shape, generator=gen, device="cuda") + 0.5) / (64 * fan_in**0.5)

    w13, w2 = fp8(e // 2, 2 * i, h), fp8(e // 2, h, i)
    s13, s2 = scales(stacked_scale_shape(e // 2, i, h, block), h), scales(scale_shape(e // 2, h, i, block), i)
    v13 = dequantize_fp8_experts(w13, s13, block, torch.bfloat16, stacked=True)
    v2 = dequantize_fp8_experts(w2, s2, block, torch.bfloat16)
    x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
    logits = torch.randn(num_tokens, e, generator=gen, device="cuda")
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    run = moe_gemv if num_tokens == 1 else fused_moe
    out = run(x, w13, w2, weights, ids.int(), expert_start=e // 2, w13_scale=s13, w2_scale=s2, weight_block=block)
    torch.testing.assert_close(out, fused_moe_ref(x, v13, v2, weights, ids, expert_start=e // 2), **BF16_TOL)
