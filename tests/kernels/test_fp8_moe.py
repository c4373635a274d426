"""The MoE kernels' FP8 weights (kernels/fp8_experts.py's layout: float8_e4m3fn values, fp32 scales per row or per
block, weight-only) against kernels/moe_reference.py on the weights they stand for, dequantized here from the
layout's definition: fused_moe's grouped GEMMs and moe_gemv's GEMVs, per-row and block scales, under expert
parallelism too."""

import pytest
import torch
from moe_cases import MOE_TOL, check_against_reference, routing

from nanoserve.kernels.fused_moe import fused_moe
from nanoserve.kernels.moe_gemv import moe_gemv, moe_gemv_down, moe_gemv_gate_up

# I = 40 cuts its last block of 16 rows or 32 columns (gate's partial block of scales, then up's); H = 96 is 3
# blocks of 32 columns and takes masked tails of the default tiles.
HIDDEN, INTER = 96, 40




def _element_scales(scale, n, k, block):
    """Each weight element's scale, by the layout's definition."""
    if block is None:
        return scale[..., None].expand(-1, n, k)
    rows, cols = block
    return torch.stack([torch.stack([torch.stack([scale[e, r // rows, c // cols] for c in range(k)])
                                     for r in range(n)]) for e in range(scale.shape[0])])


def _fp8(num_experts, n, k, block, gen):
    """Random fp8 values (all of e4m3's range but NaN) and random positive scales; what they stand for (fp32)."""
    q = (torch.randn(num_experts, n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (num_experts, n) if block is None else (num_experts, -(-n // block[0]), -(-k // block[1]))
    scale = (torch.rand(shape, generator=gen) + 0.5) / (100 * k**0.5)
    return q, scale, q.float() * _element_scales(scale, n, k, block)


def _experts(num_experts, block, device, gen, hidden=HIDDEN, inter=INTER):
    """w13 (gate's rows and scales, then up's) and w2 with their scales as keywords, and the fp32 values."""
    parts = [_fp8(num_experts, inter, hidden, block, gen) for _ in ("gate", "up")]
    w2, s2, v2 = _fp8(num_experts, hidden, inter, block, gen)
    w13 = torch.cat([parts[0][0], parts[1][0]], dim=1)
    kw = dict(w13_scale=torch.cat([parts[0][1], parts[1][1]], dim=1).to(device), w2_scale=s2.to(device),
              weight_block=block)
    values = (torch.cat([parts[0][2], parts[1][2]], dim=1).to(device), v2.to(device))
    return w13.to(device), w2.to(device), kw, values


def _check(out, x, values, weights, ids, kw):
    check_against_reference(out, x, values, weights, ids,
                            **{k: v for k, v in kw.items() if k in ("expert_start", "activation")})


# 16-row blocks (T * k <= 16 E) and 64-row ones; fp32 and fp16; per-row scales, 16 x 32 blocks and 16 x 16 blocks
# (down's 16-column tiles); the middle rank of three under expert parallelism (experts 4..7 of 12).
@pytest.mark.parametrize("num_tokens,top_k,dtype,block,expert_start",
                         [(3, 2, torch.float32, None, 0), (40, 2, torch.float16, (16, 32), 0),
                          (5, 2, torch.float16, None, 4), (40, 4, torch.float32, (16, 16), 4)])
def test_fused_moe_fp8(device, gen, num_tokens, top_k, dtype, block, expert_start):
    w13, w2, kw, values = _experts(4, block, device, gen)
    kw.update(expert_start=expert_start)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(device, dtype)
    ids, weights = routing(num_tokens, top_k, 4 + 2 * expert_start, gen, device)
    if expert_start:
        ids[0] = torch.tensor([0, 11, 1, 10][:top_k])  # routed only to other ranks' experts: zeros
    out = fused_moe(x, w13, w2, weights, ids, **kw)
    _check(out, x, values, weights, ids, kw)
    assert out.abs().sum() > 0
    if expert_start:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_fp8_bad_arguments_are_named(device, gen):
    w13, w2, kw, _ = _experts(4, (16, 32), device, gen)
    x = torch.randn(3, HIDDEN, generator=gen).to(device)
    ids, weights = routing(3, 2, 4, gen, device)
    with pytest.raises(ValueError, match=r"w13_scale must be fp32 \(4, 6, 3\) \(per \(16, 32\) block\)"):
        fused_moe(x, w13, w2, weights, ids, **dict(kw, w13_scale=kw["w13_scale"][:, :3]))
    with pytest.raises(ValueError, match="columns a multiple of 16"):
        fused_moe(x, w13, w2, weights, ids, **dict(kw, weight_block=(16, 8)))
    with pytest.raises(ValueError, match="only FP8 and W4 weights"):
        fused_moe(x, w13.float(), w2.float(), weights, ids, weight_block=(16, 32))


# One token and two; top-k 4 of 8 and (expert parallel) 2 of 12 with experts 4..7 here; per-row scales and blocks
# (the walk's tiles narrowed to a block's 32 or 16 columns); a gate/up walk of several tiles (384 columns).
@pytest.mark.parametrize("num_tokens,top_k,dtype,block,expert_start,hidden",
                         [(1, 4, torch.float32, None, 0, HIDDEN), (2, 4, torch.float16, (16, 32), 0, HIDDEN),
                          (4, 2, torch.float32, (16, 16), 4, HIDDEN), (1, 2, torch.float16, None, 0, 384)])
def test_moe_gemv_fp8(device, gen, num_tokens, top_k, dtype, block, expert_start, hidden):
    w13, w2, kw, values = _experts(4 if expert_start else 8, block, device, gen, hidden)
    kw.update(expert_start=expert_start)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
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
        h = moe_gemv_gate_up(x, w13, None, ids, expert_start, "silu", w13_scale=kw["w13_scale"], weight_block=block)
        h[~((ids >= 4) & (ids < 8)).reshape(-1)] = float("nan")
        down = moe_gemv_down(h, w2, None, weights, ids, expert_start, w2_scale=kw["w2_scale"], weight_block=block)
        torch.testing.assert_close(down, out, atol=0, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the engine's path runs the kernels itself")
@pytest.mark.parametrize("block", [None, (16, 32)], ids=["row", "block"])
def test_kept_fp8_experts_hand_their_scales_to_the_kernels(gen, monkeypatch, block):
    """FusedMoE kept in FP8 (quantization/moe_experts.py's keep_fp8, as on CUDA): its forward at one token runs
    moe_gemv on the fp8 values, scales and block, and gives what its reference path (the weights dequantized)
    gives."""
    from nanoserve.distributed.group import TensorParallelGroup
    from nanoserve.layers import moe
    from nanoserve.quantization.moe_experts import keep_fp8
    from nanoserve.quantization.scheme import FP8Scheme

    experts = moe.FusedMoE(8, HIDDEN, INTER, TensorParallelGroup(), False, top_k=4)
    scheme = FP8Scheme("fp8", "block", "group", block) if block else FP8Scheme("compressed-tensors", "channel", None)
    keep_fp8(experts, scheme, "experts", torch.device("cpu"), dummy=True)
    w13, w2, kw, _ = _experts(8, block, "cpu", gen)
    for name, value in dict(w13=w13, w2=w2, w13_scale=kw["w13_scale"], w2_scale=kw["w2_scale"]).items():
        getattr(experts, name).data.copy_(value)
    x = torch.randn(1, HIDDEN, generator=gen)
    ids, weights = routing(1, 4, 8, gen, "cpu")
    want = experts(x, weights, ids)
    calls = []
    monkeypatch.setattr(moe.FusedMoE, "takes_gemv", lambda self, x: calls.append(1) or True)
    got = experts(x, weights, ids)
    assert calls and experts.w13.dtype == torch.float8_e4m3fn and experts.weight_block == block
    top = want.abs().max()
    torch.testing.assert_close(got / top, want / top, **MOE_TOL[torch.float32])
