"""The skinny GEMM with an add+RMSNorm or SiLU-and-mul prologue against the unfused references."""

import pytest
import torch
import triton

from nanoserve.kernels import gemv
from nanoserve.kernels.gemv import (
    MAX_M,
    skinny_norm_linear,
    skinny_norm_linear_ref,
    skinny_silu_mul_linear,
    skinny_silu_mul_linear_ref,
)

# (K, N): Qwen3-0.6B's qkv/gate_up input width, a K off every block size, the down_proj input width; N odd, and
# small since the interpreter takes about 10 ms per program (the GPU tests run the real layer shapes).
SHAPES = [(1024, 65), (1000, 129), (3072, 33)]


def _weights(k, n, dtype, device, gen):
    # Scaled like a trained layer so that outputs stay near 1, where the tolerances are meant to apply.
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    return w, b


def _norm_inputs(m, k, dtype, device, gen):
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    residual = torch.randn(m, k, generator=gen).to(device, dtype)
    norm_w = (1 + 0.5 * torch.randn(k, generator=gen)).to(device, dtype)
    return x, residual, norm_w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2])
def test_norm_linear(device, gen, tol, m, k, n, dtype):
    x, residual, norm_w = _norm_inputs(m, k, dtype, device, gen)
    w, b = _weights(k, n, dtype, device, gen)
    # Each shape and dtype sees bias / no bias and out= / a new output across the two row counts.
    bias = b if m == 1 else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device) if m == 2 else None
    residual_before = residual.clone()
    got, new_residual = skinny_norm_linear(x, residual, norm_w, 1e-6, w, bias, out=out)
    want, want_residual = skinny_norm_linear_ref(x, residual, norm_w, 1e-6, w, bias)
    assert out is None or got is out
    torch.testing.assert_close(got, want, **tol[dtype])
    # The next residual is x + residual rounded to the activation dtype, exactly as the unfused add writes it.
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(residual, residual_before, atol=0, rtol=0)  # the input residual is not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2])
def test_norm_linear_without_residual(device, gen, tol, m, dtype):
    """The first layer: RMSNorm(x) alone, and x itself is the next residual."""
    k, n = 1000, 129
    x, _, norm_w = _norm_inputs(m, k, dtype, device, gen)
    w, b = _weights(k, n, dtype, device, gen)
    got, new_residual = skinny_norm_linear(x, None, norm_w, 1e-5, w, b)
    want, _ = skinny_norm_linear_ref(x, None, norm_w, 1e-5, w, b)
    torch.testing.assert_close(got, want, **tol[dtype])
    assert new_residual is x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,n", [(3072, 33), (1000, 65), (64, 41)])  # K: Qwen3-0.6B's down_proj, then tails
@pytest.mark.parametrize("m", [1, 2])
def test_silu_mul_linear(device, gen, tol, m, k, n, dtype):
    x = torch.randn(m, 2 * k, generator=gen).to(device, dtype)
    w, b = _weights(k, n, dtype, device, gen)
    bias = b if m == 1 else None
    got = skinny_silu_mul_linear(x, w, bias)
    torch.testing.assert_close(got, skinny_silu_mul_linear_ref(x, w, bias), **tol[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 16])  # the CUDA cores, the tensor cores
def test_gemma_prologues(device, gen, tol, m, dtype):
    """Gemma's: the norm scales by 1 + weight (one rounding, kernels/rms_norm.py's weight_offset) and GELU (tanh)
    gates up_proj; against the references, which differ from the Llama forms."""
    k, n = 1000, 33 if m == 1 else 65
    x, residual, norm_w = _norm_inputs(m, k, dtype, device, gen)
    w, b = _weights(k, n, dtype, device, gen)
    assert gemv.tensor_cores_at(m, w) == (m == 16)
    got, new_residual = skinny_norm_linear(x, residual, norm_w - 1, 1e-6, w, b, weight_offset=1.0)
    want, want_residual = skinny_norm_linear_ref(x, residual, norm_w - 1, 1e-6, w, b, weight_offset=1.0)
    torch.testing.assert_close(got, want, **tol[dtype])
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    assert not torch.allclose(got, skinny_norm_linear_ref(x, residual, norm_w - 1, 1e-6, w, b)[0], **tol[dtype])
    gate_up = torch.randn(m, 2 * k, generator=gen).to(device, dtype)
    got = skinny_silu_mul_linear(gate_up, w, b, activation="gelu_tanh")
    torch.testing.assert_close(got, skinny_silu_mul_linear_ref(gate_up, w, b, activation="gelu_tanh"), **tol[dtype])
    assert not torch.allclose(got, skinny_silu_mul_linear_ref(gate_up, w, b), **tol[dtype])


