"""The MoE kernels' W4 weights (kernels/w4_experts.py's layout: eight 4-bit values along K an int32, fp32 scales per
group or per row, uint8 zero points or none, weight-only) against kernels/moe_reference.py on the weights they stand
for, dequantized here from the layout's definition (not by w4_experts.py): fused_moe's grouped GEMMs and moe_gemv's
GEMVs, asymmetric and symmetric, groups of 16 and 32 and per row, under expert parallelism too."""

import pytest
import torch
from moe_cases import check_against_reference, routing

from nanoserve.kernels.fused_moe import fused_moe
from nanoserve.kernels.moe_gemv import moe_gemv
from nanoserve.kernels.w4_experts import dequantize_w4_experts

# H = 96: 3 groups of 32 and masked tails of the default tiles; I = 48: 3 groups of 16, 1.5 of 32 (a cut last group).
HIDDEN, INTER = 96, 48


def _w4(num_experts, n, k, group, asymmetric, gen):
    """Random values 0..15, positive scales and zero points 0..16 (or none); packed; the fp32 weight they define."""
    q = torch.randint(0, 16, (num_experts, n, k), generator=gen)
    groups = 1 if group == -1 else -(-k // group)
    scale = (torch.rand(num_experts, n, groups, generator=gen) + 0.5) / (8 * k**0.5)
    zeros = torch.randint(0, 17, (num_experts, n, groups), generator=gen) if asymmetric else None
    column_group = torch.zeros(k, dtype=torch.long) if group == -1 else torch.arange(k) // group
    z = 8 if zeros is None else zeros[..., column_group]
    value = (q - z).float() * scale[..., column_group]
    shifts = torch.arange(0, 32, 4)
    word = (q.unflatten(-1, (-1, 8)) << shifts).sum(-1)
    packed = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    if group == -1:
        scale, zeros = scale[..., 0], None if zeros is None else zeros[..., 0]
    return packed, scale, None if zeros is None else zeros.to(torch.uint8), value


def _experts(num_experts, group, asymmetric, device, gen, hidden=HIDDEN, inter=INTER):
    """w13 (gate's rows, then up's) and w2 with their scales and zeros as keywords, and the fp32 values."""
    gate, up = (_w4(num_experts, inter, hidden, group, asymmetric, gen) for _ in range(2))
    w2, s2, z2, v2 = _w4(num_experts, hidden, inter, group, asymmetric, gen)
    kw = dict(w13_scale=torch.cat([gate[1], up[1]], dim=1).to(device), w2_scale=s2.to(device),
              weight_block=None if group == -1 else (1, group))
    if asymmetric:
        kw.update(w13_zeros=torch.cat([gate[2], up[2]], dim=1).to(device), w2_zeros=z2.to(device))
    values = (torch.cat([gate[3], up[3]], dim=1).to(device), v2.to(device))
    return torch.cat([gate[0], up[0]], dim=1).to(device), w2.to(device), kw, values




def _check(out, x, values, weights, ids, expert_start):
    check_against_reference(out, x, values, weights, ids, expert_start=expert_start)


def test_reference_dequantization_is_the_layouts(gen):
    for group, asymmetric in ((16, True), (-1, False)):
        w, scale, zeros, value = _w4(3, 8, 48, group, asymmetric, gen)
        assert torch.equal(dequantize_w4_experts(w, scale, zeros, group, torch.float32), value)


# 16-row blocks (T * k <= 16 E) and 64-row ones; fp32 and fp16; groups of 32 (down's last cut at I = 48) and 16, per
# row; the middle rank of three under expert parallelism (experts 4..7 of 12).
@pytest.mark.parametrize("num_tokens,top_k,dtype,group,asymmetric,expert_start",
                         [(3, 2, torch.float32, 32, True, 0), (40, 2, torch.float16, 16, False, 0),
                          (5, 2, torch.float16, -1, True, 4)])
def test_fused_moe_w4(device, gen, num_tokens, top_k, dtype, group, asymmetric, expert_start):
    w13, w2, kw, values = _experts(4, group, asymmetric, device, gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(device, dtype)
    ids, weights = routing(num_tokens, top_k, 4 + 2 * expert_start, gen, device)
    if expert_start:
        ids[0] = torch.tensor([0, 11])  # routed only to other ranks' experts: zeros
    out = fused_moe(x, w13, w2, weights, ids, expert_start=expert_start, **kw)
    _check(out, x, values, weights, ids, expert_start)
    assert out.abs().sum() > 0
    if expert_start:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


# One token and two; top-k 4 of 8 and (expert parallel) 2 of 12; groups of 16 and 32 (the walk's tiles narrowed to a
# group) and per row; a gate/up walk of several tiles (384 columns).
@pytest.mark.parametrize("num_tokens,top_k,dtype,group,asymmetric,expert_start,hidden",
                         [(1, 4, torch.float32, 32, True, 0, HIDDEN), (2, 4, torch.float16, -1, False, 0, HIDDEN),
                          (4, 2, torch.float32, 16, True, 4, HIDDEN), (1, 2, torch.float16, 128, False, 0, 384)])
def test_moe_gemv_w4(device, gen, num_tokens, top_k, dtype, group, asymmetric, expert_start, hidden):
    w13, w2, kw, values = _experts(4 if expert_start else 8, group, asymmetric, device, gen, hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    ids, weights = routing(num_tokens, top_k, 12 if expert_start else 8, gen, device)
    if expert_start:
        ids[0] = torch.tensor([0, 11])  # routed only to other ranks' experts: zeros
        ids[1] = torch.tensor([4, 9])  # one local pair and one remote
    out = moe_gemv(x, w13, w2, weights, ids, expert_start=expert_start, **kw)
    _check(out, x, values, weights, ids, expert_start)
    assert out.abs().sum() > 0
    if expert_start:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_moe_gemv_w4_norm_prologue(device, gen):
    """norm=(weight, eps), the decoder layer's fused path: the W4 experts of RMSNorm(x)."""
    from nanoserve.kernels.rms_norm import rms_norm_ref

    w13, w2, kw, values = _experts(8, 32, True, device, gen)
    x = torch.randn(1, HIDDEN, generator=gen).to(device)
    norm_w = (torch.rand(HIDDEN, generator=gen) + 0.5).to(device)
    ids, weights = routing(1, 4, 8, gen, device)
    out = moe_gemv(x, w13, w2, weights, ids, norm=(norm_w, 1e-6), **kw)
    _check(out, rms_norm_ref(x, norm_w, 1e-6), values, weights, ids, 0)


def test_w4_bad_arguments_are_named(device, gen):
    w13, w2, kw, _ = _experts(4, 16, True, device, gen)
    x = torch.randn(3, HIDDEN, generator=gen).to(device)
    ids, weights = routing(3, 2, 4, gen, device)
    with pytest.raises(ValueError, match=r"w13_scale must be contiguous fp32 \(4, 96, 6\)"):
        fused_moe(x, w13, w2, weights, ids, **dict(kw, w13_scale=kw["w13_scale"][:, :, :3].contiguous()))
    with pytest.raises(ValueError, match="group_size a multiple of 16"):
        fused_moe(x, w13, w2, weights, ids, **dict(kw, weight_block=(1, 8)))
    with pytest.raises(ValueError, match="need both"):
        fused_moe(x, w13, w2, weights, ids, **dict(kw, w2_zeros=None))
    with pytest.raises(ValueError, match="only W4 weights"):
        fused_moe(x, w13.float(), w2.float(), weights, ids, w13_zeros=kw["w13_zeros"], w2_zeros=kw["w2_zeros"])
