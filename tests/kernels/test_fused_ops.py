"""RMSNorm (+ residual), rotary and SiLU-and-mul kernels against their PyTorch references."""

import pytest
import torch

from nanoserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from nanoserve.kernels.rms_norm import rms_norm, rms_norm_ref
from nanoserve.kernels.rotary import apply_rotary, apply_rotary_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96, 200])
def test_rms_norm_with_and_without_residual(device, gen, tol, dtype, hidden):
    x = torch.randn(7, hidden, generator=gen).to(device, dtype)
    w = torch.randn(hidden, generator=gen).to(device, dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **tol[dtype])
    res = torch.randn(7, hidden, generator=gen).to(device, dtype)
    res_ref = res.clone()
    out = rms_norm(x, w, 1e-6, res)
    ref = rms_norm_ref(x, w, 1e-6, res_ref)
    torch.testing.assert_close(out, ref, **tol[dtype])
    torch.testing.assert_close(res, res_ref, **tol[dtype])


def test_rms_norm_on_strided_head_view(device, gen, tol):
    qkv = torch.randn(5, 4 * 64 + 2 * 2 * 64, generator=gen).to(device)
    q = qkv[:, :256].view(5, 4, 64)  # a per-head view of the fused projection, as Qwen3's q_norm sees it
    w = torch.randn(64, generator=gen).to(device)
    torch.testing.assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), **tol[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 2), (7, 1), (2, 2)])
def test_rotary_in_place_on_views(device, gen, tol, dtype, heads):
    hq, hk, d, t = *heads, 64, 9
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(device, dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    freqs = torch.randn(50, d // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.randint(0, 50, (t,), generator=gen).to(device)
    q_ref, k_ref = q.clone(), k.clone()
    before = qkv.clone()
    apply_rotary(q, k, cos, sin, positions)
    apply_rotary_ref(q_ref, k_ref, cos, sin, positions)
    torch.testing.assert_close(q, q_ref, **tol[dtype])
    torch.testing.assert_close(k, k_ref, **tol[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], before[:, (hq + hk) * d:])  # v untouched


@pytest.mark.parametrize("rotary_dim", [48, 32])
def test_partial_rotary_leaves_the_other_dims(device, gen, tol, rotary_dim):
    """Partial rotary (Phi-3's partial_rotary_factor): the first rotary_dim dims of each head rotate, in rotate-half
    layout among themselves (a half of 24 is padded in the kernel); the others are untouched."""
    hq, hk, d, t = 4, 2, 64, 9
    q = torch.randn(t, hq, d, generator=gen).to(device, torch.float16)
    k = torch.randn(t, hk, d, generator=gen).to(device, torch.float16)
    freqs = torch.randn(50, rotary_dim // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.randint(0, 50, (t,), generator=gen).to(device)
    q_ref, k_ref, q_before = q.clone(), k.clone(), q.clone()
    apply_rotary(q, k, cos, sin, positions)
    apply_rotary_ref(q_ref, k_ref, cos, sin, positions)
    torch.testing.assert_close(q, q_ref, **tol[torch.float16])
    torch.testing.assert_close(k, k_ref, **tol[torch.float16])
    assert torch.equal(q[..., rotary_dim:], q_before[..., rotary_dim:])
    assert not torch.allclose(q[..., :rotary_dim], q_before[..., :rotary_dim])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(device, gen, tol, dtype):
    x = torch.randn(6, 2 * 1500, generator=gen).to(device, dtype)  # more than one 1024-wide block
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **tol[dtype])