@pytest.mark.parametrize("use_dot", [False, True])
def test_prologues_on_both_paths_with_strided_rows(device, gen, tol, use_dot):
    """Both code paths at M = 1, 2, 3 and 16 whichever the shape rule picks, on row-strided inputs (views into
    wider tensors), K off BLOCK_K so that the masked tail and a multi-tile first pass both run."""
    k, n = 80, 50
    cfg_for = {m: gemv._Config(use_dot, 16 if use_dot else triton.next_power_of_2(m), 16, 32, 4, 2)
               for m in (1, 2, 3, MAX_M)}
    for m, cfg in cfg_for.items():
        x = torch.randn(m, k + 8, generator=gen)[:, :k].to(device)
        residual = torch.randn(m, k + 24, generator=gen)[:, 16:16 + k].to(device)
        norm_w = (1 + 0.5 * torch.randn(k, generator=gen)).to(device)
        w, b = _weights(k, n, torch.float32, device, gen)
        out = torch.full((m, n), float("nan"), device=device)
        residual_out = torch.full((m, k), float("nan"), device=device)
        gemv._launch(x, w, b, out, cfg, norm=(residual, norm_w, 1e-6, residual_out))
        want, want_residual = skinny_norm_linear_ref(x, residual, norm_w, 1e-6, w, b)
        torch.testing.assert_close(out, want, **tol[torch.float32])
        torch.testing.assert_close(residual_out, want_residual, atol=0, rtol=0)

        gate_up = torch.randn(m, 2 * k + 6, generator=gen)[:, 3:3 + 2 * k].to(device)
        out = torch.full((m, n), float("nan"), device=device)
        gemv._launch(gate_up, w, None, out, cfg, silu_mul=True)
        torch.testing.assert_close(out, skinny_silu_mul_linear_ref(gate_up, w), **tol[torch.float32])


def test_row_tiles(device, gen, tol):
    """More rows than one tile holds (37 rows in tiles of 16: the last one ragged): each tile's programs normalize and
    write the next residual for their own rows, with and without a prologue."""
    m, k, n = 37, 80, 50
    cfg = gemv._Config(True, 16, 16, 32, 4, 2)
    x = torch.randn(m, k, generator=gen).to(device)
    residual = torch.randn(m, k, generator=gen).to(device)
    norm_w = (1 + 0.5 * torch.randn(k, generator=gen)).to(device)
    w, b = _weights(k, n, torch.float32, device, gen)
    out = torch.full((m, n), float("nan"), device=device)
    gemv._launch(x, w, b, out, cfg)
    torch.testing.assert_close(out, gemv.skinny_linear_ref(x, w, b), **tol[torch.float32])
    residual_out = torch.full((m, k), float("nan"), device=device)
    gemv._launch(x, w, None, out, cfg, norm=(residual, norm_w, 1e-6, residual_out))
    want, want_residual = skinny_norm_linear_ref(x, residual, norm_w, 1e-6, w)
    torch.testing.assert_close(out, want, **tol[torch.float32])
    torch.testing.assert_close(residual_out, want_residual, atol=0, rtol=0)
    gate_up = torch.randn(m, 2 * k, generator=gen).to(device)
    gemv._launch(gate_up, w, b, out, cfg, silu_mul=True)
    torch.testing.assert_close(out, skinny_silu_mul_linear_ref(gate_up, w, b), **tol[torch.float32])


