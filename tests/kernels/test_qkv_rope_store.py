"""The fused q/k norm + rotary + KV store kernel against the unfused references, on random inputs."""

import pytest
import torch

from nanoserve.kernels.qkv_rope_store import qkv_rope_store, qkv_rope_store_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,head_dim,norm,rotary_dim", [
    ((4, 2), 64, True, None), ((7, 1), 128, False, None), ((2, 2), 64, False, None), ((8, 1), 128, True, None),
    # Partial rotary (Phi-3's partial_rotary_factor): Phi-4-mini's 96 of 128 dims, and a quarter of a head.
    ((3, 1), 128, False, 96), ((4, 2), 64, True, 16)])
def test_matches_unfused_references(device, gen, tol, dtype, heads, head_dim, norm, rotary_dim):
    hq, hkv = heads
    t, block_size, num_blocks = 9, 4, 6
    qkv = torch.randn(t, (hq + 2 * hkv) * head_dim, generator=gen).to(device, dtype)
    freqs = torch.randn(50, (rotary_dim or head_dim) // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.randint(0, 50, (t,), generator=gen).to(device)
    # Distinct slots in shuffled order, two tokens not stored (-1).
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[[2, 6]] = -1
    slots = slots.to(device)
    q_w = torch.randn(head_dim, generator=gen).to(device, dtype) if norm else None
    k_w = torch.randn(head_dim, generator=gen).to(device, dtype) if norm else None
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    want = [x.clone() for x in (qkv, k_cache, v_cache)]
    qkv_rope_store_ref(want[0], hq, hkv, positions, cos, sin, q_w, k_w, 1e-6, want[1], want[2], slots)
    qkv_rope_store(qkv, hq, hkv, positions, cos, sin, q_w, k_w, 1e-6, k_cache, v_cache, slots)
    for got, ref in zip((qkv, k_cache, v_cache), want, strict=True):
        torch.testing.assert_close(got, ref, **tol[dtype])


def test_strided_rows_of_a_larger_buffer(device, gen, tol):
    """qkv may be a row-strided view (a padded graph buffer): only its own columns change."""
    hq, hkv, d, t = 2, 1, 64, 5
    buf = torch.randn(t, (hq + 2 * hkv) * d + 32, generator=gen).to(device)
    qkv = buf[:, :(hq + 2 * hkv) * d]
    tail = buf[:, -32:].clone()
    freqs = torch.randn(20, d // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.arange(t).to(device)
    slots = torch.arange(t).to(device)
    caches = [torch.zeros(2, 4, hkv, d, device=device) for _ in range(4)]
    want = qkv.clone()
    qkv_rope_store_ref(want, hq, hkv, positions, cos, sin, None, None, 1e-6, caches[0], caches[1], slots)
    qkv_rope_store(qkv, hq, hkv, positions, cos, sin, None, None, 1e-6, caches[2], caches[3], slots)
    torch.testing.assert_close(qkv, want, **tol[torch.float32])
    torch.testing.assert_close(caches[2], caches[0], **tol[torch.float32])
    torch.testing.assert_close(caches[3], caches[1], **tol[torch.float32])
    assert torch.equal(buf[:, -32:], tail)
