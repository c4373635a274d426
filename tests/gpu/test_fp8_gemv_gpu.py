"""The FP8 skinny GEMM on the GPU (skipped without CUDA): Llama-3.1-8B's layer shapes against the reference, in a
CUDA graph, and Fp8LinearMethod taking it for decode-sized batches only."""

import pytest
import torch

from nanoserve.kernels import fp8_gemv as fp8_gemv_module
from nanoserve.kernels.fp8_gemv import MAX_M, fp8_gemv, fp8_gemv_ref
from nanoserve.layers.linear import Linear
from nanoserve.quantization import fp8_math
from nanoserve.quantization.fp8_linear import FP8_GEMV_MAX_ROWS, Fp8LinearMethod
from nanoserve.quantization.scheme import FP8Scheme

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LLAMA_8B = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]  # (N, K): o, qkv, gate_up, down
# bf16 outputs of the same fp32 value may round one bf16 step apart (sums in another order).
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float32: dict(atol=1e-4, rtol=1e-4)}


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * k**-0.5
    q, scale = fp8_math.quantize_weight(w, "channel")
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = torch.randn(n, device="cuda", generator=g).to(dtype)
    return x, q, scale.reshape(-1).contiguous(), b


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n, k", LLAMA_8B)
def test_llama_shapes_bf16(n, k, m, static):
    x, q, scale, b = _inputs(m, n, k, torch.bfloat16, seed=n + k + m)
    input_scale = (x.float().abs().amax() / 448.0).reshape(1) if static else None
    bias = b if m == 1 else None
    got = fp8_gemv(x, q, scale, bias, input_scale)
    torch.testing.assert_close(got.float(), fp8_gemv_ref(x, q, scale, bias, input_scale).float(),
                               **TOL[torch.bfloat16])


@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 32])
def test_fp32_every_path(m):
    """fp32 outputs show the products and sums are exact but for their order (the tensor cores' bf16 operands
    hold every FP8 value)."""
    x, q, scale, b = _inputs(m, 6144, 4096, torch.float32, seed=m)
    torch.testing.assert_close(fp8_gemv(x, q, scale, b), fp8_gemv_ref(x, q, scale, b), **TOL[torch.float32])


@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph(m):
    """Captured once, replayed on new activations (the dynamic scales recomputed inside the graph)."""
    x, q, scale, b = _inputs(m, 6144, 4096, torch.bfloat16, seed=m)
    fp8_gemv(x, q, scale, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv(x, q, scale, b)
    g = torch.Generator(device="cuda").manual_seed(1)
    for magnitude in (1.0, 30.0):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g) * magnitude)
        graph.replay()
        torch.testing.assert_close(out.float(), fp8_gemv_ref(x, q, scale, b).float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("activations", ["token", "tensor"])
def test_linear_method_takes_it_up_to_max_rows(activations, monkeypatch):
    """Fp8LinearMethod's CUDA forward: the FP8 GEMV at 1..FP8_GEMV_MAX_ROWS rows, torch._scaled_mm above; both
    the scheme's result."""
    assert FP8_GEMV_MAX_ROWS == MAX_M
    method = Fp8LinearMethod(FP8Scheme("compressed-tensors", "channel", activations, serialized=False))
    layer = Linear(4096, 6144, bias=True).to("cuda", torch.bfloat16)
    method.quantize_loaded(layer)
    if activations == "tensor":
        layer.input_scale = torch.nn.Parameter(torch.full((1,), 0.02, device="cuda"), requires_grad=False)
    method.process_weights(layer)
    calls = []
    real = fp8_gemv_module.fp8_gemv
    monkeypatch.setattr(fp8_gemv_module, "fp8_gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 8, 32, 33):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        got = method.apply(layer, x)
        input_scale = layer.input_scale if activations == "tensor" else None
        want = fp8_math.fp8_linear_reference(x.float(), layer.weight, layer.weight_scale, layer.bias.float(),
                                             activations, input_scale)
        torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    assert calls == [1, 8, 32]
