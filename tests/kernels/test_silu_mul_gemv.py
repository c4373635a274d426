"""One row of SiLU-and-mul and a large projection in one kernel (kernels/silu_mul_gemv.py) against the reference."""

import pytest
import torch

from nanoserve.kernels import silu_mul_gemv as kernel
from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv, silu_mul_gemv_ref


# (K, N). Off CUDA the grid is 8 programs, so past 8 x 16 = 128 rows programs walk several row blocks: 200 rows
# (a ragged last block), then a K off the 512-wide tile, the two together, a single tile, and several tiles over
# 19 row blocks.
@pytest.mark.parametrize("k,n", [(1024, 200), (1000, 37), (1000, 200), (512, 16), (1536, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(device, gen, tol, k, n, dtype):
    x = torch.randn(1, 2 * k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    got = silu_mul_gemv(x, w)
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got, silu_mul_gemv_ref(x, w), **tol[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh(device, gen, tol, dtype):
    """Gemma's GELU (tanh) in SiLU's place (its 27B down_proj, 231 MB, takes this kernel at batch 1)."""
    x = torch.randn(1, 2 * 1000, generator=gen).to(device, dtype)
    w = (torch.randn(200, 1000, generator=gen) * 1000**-0.5).to(device, dtype)
    got = silu_mul_gemv(x, w, "gelu_tanh")
    torch.testing.assert_close(got, silu_mul_gemv_ref(x, w, "gelu_tanh"), **tol[dtype])
    assert not torch.allclose(got, silu_mul_gemv_ref(x, w), **tol[dtype])


def test_bad_inputs_raise(device, gen):
    x = torch.randn(1, 64, generator=gen).to(device)
    w = torch.randn(40, 32, generator=gen).to(device)
    with pytest.raises(ValueError, match="^x must be one contiguous row"):
        silu_mul_gemv(torch.cat([x, x]), w)  # two rows
    with pytest.raises(ValueError, match="^x must be one contiguous row"):
        silu_mul_gemv(x[:, :63], w)  # odd width
    with pytest.raises(ValueError, match="^weight must be contiguous"):
        silu_mul_gemv(x, w[:, :16].contiguous())
    with pytest.raises(ValueError, match="^weight dtype"):
        silu_mul_gemv(x, w.half())


def test_routing_rule():
    """One row inside a CUDA graph, a weight past the skinny GEMM's 64 MB, no bias: Llama-3.1-8B's down_proj."""
    from nanoserve.layers.step_plan import KernelPlanner

    planner = KernelPlanner()
    llama8b_down = torch.empty(4096, 14336, dtype=torch.bfloat16, device="meta")  # 117 MB
    qwen3_down = torch.empty(1024, 3072, dtype=torch.bfloat16, device="meta")  # 6 MB: the skinny GEMM's
    one_row, two_rows = planner.plan(1, 1, 1, graph=True), planner.plan(2, 2, 2, graph=True)
    assert not planner.plan(1, 1, 1).takes_silu_mul_gemv(llama8b_down, None)  # not in a graph
    assert one_row.takes_silu_mul_gemv(llama8b_down, None)
    assert not two_rows.takes_silu_mul_gemv(llama8b_down, None)  # two rows: cuBLAS after SiLU-and-mul
    assert not one_row.takes_silu_mul_gemv(llama8b_down, torch.zeros(4096))
    assert not one_row.takes_silu_mul_gemv(qwen3_down, None)
    assert one_row.takes_fused_prologue(qwen3_down)


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts Python calls, which graph replays skip; on a GPU "
                    "tests/gpu/test_gemv_fused_gpu.py checks the model's tokens")
def test_model_keeps_its_tokens(checkpoints, monkeypatch, fake_graph_capture):
    """Qwen3 on the CPU with graph capture faked and the skinny GEMM's limit at 0 bytes, so that every projection
    counts as large: each one-row decode step's down_proj goes through silu_mul_gemv in every layer (run by the
    interpreter), with the greedy tokens of the unfused model."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.layers import step_plan

    prompts = [[5, 17, 300, 42, 9]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def generate():
        llm = LLM(str(checkpoints["qwen3"]), num_kv_blocks=16, max_num_seqs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], len(llm.engine.runner.model.model.layers)

    reference, num_layers = generate()
    calls = []
    original = kernel.silu_mul_gemv
    monkeypatch.setattr(kernel, "silu_mul_gemv", lambda *a: calls.append(1) or original(*a))
    fake_graph_capture(monkeypatch)
    monkeypatch.setattr(step_plan, "SKINNY_MAX_WEIGHT_BYTES", 0)
    fused, _ = generate()
    assert fused == reference
    assert len(calls) == 2 * num_layers  # the 2 decode steps of 1 row; the 5-row prefill is unfused
