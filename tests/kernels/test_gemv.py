"""The skinny (small-M) linear kernel against its PyTorch reference."""

import pytest
import torch
import triton

from nanoserve.kernels import gemv
from nanoserve.kernels.gemv import MAX_M, skinny_linear, skinny_linear_ref

SHAPES = [(1024, 6144), (2048, 1024), (3072, 1024), (64, 40), (200, 129)]  # (K, N): real layers and odd tails
# Each shape in both dtypes on a GPU; under the CPU's interpreter (seconds a launch at the real layers' sizes, CI's
# time) the real layers in fp16 only, the odd tails in both.
CASES = [(k, n, dtype) for k, n in SHAPES for dtype in (torch.float32, torch.float16)
         if torch.cuda.is_available() or k * n < 2**16 or dtype == torch.float16]


def _inputs(m, k, n, dtype, device, gen):
    # Weights scaled like a trained layer keep outputs near 1, where the tolerances are meant to apply.
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    return x, w, b


@pytest.mark.parametrize("k,n,dtype", CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_skinny_linear(device, gen, tol, m, k, n, dtype):
    # One launch per case keeps the interpreter quick; over the four M values each shape and dtype sees
    # every pairing of bias / no bias with out= / a new output.
    x, w, b = _inputs(m, k, n, dtype, device, gen)
    bias = b if m in (1, 8) else None
    if m in (1, 3):
        out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
        assert skinny_linear(x, w, bias, out=out) is out
    else:
        out = skinny_linear(x, w, bias)
    torch.testing.assert_close(out, skinny_linear_ref(x, w, bias), **tol[dtype])


@pytest.mark.parametrize("use_dot", [False, True])
def test_both_paths_at_every_m_on_strided_x(device, gen, tol, use_dot):
    """Each code path at every M, whichever the shape rule would pick; x a column slice of a wider tensor."""
    k, n = 80, 50  # K off BLOCK_K, N off BLOCK_N
    for m in range(1, MAX_M + 1):
        wide, w, b = _inputs(m, k + 16, n, torch.float32, device, gen)
        x, w = wide[:, 8 : 8 + k], w[:, :k].contiguous()
        cfg = gemv._Config(use_dot, 16 if use_dot else triton.next_power_of_2(m), 16, 32, 4, 2)
        out = torch.full((m, n), float("nan"), device=device)
        gemv._launch(x, w, b, out, cfg)
        torch.testing.assert_close(out, skinny_linear_ref(x, w, b), **tol[torch.float32])


def test_bad_inputs_raise(device, gen):
    x, w, b = _inputs(MAX_M + 1, 64, 40, torch.float32, device, gen)
    with pytest.raises(ValueError, match="^x "):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match="^weight "):
        skinny_linear(x[:2], w[:, :32].contiguous())
    with pytest.raises(ValueError, match="^bias "):
        skinny_linear(x[:2], w, b[:39])
    with pytest.raises(ValueError, match="^out "):
        skinny_linear(x[:2], w, out=torch.empty(2, 41, device=device))


def test_config_rule_at_batch_1():
    """The measured picks at M = 1 (bf16): two-row slabs for short K, four rows of 1024-wide tiles for K >= 3072."""
    assert gemv._config(1, 1024, 2048, 2)[2:4] == (2, 1024)  # o_proj: N, K
    assert gemv._config(1, 1024, 3072, 2)[2:4] == (4, 1024)  # down_proj
    assert gemv._config(1, 6144, 1024, 2)[2:4] == (8, 512)  # gate_up_proj
    assert gemv._config(2, 1024, 3072, 2)[2:4] == (2, 1024)  # M = 2 keeps its two-row slabs
    # Two rows of a wide layer go to the tensor cores (measured faster in whole batch-2 decode steps).
    assert gemv._config(2, 4096, 1024, 2) == gemv._Config(True, 16, 64, 256, 4, 4)  # Qwen3-0.6B qkv_proj
    assert gemv._config(2, 2048, 1024, 2).use_dot is False
    # One row of a weight of 32 MB or more (Llama-3.1-8B's qkv_proj, o_proj) too; Qwen3-0.6B's stay on the CUDA cores.
    assert gemv._config(1, 6144, 4096, 2).use_dot and gemv._config(1, 4096, 4096, 2).use_dot
    assert not gemv._config(1, 4096, 2048, 2).use_dot


