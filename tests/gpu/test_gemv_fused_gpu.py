"""On a GPU, in bf16: the skinny GEMM's fused prologues against the unfused kernels (add+RMSNorm or SiLU-and-mul,
then the skinny GEMM), also replayed from a CUDA graph; and batch-1/2 decode through them in the engine."""

import pytest
import torch
from checkpoints import write_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_TOL = dict(atol=2e-2, rtol=2e-2)
# (K, N): Qwen3-0.6B's qkv and gate_up, Llama-3.1-8B's qkv; an odd tail.
NORM_SHAPES = [(1024, 4096), (1024, 6144), (4096, 6144), (1000, 1001)]
# (I, N): Qwen3-0.6B's and Llama-3.1-8B's down_proj; an odd tail.
SILU_SHAPES = [(3072, 1024), (14336, 4096), (1000, 1001)]


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("m", [1, 2])
def test_norm_linear_gpu(m, residual):
    from nanoserve.kernels.gemv import skinny_linear, skinny_norm_linear, skinny_norm_linear_ref
    from nanoserve.kernels.rms_norm import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, n in NORM_SHAPES:
        x, norm_w = _randn(m, k, gen=gen), 1 + _randn(k, gen=gen, scale=0.5)
        res = _randn(m, k, gen=gen) if residual else None
        w, b = _randn(n, k, gen=gen, scale=k**-0.5), _randn(n, gen=gen)
        out, new_res = skinny_norm_linear(x, res, norm_w, 1e-6, w, b)
        want, want_res = skinny_norm_linear_ref(x, res, norm_w, 1e-6, w, b)
        torch.testing.assert_close(out, want, **BF16_TOL)
        # Against the kernels it replaces: the residual bit for bit; the output up to the order of the fp32 sum
        # of squares (the rms may differ in its last bit, and the normalized row then round differently).
        unfused_res = res.clone() if residual else None
        unfused = skinny_linear(rms_norm(x, norm_w, 1e-6, unfused_res), w, b)
        torch.testing.assert_close(new_res, unfused_res if residual else x, atol=0, rtol=0)
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
        torch.testing.assert_close(out, unfused, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("m", [1, 2])
def test_silu_mul_linear_gpu(m):
    from nanoserve.kernels.activation import silu_and_mul
    from nanoserve.kernels.gemv import skinny_linear, skinny_silu_mul_linear, skinny_silu_mul_linear_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    for i, n in SILU_SHAPES:
        x, w = _randn(m, 2 * i, gen=gen), _randn(n, i, gen=gen, scale=i**-0.5)
        out = skinny_silu_mul_linear(x, w)
        torch.testing.assert_close(out, skinny_silu_mul_linear_ref(x, w), **BF16_TOL)
        # Elementwise prologue, same accumulation order: bit for bit the unfused pair.
        torch.testing.assert_close(out, skinny_linear(silu_and_mul(x), w), atol=0, rtol=0)


def test_fused_in_a_cuda_graph():
    from nanoserve.kernels.gemv import skinny_norm_linear, skinny_norm_linear_ref, skinny_silu_mul_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    x, res, norm_w = _randn(2, 1024, gen=gen), _randn(2, 1024, gen=gen), 1 + _randn(1024, gen=gen, scale=0.5)
    w_up, w_down = _randn(6144, 1024, gen=gen, scale=1 / 32), _randn(1024, 3072, gen=gen, scale=3072**-0.5)
    skinny_silu_mul_linear(skinny_norm_linear(x, res, norm_w, 1e-6, w_up)[0], w_down)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate_up, new_res = skinny_norm_linear(x, res, norm_w, 1e-6, w_up)
        out = skinny_silu_mul_linear(gate_up, w_down)
    for _ in range(2):
        x.copy_(_randn(2, 1024, gen=gen))
        res.copy_(_randn(2, 1024, gen=gen))
        graph.replay()
        want_gate_up, want_res = skinny_norm_linear_ref(x, res, norm_w, 1e-6, w_up)
        torch.testing.assert_close(gate_up, want_gate_up, **BF16_TOL)
        torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
        torch.testing.assert_close(out, skinny_silu_mul_linear(gate_up, w_down), atol=0, rtol=0)


@pytest.mark.parametrize("num_prompts", [1, 2])
def test_engine_batch_one_and_two_decode(tmp_path, monkeypatch, num_prompts):
    """Decode steps of 1 and 2 rows run in CUDA graphs through the fused kernels: same greedy tokens in fp32
    as the eager engine (unfused), and the fused kernels really were captured."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.kernels import gemv

    ckpt = write_checkpoint(tmp_path / "qwen3", "qwen3", hidden_size=256, intermediate_size=768,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3)
    prompts = [[5, 17, 300, 42, 9, 11, 250], [77, 3, 8]][:num_prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = tokens(LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=64))
    calls = []
    original = gemv.skinny_norm_linear
    monkeypatch.setattr(gemv, "skinny_norm_linear", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=64)  # captures the decode graphs
    assert calls, "no decode graph captured the fused norm + GEMM"
    assert tokens(fast) == reference


def test_silu_mul_gemv_gpu():
    """One row of SiLU-and-mul and a projection in one kernel, at Llama-3.1-8B's down_proj and two odd shapes, called
    and replayed from a CUDA graph, against the fp32 reference and the unfused kernels."""
    from nanoserve.kernels.activation import silu_and_mul
    from nanoserve.kernels.silu_mul_gemv import silu_mul_gemv, silu_mul_gemv_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    # The last shape has more 16-row blocks (512) than an H100 or H200 has program slots (264): programs walk two.
    for i, n in [(14336, 4096), (1000, 1001), (1000, 8191)]:
        x, w = _randn(1, 2 * i, gen=gen), _randn(n, i, gen=gen, scale=i**-0.5)
        torch.cuda.synchronize()  # the kernel reads the weight before its PDL wait
        out = silu_mul_gemv(x, w)
        torch.testing.assert_close(out, silu_mul_gemv_ref(x, w), **BF16_TOL)
        torch.testing.assert_close(out, torch.nn.functional.linear(silu_and_mul(x), w), **BF16_TOL)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = silu_mul_gemv(x, w)
        x.copy_(_randn(1, 2 * i, gen=gen))
        graph.replay()
        torch.testing.assert_close(captured, silu_mul_gemv_ref(x, w), **BF16_TOL)


def test_engine_batch_one_through_silu_mul_gemv(tmp_path, monkeypatch):
    """With the skinny GEMM's limit at 0 bytes every down_proj counts as large: batch-1 decode graphs run it
    through silu_mul_gemv, with the greedy tokens of the eager engine in fp32."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.kernels import silu_mul_gemv
    from nanoserve.layers import step_plan

    ckpt = write_checkpoint(tmp_path / "llama", "llama", hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    prompts = [[5, 17, 300, 42, 9, 11, 250]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = tokens(LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=64))
    calls = []
    original = silu_mul_gemv.silu_mul_gemv
    monkeypatch.setattr(silu_mul_gemv, "silu_mul_gemv", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(step_plan, "SKINNY_MAX_WEIGHT_BYTES", 0)
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=64)  # captures the decode graphs
    assert calls, "no decode graph captured silu_mul_gemv"
    assert tokens(fast) == reference


def test_late_dependents_in_a_cuda_graph():
    """Qwen3-0.6B's batch-1 qkv GEMV starting the fused rope decode late, under PDL in a graph, as the engine runs
    them: the GEMV matches its reference, and attention's output and stored key and value are the early start's
    bits."""
    from nanoserve.kernels.decode_rope_attention import decode_rope_attention
    from nanoserve.kernels.gemv import skinny_norm_linear, skinny_norm_linear_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    x, res, norm_w = _randn(1, 1024, gen=gen), _randn(1, 1024, gen=gen), 1 + _randn(1024, gen=gen, scale=0.5)
    w = _randn(4096, 1024, gen=gen, scale=1024**-0.5)
    q_w, k_w = 1 + _randn(128, gen=gen, scale=0.3), 1 + _randn(128, gen=gen, scale=0.3)
    freqs = torch.randn(128, 64, device="cuda", generator=gen)
    cos, sin = freqs.cos(), freqs.sin()
    # One sequence of 100 keys in 8 pages of 16 (two splits, merged in the launch); the new key at position 99.
    caches = (_randn(8, 16, 8, 128, gen=gen), _randn(8, 16, 8, 128, gen=gen))
    seq_lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    block_tables = torch.arange(8, dtype=torch.int32, device="cuda")[None]
    pos, slot = torch.tensor([99], device="cuda"), torch.tensor([99], device="cuda")
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")
    outs = []
    for late in (False, True):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            qkv, _ = skinny_norm_linear(x, res, norm_w, 1e-6, w, late_dependents=late)
            out = decode_rope_attention(qkv, 16, 8, pos, cos, sin, q_w, k_w, 1e-6, k_cache, v_cache, slot, seq_lens,
                                        block_tables, 128**-0.5, counters=counters)
        graph.replay()
        torch.cuda.synchronize()
        outs.append((qkv.clone(), out.clone(), k_cache, v_cache))
    torch.testing.assert_close(outs[1][0], skinny_norm_linear_ref(x, res, norm_w, 1e-6, w)[0], **BF16_TOL)
    for early, late in zip(*outs, strict=True):
        assert torch.equal(early, late)
    assert not torch.equal(outs[1][2], caches[0])  # the new key was stored
