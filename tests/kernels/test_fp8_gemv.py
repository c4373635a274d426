"""The FP8 skinny GEMM against its PyTorch reference (on the CPU through TRITON_INTERPRET=1, with fp32 and fp16
activations: the interpreter mishandles bf16), and that reference against the scheme's definition in
nanoserve/quantization/fp8_math.py."""

import pytest
import torch
import triton

from nanoserve.kernels import fp8_gemv as fp8_gemv_module
from nanoserve.kernels.fp8_gemv import MAX_M, fp8_gemv, fp8_gemv_ref
from nanoserve.quantization import fp8_math

# fp32 sums in another order than the reference's; fp16 outputs one rounding apart.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _inputs(m, k, n, dtype, device, gen):
    """Activation rows of magnitudes 1e-3 to 1e2 (one all zero, when there are two or more), a per-channel FP8
    weight scaled like a trained layer's, a bias."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, m)[:, None]
    if m > 1:
        x[m // 2] = 0  # a finite scale, zeros out
    w = torch.randn(n, k, generator=gen) * torch.logspace(-1, 1, n)[:, None] * k**-0.5
    q, scale = fp8_math.quantize_weight(w, "channel")
    b = torch.randn(n, generator=gen)
    return x.to(device, dtype), q.to(device), scale.reshape(-1).to(device), b.to(device, dtype)


def _static_scale(x):
    """A calibrated-like per-tensor scale that clips the largest values, as static scales may."""
    return (x.float().abs().amax() / 448.0 / 4).clamp(min=1e-6).reshape(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("k, n", [(300, 100), (80, 2100)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_fp8_gemv(device, gen, m, k, n, static, dtype):
    """Each path the shape rule picks: one row (CUDA cores, quantized in the kernel), 3 rows (CUDA cores for N <
    2048, tensor cores above; dynamic rows quantized by a first kernel), 17 (tensor cores, 32-row tiles); N and K
    off every tile size; bias on odd M."""
    x, q, scale, b = _inputs(m, k, n, dtype, device, gen)
    bias = b if m % 2 else None
    input_scale = _static_scale(x) if static else None
    got = fp8_gemv(x, q, scale, bias, input_scale)
    want = fp8_gemv_ref(x, q, scale, bias, input_scale)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got, want, **TOL[dtype])
    # The reference is the scheme's definition (the CPU path), which scales the operands before their products,
    # up to fp32 rounding: relative to the largest output, as the rows span five decades.
    scheme = fp8_math.fp8_linear_reference(x.float(), q, scale, None if bias is None else bias.float(),
                                           "tensor" if static else "token", input_scale).to(dtype).float()
    atol = TOL[dtype]["atol"] * float(scheme.abs().max())
    torch.testing.assert_close(want.float(), scheme, atol=atol, rtol=TOL[dtype]["rtol"])


@pytest.mark.parametrize("use_dot", [False, True])
def test_both_paths_at_every_m_on_strided_x(device, gen, use_dot):
    """Each path at every M, whichever the rule would pick, with the rows quantized in the kernel (dynamic and
    static scales) or by the first kernel; x a column slice of a wider tensor, out written in place."""
    k, n = 80, 50  # K off BLOCK_K, N off BLOCK_N
    for m in range(1, MAX_M + 1):
        wide, q, scale, b = _inputs(m, k + 16, n, torch.float32, device, gen)
        x, q = wide[:, 8:8 + k], q[:, :k].contiguous()
        cfg = fp8_gemv_module._Config(use_dot, 16 if use_dot else triton.next_power_of_2(m), 16, 32, 4, 2)
        mode = m % 3  # 0: dynamic in the kernel, 1: static in the kernel, 2: quantized first
        input_scale = _static_scale(x) if mode == 1 else None
        out = torch.full((m, n), float("nan"), device=device)
        if mode == 2:
            rows, row_scales = fp8_gemv_module.quantize_rows(x)
            fp8_gemv_module._launch(rows, row_scales, q, scale, b, out, cfg, quantize=False)
        else:
            fp8_gemv_module._launch(x, input_scale, q, scale, b, out, cfg, quantize=True)
        torch.testing.assert_close(out, fp8_gemv_ref(x, q, scale, b, input_scale), **TOL[torch.float32])


def test_out_in_place(device, gen):
    x, q, scale, b = _inputs(2, 64, 40, torch.float32, device, gen)
    out = torch.full((2, 40), float("nan"), device=device)
    assert fp8_gemv(x, q, scale, b, out=out) is out
    torch.testing.assert_close(out, fp8_gemv_ref(x, q, scale, b), **TOL[torch.float32])


def test_bad_inputs_raise(device, gen):
    x, q, scale, b = _inputs(MAX_M + 1, 64, 40, torch.float32, device, gen)
    with pytest.raises(ValueError, match="^x "):
        fp8_gemv(x, q, scale)
    with pytest.raises(ValueError, match="^weight "):
        fp8_gemv(x[:2], q.float(), scale)
    with pytest.raises(ValueError, match="^weight_scale "):
        fp8_gemv(x[:2], q, scale[:, None])
    with pytest.raises(ValueError, match="^bias "):
        fp8_gemv(x[:2], q, scale, b[:39])
    with pytest.raises(ValueError, match="^input_scale "):
        fp8_gemv(x[:2], q, scale, input_scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="^out "):
        fp8_gemv(x[:2], q, scale, out=torch.empty(2, 41, device=device))


def test_config_rule():
    """gemv.py's measured bf16 picks carried to one-byte weights: the same slab rows (so program counts) and tiles
    of the same bytes on the CUDA cores; Llama-3.1-8B's layers at one row all stay there."""
    cfg = fp8_gemv_module._config
    for n, k in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]:
        assert cfg(1, n, k, 2) == fp8_gemv_module._Config(False, 1, 8, 1024, 8, 1)
    assert cfg(1, 1024, 2048, 2)[2:4] == (2, 2048)  # Qwen3-0.6B o_proj: gemv.py's 2 x 1024 bf16
    assert cfg(1, 1024, 6144, 2)[2:4] == (4, 2048)  # the long two-row slab: gemv.py's 4 x 1024 bf16
    assert cfg(8, 1024, 1024, 2).use_dot is False and cfg(9, 1024, 1024, 2).use_dot
    assert cfg(2, 4096, 4096, 2) == fp8_gemv_module._Config(True, 16, 32, 256, 4, 4)
    assert cfg(32, 28672, 4096, 2) == fp8_gemv_module._Config(True, 32, 64, 256, 4, 4)
    assert cfg(32, 28672, 4096, 4).num_stages == 2