def test_config_rule_pads_rows_to_16_or_32():
    """Tensor-core tiles hold 16 rows up to M = 16 and 32 rows from 17 to 32, with the same weight slabs."""
    assert gemv._config(16, 4096, 1024, 2) == gemv._Config(True, 16, 64, 256, 4, 4)
    assert gemv._config(17, 4096, 1024, 2) == gemv._Config(True, 32, 64, 256, 4, 4)
    assert gemv._config(32, 1024, 3072, 2) == gemv._Config(True, 32, 16, 256, 4, 4)
    assert gemv._config(32, 1024, 3072, 4).num_stages == 2  # fp32 tiles: two stages fit in shared memory


def _fp8_weight(n, k, device, gen):
    """An fp8 weight [N, K] and fp32 scales per row [N] that differ row to row and keep outputs near 1."""
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = (0.5 + torch.rand(n, generator=gen)) * k**-0.5
    return w.to(device), scale.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [1024, 200])  # K a whole number of tiles, K off every BLOCK_K
@pytest.mark.parametrize("m", [1, 16])  # the CUDA cores, the tensor cores
def test_fp8_weight(device, gen, tol, m, k, dtype):
    """An fp8 weight with per-row scales, dequantized in the kernel, against weight.float() * scale[:, None]."""
    n = 129  # off every BLOCK_N
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w, scale = _fp8_weight(n, k, device, gen)
    b = torch.randn(n, generator=gen).to(device, dtype)
    assert gemv.tensor_cores_at(m, w) == (m == 16)
    bias = b if k == 200 else None
    got = skinny_linear(x, w, bias, weight_scale=scale)
    want = x.float() @ (w.float() * scale[:, None]).T + (0 if bias is None else bias.float())
    torch.testing.assert_close(got, want.to(dtype), **tol[dtype])
    torch.testing.assert_close(got, skinny_linear_ref(x, w, bias, weight_scale=scale), **tol[dtype])


def test_config_counts_the_weights_bytes():
    """An fp8 weight takes the path of a bf16 weight of as many bytes: Llama-3.1-8B's qkv_proj (6144 x 4096) is 48 MB
    in bf16, on the tensor cores at one row, and 24 MB in fp8, on the CUDA cores."""
    assert gemv._config(1, 6144, 4096, 2).use_dot and not gemv._config(1, 6144, 4096, 1).use_dot
    w = torch.empty(6144, 4096, dtype=torch.float8_e4m3fn)
    assert not gemv.tensor_cores_at(1, w) and gemv.tensor_cores_at(1, w.to(torch.bfloat16))
    # At one row an fp8 weight stays on the CUDA cores at any size (down_proj, 59 MB, measured 2.3x faster there).
    down = torch.empty(4096, 14336, dtype=torch.float8_e4m3fn, device="meta")
    assert not gemv.tensor_cores_at(1, down) and gemv.tensor_cores_at(2, down)


def test_bad_fp8_inputs_raise(device, gen):
    x = torch.randn(2, 64, generator=gen).to(device)
    w, scale = _fp8_weight(40, 64, device, gen)
    with pytest.raises(ValueError, match="^weight dtype"):
        skinny_linear(x, w)  # fp8 without its scales
    with pytest.raises(ValueError, match="^weight dtype"):
        skinny_linear(x, w.float(), weight_scale=scale)  # scales on an unquantized weight
    with pytest.raises(ValueError, match="^weight_scale "):
        skinny_linear(x, w, weight_scale=scale[:39])
    with pytest.raises(ValueError, match="^weight_scale "):
        skinny_linear(x, w, weight_scale=scale.half())
