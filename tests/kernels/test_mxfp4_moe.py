"""The MoE kernels' MXFP4 weights (kernels/mxfp4_unpack.py's layout, unpacked in registers) against
kernels/moe_reference.py on the weights dequantize_mxfp4 gives: fused_moe's grouped GEMMs and moe_gemv's GEMVs, with
gpt-oss's biases and activation and under expert parallelism."""

import pytest
import torch
from moe_cases import MOE_TOL, check_against_reference, routing
from mxfp4_layout import random_mxfp4

from nanoserve.kernels.fused_moe import GemmConfig, MoeConfig, fused_moe, fused_moe_with_config
from nanoserve.kernels.moe_gemv import moe_gemv, moe_gemv_down, moe_gemv_gate_up
from nanoserve.kernels.rms_norm import rms_norm_ref

# Multiples of the 32-value block that the default tiles do not all divide (gate/up's 64- and 128-column tiles over
# 96 are masked, down's over 64 are not).
HIDDEN, INTER = 96, 64




def _experts(num_experts, dtype, device, gen, bias, hidden=HIDDEN, inter=INTER):
    """MXFP4 w13 and w2 with their scales (kernel arguments), the values they hold (fp32), and biases in dtype."""
    w13, s13, v13 = random_mxfp4(num_experts, 2 * inter, hidden, gen)
    w2, s2, v2 = random_mxfp4(num_experts, hidden, inter, gen)
    biases = [torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen)]
    b13, b2 = [b.to(device, dtype) for b in biases] if bias else (None, None)
    packed = dict(w13_scale=s13.to(device), w2_scale=s2.to(device), w13_bias=b13, w2_bias=b2)
    return w13.to(device), w2.to(device), packed, (v13.to(device), v2.to(device))


def _input(num_tokens, dtype, device, gen, hidden=HIDDEN):
    # Scaled so that gate and up (weights up to 6 * 2^3) stay within a few units: swigluoai's clamps cut some.
    return (torch.randn(num_tokens, hidden, generator=gen) * 0.5 / hidden**0.5).to(device, dtype)


def _check(out, x, values, weights, ids, kw, x_ref=None):
    """The same (rounded) biases too; the scales' range (2^-7..2^3) spreads the outputs over magnitudes."""
    check_against_reference(out, x, values, weights, ids, x_ref, **{k: v for k, v in kw.items()
                                                                     if not k.endswith("_scale")})


# 16-row blocks (T * k <= 16 E) and 64-row ones; fp32 and fp16; gpt-oss's activation with biases and SiLU without;
# the middle rank of three under expert parallelism (experts 4..7 of 12).
@pytest.mark.parametrize("num_tokens,top_k,dtype,activation,bias,expert_start",
                         [(3, 2, torch.float32, "swigluoai", True, 0), (40, 2, torch.float16, "silu", False, 0),
                          (5, 2, torch.float16, "swigluoai", True, 4), (40, 4, torch.float32, "swigluoai", True, 4)])
def test_fused_moe_mxfp4(device, gen, num_tokens, top_k, dtype, activation, bias, expert_start):
    w13, w2, kw, values = _experts(4, dtype, device, gen, bias)
    kw.update(expert_start=expert_start, activation=activation)
    x = _input(num_tokens, dtype, device, gen)
    ids, weights = routing(num_tokens, top_k, 4 + 2 * expert_start, gen, device)
    if expert_start:
        ids[0] = torch.tensor([0, 11, 1, 10][:top_k])  # routed only to other ranks' experts: zeros
    out = fused_moe(x, w13, w2, weights, ids, **kw)
    _check(out, x, values, weights, ids, kw)
    assert out.abs().sum() > 0
    if expert_start:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_fused_moe_mxfp4_given_config(device, gen):
    """The tuner's narrow tiles: a 16-column K tile is widened to one 32-value block."""
    w13, w2, kw, values = _experts(4, torch.float32, device, gen, bias=True)
    x = _input(20, torch.float32, device, gen)
    ids, weights = routing(20, 2, 4, gen, device)
    config = MoeConfig(32, GemmConfig(16, 16, 4, 4, 2), GemmConfig(32, 32, 2, 4, 2))
    _check(fused_moe_with_config(x, w13, w2, weights, ids, config, **kw), x, values, weights, ids, kw)


def test_mxfp4_bad_arguments_are_named(device, gen):
    w13, w2, kw, _ = _experts(4, torch.float32, device, gen, bias=False)
    x = _input(3, torch.float32, device, gen)
    ids, weights = routing(3, 2, 4, gen, device)
    with pytest.raises(ValueError, match="w13_scale and w2_scale"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=kw["w13_scale"])
    with pytest.raises(ValueError, match="w2_scale must be MXFP4"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=kw["w13_scale"], w2_scale=kw["w2_scale"][:, :, :1])
    with pytest.raises(ValueError, match="multiples of the 32-value block"):
        fused_moe(x, w13[:, :16], w2, weights, ids, w13_scale=kw["w13_scale"][:, :16], w2_scale=kw["w2_scale"])


