"""The producers that quantize their own output for an FP8 projection (kernels/rms_norm.py's rms_norm_fp8,
kernels/activation.py's act_and_mul_fp8) against the unfused composition they replace, rms_norm or act_and_mul then
fp8_quant.quantize_rows: the same fp8 bytes and scales, and the same residual, on random inputs (fp32 and fp16: the
interpreter mishandles bf16)."""

import pytest
import torch

from nanoserve.kernels.activation import act_and_mul, act_and_mul_fp8
from nanoserve.kernels.fp8_quant import quantize_rows
from nanoserve.kernels.rms_norm import rms_norm, rms_norm_fp8


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == want[1].shape
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


def _rows(t: int, d: int, dtype: torch.dtype, gen: torch.Generator, device: str, top: int = 2) -> torch.Tensor:
    """Rows of magnitudes 1e-2 to 10^top, so that the scales and the fp8 grid's subnormals differ between rows."""
    return (torch.randn(t, d, generator=gen) * torch.logspace(-2, top, t)[:, None]).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_fp8(dtype, residual, static, offset, device, gen):
    """D = 200 leaves part of the block masked; a static scale small enough that some values clamp at 448."""
    x = _rows(6, 200, dtype, gen, device)
    res = _rows(6, 200, dtype, gen, device) if residual else None
    weight = (torch.randn(200, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(dtype).to(device)
    scale = torch.tensor([0.004], device=device) if static else None
    want_res = res.clone() if residual else None
    want = quantize_rows(rms_norm(x, weight, 1e-6, want_res, offset), scale)
    got_res = res.clone() if residual else None
    _assert_same(rms_norm_fp8(x, weight, 1e-6, got_res, offset, scale), want)
    if residual:
        assert torch.equal(got_res, want_res) and not torch.equal(got_res, res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("static", [False, True])
def test_act_and_mul_fp8(dtype, activation, static, device, gen, monkeypatch):
    """inter = 300 over 128-column chunks: several chunks, the last one partial."""
    import triton

    x = _rows(5, 600, dtype, gen, device, top=1)
    scale = torch.tensor([0.05], device=device) if static else None
    want = quantize_rows(act_and_mul(x, activation), scale)
    # Chunks of 128 rather than the whole row (next_power_of_2(300)), so that the loop runs more than once.
    monkeypatch.setattr(triton, "next_power_of_2", lambda n: 128)
    _assert_same(act_and_mul_fp8(x, activation, scale), want)


class _QuantizingMethod:
    """A LinearMethod that takes fp8 input on the CPU (Fp8LinearMethod asks for it on CUDA only): apply_fp8 returns
    what it was handed, so that the test sees the layer's fused quantization."""

    def __init__(self, scale: torch.Tensor | None) -> None:
        self.scale = scale

    def fp8_input(self, layer, x):
        from nanoserve.layers.linear import Fp8Input

        return Fp8Input(self.scale)

    def apply_fp8(self, layer, q, x_scale):
        return q, x_scale


@pytest.mark.parametrize("static", [False, True])
def test_linear_hands_fused_fp8_input(static, device, gen):
    """forward_norm and forward_silu_mul give the method the unfused composition's fp8 input, and the residual."""
    from nanoserve.layers.activation import GeluTanhAndMul
    from nanoserve.layers.linear import Linear
    from nanoserve.layers.norm import RMSNorm
    from nanoserve.layers.step_plan import EAGER

    scale = torch.tensor([0.02], device=device) if static else None
    layer = Linear(96, 32, bias=False)
    layer.quant_method = _QuantizingMethod(scale)
    norm = RMSNorm(96, offset=1.0)
    norm.weight.data = torch.randn(96, generator=gen) * 0.3
    x, res = _rows(4, 96, torch.float32, gen, device), _rows(4, 96, torch.float32, gen, device)
    want_res = res.clone()
    want = quantize_rows(rms_norm(x, norm.weight, norm.eps, want_res, 1.0), scale)
    got, got_res = layer.forward_norm(x, res, norm, EAGER)
    _assert_same(got, want)
    assert got_res is res and torch.equal(res, want_res)
    gate_up = _rows(4, 192, torch.float32, gen, device, top=1)
    _assert_same(layer.forward_silu_mul(gate_up, GeluTanhAndMul(), EAGER),
                 quantize_rows(act_and_mul(gate_up, "gelu_tanh"), scale))