def test_bad_inputs_raise(device, gen):
    x, residual, norm_w = _norm_inputs(2, 64, torch.float32, device, gen)
    w, _ = _weights(64, 40, torch.float32, device, gen)
    with pytest.raises(ValueError, match="^norm_weight "):
        skinny_norm_linear(x, residual, norm_w[:32], 1e-6, w)
    with pytest.raises(ValueError, match="^residual "):
        skinny_norm_linear(x, residual[:1], norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="^residual "):
        skinny_norm_linear(x, residual.half(), norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="^weight "):
        skinny_norm_linear(x, residual, norm_w, 1e-6, w[:, :32].contiguous())
    with pytest.raises(ValueError, match="^x "):
        skinny_silu_mul_linear(x[:, :63], w)
    with pytest.raises(ValueError, match="^weight "):
        skinny_silu_mul_linear(x, w)  # x is [2, 64]: gate | up of 32 each, but w takes 64


def test_skinny_gemm_rule():
    """The fused prologues ride on the skinny GEMM's own choice (1-32 rows, weights up to 64 MB, graph capture) and
    take its CUDA-core path only: the step's plan (layers/step_plan.py) decides both."""
    from nanoserve.layers.step_plan import KernelPlanner

    planner = KernelPlanner()

    def plan(rows: int, graph: bool = True):
        return planner.plan(rows, rows, rows, graph=graph)

    llama8b_qkv, llama8b_gate_up = torch.empty(6144, 4096, dtype=torch.bfloat16, device="meta"), torch.empty(
        28672, 4096, dtype=torch.bfloat16, device="meta")  # 50 and 235 MB
    assert not plan(1, graph=False).takes_skinny_gemm(llama8b_qkv)  # eager: cuBLAS
    assert plan(1).takes_skinny_gemm(llama8b_qkv) and plan(2).takes_skinny_gemm(llama8b_qkv)
    assert plan(3).takes_skinny_gemm(llama8b_qkv) and plan(32).takes_skinny_gemm(llama8b_qkv)
    assert not plan(33).takes_skinny_gemm(llama8b_qkv)
    assert not plan(1).takes_skinny_gemm(llama8b_gate_up)
    # An fp8 weight at any size: past the limit, the alternative is a quantize launch and torch._scaled_mm.
    assert plan(1).takes_skinny_gemm(llama8b_gate_up.to(torch.float8_e4m3fn))
    assert not plan(1, graph=False).takes_skinny_gemm(llama8b_gate_up.to(torch.float8_e4m3fn))
    # The prologues only at one row on the CUDA cores, where fusing measured faster: a 50 MB weight takes the
    # tensor cores at one row, and its norm runs as its own kernel.
    qwen3_qkv = torch.empty(4096, 1024, dtype=torch.bfloat16, device="meta")
    assert plan(1).takes_fused_prologue(qwen3_qkv)
    assert not plan(1, graph=False).takes_fused_prologue(qwen3_qkv)
    assert not plan(2).takes_fused_prologue(qwen3_qkv)
    assert not plan(1).takes_fused_prologue(llama8b_qkv)
    assert not plan(1).takes_fused_prologue(llama8b_gate_up)


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts Python calls, which graph replays skip; on a GPU "
                    "tests/gpu/test_gemv_fused_gpu.py checks the model's tokens")
