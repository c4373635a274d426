"""The FP8 kernels against their PyTorch references on random inputs (on the CPU through TRITON_INTERPRET=1, with
fp32 and fp16 inputs: the interpreter mishandles bf16): the rowwise activation quantization byte for byte, the
block-scaled GEMM to fp32 rounding, and that reference against the scheme's definition in nanoserve/quantization/."""

import pytest
import torch

from nanoserve.kernels.fp8_block_gemm import fp8_block_linear, fp8_block_linear_ref
from nanoserve.kernels.fp8_quant import quantize_rows, quantize_rows_ref
from nanoserve.quantization import fp8_math


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("static", [False, True])
def test_quantize_rows(dtype, static, device, gen):
    x = (torch.randn(5, 300, generator=gen) * torch.logspace(-3, 2, 5)[:, None]).to(dtype)
    x[2] = 0  # an all-zero row: a finite scale, zeros out
    x = x.to(device)
    scale = torch.tensor([0.05], device=device) if static else None
    q, s = quantize_rows(x, scale)
    want_q, want_s = quantize_rows_ref(x, scale)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if not static:
        assert torch.equal(q.float() * s, fp8_math.fake_quantize_activation(x, "token"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k, block, split", [(1, 64, 64, (16, 16), None), (3, 48, 80, (16, 32), None),
                                                   (40, 96, 128, (32, 64), None), (70, 160, 64, (32, 32), None),
                                                   (1, 80, 144, (16, 16), 4), (5, 48, 80, (16, 32), 2)])
def test_block_gemm(dtype, m, n, k, block, split, device, gen):
    """Shapes with partial tiles and partial blocks (N, K not multiples of the block) at each tile size; K split
    (ragged: 9 blocks in 4 splits of 3, 3, 3, 0 -> 3 splits) at decode sizes, summed by the last program, the
    counters left zero."""
    w = torch.randn(n, k, generator=gen) * 0.05
    q, scale = fp8_math.quantize_weight(w, "block", block)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[0, :block[1]] = 0  # an all-zero group
    bias = torch.randn(n, generator=gen).to(dtype)
    args = [t.to(device) for t in (x, q, scale)]
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    got = fp8_block_linear(*args, block, bias.to(device), counters=counters, split=split)
    assert not counters.any()
    want = fp8_block_linear_ref(*args, block, bias.to(device))
    assert got.dtype == dtype
    # Hopper's FP8 tensor cores accumulate with fewer bits than fp32 (0.2 % off in a few elements on an H200).
    exact = dtype == torch.float32 and device == "cpu"
    tol = dict(atol=1e-4, rtol=1e-4) if exact else dict(atol=2e-3, rtol=3e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # The reference is the scheme's definition (the CPU path) up to the order of fp32 sums.
    scheme = fp8_math.fp8_linear_reference(x.float(), q, scale, bias.float(), "group", None, block)
    torch.testing.assert_close(want.float().cpu(), scheme, **tol)
