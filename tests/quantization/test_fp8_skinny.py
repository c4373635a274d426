"""FP8 layers on the skinny GEMM's steps (layers/linear.py's skinny_operands, quantization/fp8_linear.py): per-tensor
and per-channel weights run kernels/gemv.py weight-only, whatever the activation scheme, the prologues fused in; block
weights keep their method's GEMM. On the CPU the plans are built by hand (a step plan takes the skinny GEMM only in
CUDA graphs) and the kernels run in Triton's interpreter. W8A8 layers take that path with fp8_linear.ONE_ROW_FP8_DOT off
(these tests turn it off; on, the default, they run kernels/fp8_gemv.py: tests/kernels/test_fp8_gemv.py)."""

import types

import pytest
import torch
import torch.nn.functional as F

from nanoserve.layers.activation import SiluAndMul
from nanoserve.layers.linear import Linear, QKVLinear, RowParallelLinear, skinny_operands
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.step_plan import EAGER, KernelPlan
from nanoserve.quantization import fp8_linear, fp8_math
from nanoserve.quantization.fp8_linear import Fp8LinearMethod
from nanoserve.quantization.scheme import FP8Scheme

SKINNY = KernelPlan(skinny_gemm=True)
ONE_ROW = KernelPlan(skinny_gemm=True, fused_prologues=True)


def _quantize(layer: Linear, scheme: FP8Scheme, gen: torch.Generator) -> Linear:
    """The layer with random fp8 weights and scales in the scheme's checkpoint layout, processed as after loading."""
    method = Fp8LinearMethod(scheme)
    method.create_weights(layer)
    n, k = layer.weight.shape
    layer.weight.data = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = getattr(layer, scheme.scale_name)
    scale.data = (0.5 + torch.rand(scale.shape, generator=gen)) * k**-0.5
    if scheme.activations == "tensor":
        layer.input_scale.data = torch.rand(layer.input_scale.shape, generator=gen) * 0.02 + 0.01
    if layer.bias is not None:
        layer.bias.data = torch.randn(n, generator=gen)
    method.process_weights(layer)
    return layer


def _weight_only(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """x times the dequantized weight (weight.float() * weight_scale[:, None]), plus the bias: no activation
    quantization."""
    y = x.float() @ (layer.weight.float() * layer.weight_scale[:, None]).T
    return y if layer.bias is None else y + layer.bias


@pytest.fixture(autouse=True)
def weight_only_skinny_path(monkeypatch):
    monkeypatch.setattr(fp8_linear, "ONE_ROW_FP8_DOT", False)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_which_schemes_offer_the_skinny_gemm(gen):
    """Per-tensor and per-channel weights offer their fp8 weight and per-row scales (any activation scheme), blocks
    none; an unquantized layer its own weight, unscaled."""
    for weights, acts in (("tensor", "tensor"), ("channel", "token"), ("channel", None)):
        layer = _quantize(Linear(48, 40, bias=False), FP8Scheme("compressed-tensors", weights, acts), gen)
        weight, scale = skinny_operands(layer)
        assert weight is layer.weight and weight.dtype == torch.float8_e4m3fn
        assert scale is layer.weight_scale and scale.shape == (40,) and scale.dtype == torch.float32
    block = _quantize(Linear(256, 128, bias=False), FP8Scheme("fp8", "block", "group", (128, 128),
                                                              scale_name="weight_scale_inv"), gen)
    assert skinny_operands(block) is None
    plain = Linear(48, 40, bias=False)
    assert skinny_operands(plain) == (plain.weight, None)
    assert skinny_operands(types.SimpleNamespace(quant_method=object())) is None  # a method offering nothing


def test_w8a8_layers_run_weight_only_on_skinny_steps(gen):
    """A static W8A8 fused qkv_proj (a scale per shard) with bias, and a dynamic per-token one per channel: on skinny
    steps the fp8 weight times 16-bit activations, the norm fused in at one row; on eager steps the method's GEMM,
    which quantizes the activations (and so differs)."""
    qkv = _quantize(QKVLinear(64, 4, 2, 10, bias=True), FP8Scheme("compressed-tensors", "tensor", "tensor"), gen)
    gate_up = _quantize(Linear(64, 56, bias=False), FP8Scheme("compressed-tensors", "channel", "token"), gen)
    norm = RMSNorm(64)
    norm.weight.data = 1 + 0.5 * torch.randn(64, generator=gen)
    for layer in (qkv, gate_up):
        for m, plan in ((1, ONE_ROW), (3, SKINNY)):
            x, residual = torch.randn(m, 64, generator=gen), torch.randn(m, 64, generator=gen)
            normed, want_residual = norm(x.clone(), residual.clone())
            got, new_residual = layer.forward_norm(x, residual, norm, plan)
            torch.testing.assert_close(got, _weight_only(layer, normed), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(new_residual, want_residual)
            torch.testing.assert_close(layer(x, plan), _weight_only(layer, x), atol=1e-5, rtol=1e-5)
            eager = layer(x, EAGER)
            torch.testing.assert_close(eager, fp8_math.fp8_linear_reference(
                x, layer.weight, layer.weight_scale, layer.bias, layer.quant_method.scheme.activations,
                getattr(layer, "input_scale", None)))
            assert not torch.allclose(eager, layer(x, plan), atol=1e-5, rtol=1e-5)


def test_down_proj_fuses_silu_mul(gen):
    """A per-channel down_proj at one row: SiLU-and-mul inside the fp8 GEMV."""
    down = _quantize(RowParallelLinear(40, 24, bias=False), FP8Scheme("compressed-tensors", "channel", "token"), gen)
    x = torch.randn(1, 80, generator=gen)
    act = SiluAndMul()
    torch.testing.assert_close(down.forward_silu_mul(x, act, ONE_ROW), _weight_only(down, act(x)), atol=1e-5,
                               rtol=1e-5)


def test_block_weights_keep_their_gemm(gen):
    layer = _quantize(Linear(256, 128, bias=False), FP8Scheme("fp8", "block", "group", (128, 128),
                                                              scale_name="weight_scale_inv"), gen)
    x = torch.randn(1, 256, generator=gen)
    torch.testing.assert_close(layer(x, ONE_ROW), layer(x, EAGER), atol=0, rtol=0)
    torch.testing.assert_close(layer.forward_silu_mul(torch.cat([x, x], 1), SiluAndMul(), ONE_ROW),
                               layer(SiluAndMul()(torch.cat([x, x], 1)), EAGER), atol=0, rtol=0)


def test_row_parallel_silu_mul_reduces_once(gen):
    """forward_silu_mul off the fused kernels (here an eager step) sums the ranks' partial outputs once."""
    tp = types.SimpleNamespace(size=2, rank=0, all_reduce=lambda y: y * 2)  # the other rank's partial equals ours
    down = RowParallelLinear(80, 24, bias=False, tp=tp)
    x = torch.randn(1, 80, generator=gen)
    act = SiluAndMul()
    torch.testing.assert_close(down.forward_silu_mul(x, act, EAGER), 2 * F.linear(act(x), down.weight))
