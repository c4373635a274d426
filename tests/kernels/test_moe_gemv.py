"""The decode GEMVs of the routed experts (kernels/moe_gemv.py) against kernels/moe_reference.py."""

import pytest
import torch
from moe_cases import MOE_TOL, routing

from nanoserve.kernels.moe_gemv import MAX_PAIRS, moe_gemv, moe_gemv_down, moe_gemv_gate_up, takes_gemv
from nanoserve.kernels.moe_reference import fused_moe_ref


def _weights(num_experts, hidden, inter, dtype, device, gen, bias=False):
    # Scaled like trained layers, so that outputs stay near 1 where the tolerances are meant to apply.
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    biases = [torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen)]
    return (
        [t.to(device, dtype) for t in [w13, w2] + biases]
        if bias
        else [w13.to(device, dtype), w2.to(device, dtype), None, None]
    )


def _check(x, w13, w2, weights, ids, **kw):
    """Against the reference in fp32 on the same (rounded) inputs (as tests/kernels/test_fused_moe.py)."""
    out = moe_gemv(x, w13, w2, weights, ids, **kw)
    upcast = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids, **upcast)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref, **MOE_TOL[x.dtype])
    return out


# Dims the tiles do not divide (48, 40: masked tails), that one tile covers (64, 32), and walks of three tiles
# (384: the tiles loaded ahead roll over); top-k 2 and 8, 1-4 tokens.
@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,hidden,inter,dtype,ids_dtype",
    [
        (1, 8, 16, 48, 40, torch.float32, torch.int64),
        (2, 8, 16, 48, 40, torch.float16, torch.int32),
        (1, 2, 4, 64, 32, torch.float16, torch.int64),
        (4, 2, 8, 64, 32, torch.float32, torch.int32),
        (1, 2, 4, 384, 384, torch.float32, torch.int64),
    ],
)
def test_moe_gemv(device, gen, num_tokens, top_k, num_experts, hidden, inter, dtype, ids_dtype):
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w13, w2, _, _ = _weights(num_experts, hidden, inter, dtype, device, gen)
    ids, weights = routing(num_tokens, top_k, num_experts, gen, device, ids_dtype)
    _check(x, w13, w2, weights, ids)


@pytest.mark.parametrize(
    "dtype,activation,bias",
    [
        (torch.float32, "silu", True),
        (torch.float32, "swigluoai", False),
        (torch.float16, "swigluoai", True),
        (torch.float16, "silu", True),
    ],
)
def test_biases_and_activations(device, gen, dtype, activation, bias):
    # Inputs scaled up so that swigluoai's clamps (at +-7) cut into gate and up.
    x = (torch.randn(2, 48, generator=gen) * (4 if activation == "swigluoai" else 1)).to(device, dtype)
    w13, w2, b13, b2 = _weights(8, 48, 40, dtype, device, gen, bias=bias)
    ids, weights = routing(2, 4, 8, gen, device)
    _check(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=activation)


def test_expert_parallel(device, gen):
    """The middle rank of three, with 4 of 12 experts: pairs of the other ranks contribute nothing, a token routed only
    elsewhere gets zeros, and down never reads the rows of h that gate/up left unwritten for them (NaN here)."""
    w13, w2, b13, b2 = _weights(4, 48, 40, torch.float32, device, gen, bias=True)
    x = torch.randn(4, 48, generator=gen).to(device)
    ids, weights = routing(4, 2, 12, gen, device)
    ids[0] = torch.tensor([0, 11])
    ids[1] = torch.tensor([4, 9])  # one local pair and one remote
    ids[2] = torch.tensor([7, 5])
    kw = dict(expert_start=4, w13_bias=b13, w2_bias=b2)
    out = _check(x, w13, w2, weights, ids, **kw)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0
    h = moe_gemv_gate_up(x, w13, b13, ids, 4, "silu")
    local = ((ids >= 4) & (ids < 8)).reshape(-1)
    h[~local] = float("nan")
    torch.testing.assert_close(moe_gemv_down(h, w2, b2, weights, ids, 4), out, **MOE_TOL[torch.float32])


