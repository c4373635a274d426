"""w4a16_linear (the tensor-core GEMM, and at one row the GEMV) against its PyTorch reference on random 4-bit
weights (on the CPU through TRITON_INTERPRET=1, fp32 and fp16 activations), with and without zero points, act-order
permutations, biases, one group per row, whole and partial column tiles and K split over programs; and the
reference against a plain dequantized matmul written here from the layout's definition."""

import pytest
import torch
from w4_layout import random_w4

from nanoserve.kernels.w4a16_gemm import w4a16_linear
from nanoserve.kernels.w4a16_reference import w4a16_linear_ref


def dense(qweight, scales, zeros, perm, group) -> torch.Tensor:
    """W [K, N] in the checkpoint's column order, element by element from the layout's definition."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    q = torch.stack([(qweight >> (4 * j)) & 0xF for j in range(8)], dim=1).reshape(k, n).float()
    g = torch.arange(k) // group if group != -1 else torch.zeros(k, dtype=torch.long)
    w = (q - (zeros.float()[g] if zeros is not None else 8.0)) * scales.float()[g]
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.long(), w)
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, group, zeros, perm, bias", [
    (1, 40, 128, 16, True, False, True),     # one row (w4a16_gemv.py): K split in two, partial column tile
    (1, 520, 64, 32, False, True, False),    # one row, five column tiles, no split, act-order
    (1, 72, 96, -1, True, False, False),     # one row, one group per row, K not a multiple of 128
    (1, 200, 256, 32, True, True, True),     # one row, K split in two, act-order, a partial column tile
    (3, 64, 128, 32, True, True, True),      # tensor cores, split, whole column tiles
    (20, 136, 64, 64, False, False, True),   # tensor cores, two column tiles plus a partial one
])
def test_w4a16_linear(dtype, m, n, k, group, zeros, perm, bias, device, gen):
    qweight, scales, z, p = random_w4(n, k, group, zeros, perm, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = [t.to(device) if t is not None else None for t in (x, qweight, scales, z, p)]
    got = w4a16_linear(*args, group, None if b is None else b.to(device))
    want = w4a16_linear_ref(*args, group, None if b is None else b.to(device))
    assert got.dtype == dtype and got.shape == (m, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # The reference is the layout's definition; in fp16 on a GPU its matmul may round an element one ulp away from
    # fp32-then-round (seen on an H200: 2.4e-4 at 0.26).
    plain = x.float() @ dense(qweight, scales, z, p, group) + (b.float() if bias else 0)
    exact = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=2e-3)
    torch.testing.assert_close(want.float().cpu(), plain.to(dtype).float(), **exact)


def test_strided_weight_is_refused(gen):
    """The kernels index qweight as row-major: a transposed view (what packing along rows gave before
    w4_packing.pack returned contiguous tensors) is refused rather than read wrongly."""
    qweight, scales, z, p = random_w4(16, 64, 32, True, False, gen)
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        w4a16_linear(torch.randn(1, 64), qweight.t().contiguous().t(), scales, z, p, 32)