# One token and two; top-k 4 of 8 and (expert parallel) 2 of 12 with experts 4..7 here; a masked tail of the walk
# (96: one 128-column tile) and a gate/up walk of three tiles (384: the tiles loaded ahead roll over).
@pytest.mark.parametrize("num_tokens,top_k,dtype,activation,bias,expert_start,dims",
                         [(1, 4, torch.float32, "swigluoai", True, 0, (HIDDEN, INTER)),
                          (2, 4, torch.float16, "silu", False, 0, (HIDDEN, INTER)),
                          (4, 2, torch.float32, "swigluoai", True, 4, (HIDDEN, INTER)),
                          (1, 2, torch.float16, "swigluoai", True, 0, (384, INTER))])
def test_moe_gemv_mxfp4(device, gen, num_tokens, top_k, dtype, activation, bias, expert_start, dims):
    hidden, inter = dims
    w13, w2, kw, values = _experts(4 if expert_start else 8, dtype, device, gen, bias, hidden, inter)
    kw.update(expert_start=expert_start, activation=activation)
    x = _input(num_tokens, dtype, device, gen, hidden)
    ids, weights = routing(num_tokens, top_k, 12 if expert_start else 8, gen, device)
    if expert_start:
        ids[0] = torch.tensor([0, 11])  # routed only to other ranks' experts: zeros
        ids[1] = torch.tensor([4, 9])  # one local pair and one remote
    out = moe_gemv(x, w13, w2, weights, ids, **kw)
    _check(out, x, values, weights, ids, kw)
    assert out.abs().sum() > 0
    if expert_start:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        # down never reads the rows of h that gate/up left unwritten for other ranks' pairs (NaN here).
        h = moe_gemv_gate_up(x, w13, kw["w13_bias"], ids, expert_start, activation, w13_scale=kw["w13_scale"])
        h[~((ids >= 4) & (ids < 8)).reshape(-1)] = float("nan")
        down = moe_gemv_down(h, w2, kw["w2_bias"], weights, ids, expert_start, w2_scale=kw["w2_scale"])
        torch.testing.assert_close(down, out, atol=0, rtol=0)


def test_moe_gemv_mxfp4_norm_prologue(device, gen):
    """norm=(weight, eps) with MXFP4 weights: RMSNorm(x) read as even and odd columns, rounded as the norm rounds."""
    x = (torch.randn(1, HIDDEN, generator=gen) * 3).to(device, torch.float16)
    norm_w = ((torch.rand(HIDDEN, generator=gen) + 0.5) * 0.5 / HIDDEN**0.5).to(device, torch.float16)
    w13, w2, kw, values = _experts(8, torch.float16, device, gen, bias=True)
    ids, weights = routing(1, 4, 8, gen, device)
    out = moe_gemv(x, w13, w2, weights, ids, norm=(norm_w, 1e-6), activation="swigluoai", **kw)
    normed = rms_norm_ref(x, norm_w, 1e-6).to(torch.float16)
    _check(out, x, values, weights, ids, dict(kw, activation="swigluoai"), x_ref=normed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/gpu/test_moe_gpu.py runs the engine's path")
def test_packed_gpt_oss_experts_hand_their_scales_to_the_kernels(gen, monkeypatch):
    """GptOssExperts kept packed (as on CUDA): its forward at one token runs moe_gemv on the bytes and scales, and
    gives what its reference path (the weights dequantized) gives."""
    from nanoserve.distributed.group import TensorParallelGroup
    from nanoserve.layers import moe
    from nanoserve.model.gpt_oss import GptOssExperts

    experts = GptOssExperts(8, HIDDEN, INTER, TensorParallelGroup(), False, top_k=4)
    experts.expect_mxfp4(True, torch.device("cpu"))
    w13, w2, kw, _ = _experts(8, torch.float32, "cpu", gen, bias=True)
    for name, value in dict(kw, w13=w13, w2=w2).items():
        getattr(experts, name).data.copy_(value)
    x = _input(1, torch.float32, "cpu", gen)
    ids, weights = routing(1, 4, 8, gen, "cpu")
    want = experts(x, weights, ids)
    calls = []
    monkeypatch.setattr(moe.FusedMoE, "takes_gemv", lambda self, x: calls.append(1) or True)
    got = experts(x, weights, ids)
    assert calls and experts.w13.dtype == torch.uint8
    top = want.abs().max()
    torch.testing.assert_close(got / top, want / top, **MOE_TOL[torch.float32])