def test_experts_no_pair_chose_are_never_read(device, gen):
    """Every expert but the chosen ones has NaN weights and biases: a kernel that read them would return NaN."""
    w13, w2, b13, b2 = _weights(8, 64, 32, torch.float32, device, gen, bias=True)
    ids, weights = routing(2, 4, 8, gen, device)
    unused = torch.ones(8, dtype=torch.bool)
    unused[ids.flatten().cpu()] = False
    assert unused.any()
    for t in (w13, w2, b13, b2):
        t[unused.to(device)] = float("nan")
    x = torch.randn(2, 64, generator=gen).to(device)
    out = _check(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    assert torch.isfinite(out).all()


def test_size_rule_and_bad_arguments(device, gen):
    assert [takes_gemv(t, 8) for t in (0, 1, 2, 3)] == [False, True, True, False]
    assert takes_gemv(MAX_PAIRS // 2, 2) and not takes_gemv(MAX_PAIRS // 2 + 1, 2)
    w13, w2, _, _ = _weights(4, 48, 40, torch.float32, device, gen)
    x = torch.randn(9, 48, generator=gen).to(device)
    ids, weights = routing(9, 2, 4, gen, device)
    with pytest.raises(ValueError, match="pairs"):
        moe_gemv(x, w13, w2, weights, ids)
    with pytest.raises(ValueError, match="activation"):
        moe_gemv(x[:1], w13, w2, weights[:1], ids[:1], activation="gelu")
    assert moe_gemv(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_prologue(device, gen, dtype):
    """norm=(weight, eps): the experts of RMSNorm(x), rounded as the standalone norm rounds."""
    from nanoserve.kernels.rms_norm import rms_norm_ref

    x = (torch.randn(2, 48, generator=gen) * 3).to(device, dtype)
    norm_w = (torch.rand(48, generator=gen) + 0.5).to(device, dtype)
    w13, w2, b13, b2 = _weights(8, 48, 40, dtype, device, gen, bias=True)
    ids, weights = routing(2, 2, 8, gen, device)
    kw = dict(w13_bias=b13, w2_bias=b2)
    out = moe_gemv(x, w13, w2, weights, ids, norm=(norm_w, 1e-6), **kw)
    normed = rms_norm_ref(x, norm_w, 1e-6).to(dtype)
    ref = fused_moe_ref(normed.float(), w13.float(), w2.float(), weights, ids, w13_bias=b13.float(), w2_bias=b2.float())
    torch.testing.assert_close(out.float(), ref, **MOE_TOL[dtype])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/gpu/test_moe_gpu.py runs the engine's path")
def test_block_at_one_row_normalizes_inside_the_kernels(gen, monkeypatch):
    """SparseMoeBlock.forward_norm at one row in a (faked) graph: router_topk adds the residual, normalizes, routes,
    the experts' GEMVs normalize again, and no norm, router GEMV or top-k runs on its own; the output and the next
    residual are the unfused block's (the CPU reference, eager)."""
    from nanoserve.distributed.group import TensorParallelGroup
    from nanoserve.kernels import moe_gemv as kernels
    from nanoserve.kernels import moe_routing
    from nanoserve.layers import moe
    from nanoserve.layers.linear import Linear
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.step_plan import EAGER, KernelPlan

    experts = moe.FusedMoE(16, 48, 40, TensorParallelGroup(), False, top_k=8)
    block = moe.SparseMoeBlock(experts, renormalize=True, router_bias=True)
    norm = RMSNorm(48)
    with torch.no_grad():
        for p in [*block.parameters(), *norm.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 1))
    x, residual = torch.randn(1, 48, generator=gen), torch.randn(1, 48, generator=gen)
    want, want_residual = block.forward_norm(x, residual.clone(), norm, EAGER)

    calls = []
    for module, name in ((kernels, "moe_gemv"), (moe_routing, "router_topk")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    monkeypatch.setattr(moe.FusedMoE, "takes_gemv", lambda self, x: kernels.takes_gemv(x.shape[0], self.top_k))
    for cls, what in ((RMSNorm, "the norm"), (Linear, "the router's GEMV")):
        monkeypatch.setattr(cls, "forward", lambda *a, _w=what: pytest.fail(f"{_w} ran on its own"))
    monkeypatch.setattr(moe, "route", lambda *a: pytest.fail("the top-k ran on its own"))
    plan = KernelPlan(skinny_gemm=True, fused_prologues=True)
    got, got_residual = block.forward_norm(x, residual.clone(), norm, plan)
    assert calls == ["router_topk", "moe_gemv"]
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(got, want, **MOE_TOL[torch.float32])
    assert block.router_counter.item() == 0