def test_model_takes_the_fused_path_and_keeps_its_tokens(checkpoints, monkeypatch, fake_graph_capture):
    """Qwen3 in the engine on the CPU with graph capture faked: every decode step of one row must go through the
    fused kernels (run by the interpreter; about a second a launch) in every layer, and give the greedy tokens of
    the unfused model."""
    from nanoserve import LLM, SamplingParams

    prompts = [[5, 17, 300, 42, 9]]
    # Two tokens: the prefill's and one decode step's, the step every decode step is (each launch is interpreted).
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(str(checkpoints["qwen3"]), num_kv_blocks=16, max_num_seqs=1)
        num_layers = len(llm.engine.runner.model.model.layers)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], num_layers

    reference, num_layers = generate()
    calls = {"skinny_linear": 0, "skinny_norm_linear": 0, "skinny_silu_mul_linear": 0}
    for name in calls:
        original = getattr(gemv, name)
        monkeypatch.setattr(gemv, name, lambda *a, _f=original, _n=name, **kw: calls.__setitem__(_n, calls[_n] + 1)
                            or _f(*a, **kw))
    fake_graph_capture(monkeypatch)
    fused, _ = generate()
    assert fused == reference
    # The decode step (of 1 row), through every layer: o_proj alone is unfused, and the two norms of a layer each
    # fold into a projection. The prefill step (5 rows) takes the skinny GEMM unfused, 4 a layer.
    steps = calls["skinny_silu_mul_linear"] // num_layers
    assert steps == 1 and calls["skinny_silu_mul_linear"] == steps * num_layers
    assert calls["skinny_norm_linear"] == 2 * steps * num_layers
    assert calls["skinny_linear"] == steps * num_layers + 4 * num_layers


@pytest.mark.parametrize("use_dot", [False, True])
def test_late_dependents(device, gen, monkeypatch, use_dot):
    """late_dependents compiles the late start in on the CUDA-core path only (the tensor-core path's few programs
    leave room), and moves only when the next kernel may start: the outputs are bit for bit the same."""
    m, k, n = (1, 1024, 65) if not use_dot else (4, 256, 2048)
    x, residual, norm_w = _norm_inputs(m, k, torch.float32, device, gen)
    w, b = _weights(k, n, torch.float32, device, gen)
    assert gemv.tensor_cores_at(m, w) == use_dot
    seen = []
    kernel = gemv._skinny_linear_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["LATE_DEPENDENTS"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(gemv, "_skinny_linear_kernel", Spy())
    early = skinny_norm_linear(x, residual, norm_w, 1e-6, w, b)
    late = skinny_norm_linear(x, residual, norm_w, 1e-6, w, b, late_dependents=True)
    assert seen == [False, not use_dot]
    for got, want in zip(late, early, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 16])  # the CUDA cores, the tensor cores
def test_prologues_with_fp8_weight(device, gen, tol, m, dtype):
    """Both prologues before an fp8 weight with per-row scales, against the unfused references on the dequantized
    weight (weight.float() * scale[:, None]); N off BLOCK_N, K off BLOCK_K, a bias."""
    k, n = 1000, 65
    x, residual, norm_w = _norm_inputs(m, k, dtype, device, gen)
    w = torch.randn(n, k, generator=gen).to(device, torch.float8_e4m3fn)
    scale = ((0.5 + torch.rand(n, generator=gen)) * k**-0.5).to(device)
    _, b = _weights(k, n, dtype, device, gen)
    assert gemv.tensor_cores_at(m, w) == (m == 16)
    got, new_residual = skinny_norm_linear(x, residual, norm_w, 1e-6, w, b, weight_scale=scale)
    want, want_residual = skinny_norm_linear_ref(x, residual, norm_w, 1e-6, w, b, weight_scale=scale)
    torch.testing.assert_close(got, want, **tol[dtype])
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)
    if dtype == torch.float32:  # the reference's dequantization spelled out (fp16 would round the weight)
        dequantized = w.float() * scale[:, None]
        torch.testing.assert_close(got, skinny_norm_linear_ref(x, residual, norm_w, 1e-6, dequantized, b)[0],
                                   **tol[dtype])
    gate_up = torch.randn(m, 2 * k, generator=gen).to(device, dtype)
    got = skinny_silu_mul_linear(gate_up, w, b if m == 1 else None, weight_scale=scale)
    want = skinny_silu_mul_linear_ref(gate_up, w, b if m == 1 else None, weight_scale=scale)
    torch.testing.assert_close(got, want, **tol[dtype])
