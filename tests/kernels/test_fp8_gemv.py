"""kernels/fp8_gemv.py against its PyTorch reference on random fp8 operands (the Triton interpreter on the CPU)."""

import pytest
import torch
from conftest import DEVICE

from nanoserve.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_ref, split_counters
from nanoserve.kernels.fp8_quant import quantize_rows_ref


@pytest.mark.parametrize("m, n, k", [(1, 200, 256), (3, 40, 300), (17, 96, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_fp8_gemv_matches_reference(m, n, k, bias, out_dtype, split):
    """split 3: K in 64-column tiles split three ways (a ragged last split where K is not whole tiles), summed by the
    last program to arrive; the counters are left zero for the next launch."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q, x_scale = quantize_rows_ref(torch.randn(m, k, generator=g))
    weight = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    weight_scale = torch.rand(n, generator=g) * 0.01 + 0.001
    b = torch.randn(n, generator=g) if bias else None
    args = [t.to(DEVICE) if t is not None else None for t in (q, x_scale, weight, weight_scale, b)]
    config = Fp8GemvConfig(block_n=16, block_k=64, split=3) if split > 1 else None
    counters = split_counters(n, DEVICE)
    got = fp8_gemv(*args, out_dtype=out_dtype, counters=counters, config=config)
    assert not counters.any()
    want = fp8_gemv_ref(*args, out_dtype=torch.float32)
    assert got.dtype == out_dtype and got.shape == (m, n)
    # fp8 products are exact in fp32; only the order of the K sum differs, and the rounding to out_dtype. Hopper's FP8
    # tensor cores accumulate with fewer bits than fp32 (as kernels/fp8_block_gemm.py's test notes).
    tol = 1e-5 if out_dtype == torch.float32 and DEVICE == "cpu" else 2e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_fp8_gemv_refuses_what_it_cannot_run():
    q = torch.zeros(33, 64, dtype=torch.float8_e4m3fn)
    w = torch.zeros(16, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="33 rows"):
        fp8_gemv(q, torch.ones(33, 1), w, torch.ones(16))
    with pytest.raises(ValueError, match="must be float8_e4m3fn"):
        fp8_gemv(q[:1].float(), torch.ones(1, 1), w, torch.ones(16))


def test_w8a8_layers_take_it(monkeypatch):
    """With quantization/fp8_linear.py's ONE_ROW_FP8_DOT (on), a W8A8 layer offers no weight to the weight-only skinny
    GEMM and runs its quantized input through fp8_gemv; a weight-only layer keeps the skinny GEMM."""
    from nanoserve.layers.linear import Linear
    from nanoserve.quantization import fp8_linear
    from nanoserve.quantization.scheme import FP8Scheme

    monkeypatch.setattr(fp8_linear, "ONE_ROW_FP8_DOT", True)
    g = torch.Generator().manual_seed(1)
    layers = {}
    for acts in ("token", None):
        method = fp8_linear.Fp8LinearMethod(FP8Scheme("compressed-tensors", "channel", acts))
        layer = Linear(64, 48, bias=True)
        method.create_weights(layer)
        layer.weight.data = (torch.randn(48, 64, generator=g) * 40).to(torch.float8_e4m3fn)
        layer.weight_scale.data = torch.rand(48, 1, generator=g) * 0.01 + 0.001
        layer.bias.data = torch.randn(48, generator=g)
        layer.to(DEVICE)
        method.process_weights(layer)
        layers[acts] = layer
    assert layers["token"].quant_method.skinny_weight(layers["token"]) is None
    assert layers[None].quant_method.skinny_weight(layers[None]) is not None
    layer = layers["token"]
    q, x_scale = (t.to(DEVICE) for t in quantize_rows_ref(torch.randn(2, 64, generator=g)))
    got = layer.quant_method.apply_fp8(layer, q, x_scale)
    want = fp8_gemv_ref(q, x_scale, layer.weight, layer.weight_scale, layer.bias, out_dtype=torch.float32)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