@pytest.mark.parametrize("activations", ["token", "tensor"])
def test_linear_method_dispatch(device, gen, activations):
    """Fp8LinearMethod's CUDA forward (called directly, so the interpreter runs it here) takes the FP8 GEMV for 1 to
    32 rows of any activation dtype, with the scheme's result; above, fp32 rows are left to the reference (None), as
    torch._scaled_mm takes bf16 only."""
    from nanoserve.layers.linear import Linear
    from nanoserve.quantization.fp8_linear import Fp8LinearMethod
    from nanoserve.quantization.scheme import FP8Scheme

    method = Fp8LinearMethod(FP8Scheme("compressed-tensors", "channel", activations, serialized=False))
    layer = Linear(72, 40, bias=True).to(device)
    method.quantize_loaded(layer)
    if activations == "tensor":
        layer.input_scale = torch.nn.Parameter(torch.full((1,), 0.01, device=device), requires_grad=False)
    method.process_weights(layer)
    input_scale = layer.input_scale if activations == "tensor" else None
    for m in (1, 32):
        x = torch.randn(m, 72, generator=gen).to(device)
        got = method._apply_cuda(layer, x, input_scale)
        want = fp8_math.fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias, activations,
                                             input_scale)
        assert got is not None
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert method._apply_cuda(layer, torch.randn(MAX_M + 1, 72, generator=gen).to(device), input_scale) is None
