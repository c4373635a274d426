"""fused_moe against kernels/moe_reference.py in bf16 at real model shapes, and inside a CUDA graph (GPU only)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_TOL = dict(atol=2e-2, rtol=2e-2)
QWEN3_30B_A3B = dict(num_experts=128, hidden=2048, inter=768, top_k=8)
GPT_OSS_20B = dict(num_experts=32, hidden=2880, inter=2880, top_k=4)  # tiles do not divide 2880: the tails run


def _weights(num_experts, hidden, inter, gen, bias=False):
    # Scaled like trained layers, so that outputs stay near 1 where the tolerances are meant to apply.
    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device="cuda") * scale).bfloat16()

    w13, w2 = randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5), randn(num_experts, hidden, inter,
                                                                               scale=inter**-0.5)
    return w13, w2, *((randn(num_experts, 2 * inter), randn(num_experts, hidden)) if bias else (None, None))


def _routing(num_tokens, num_experts, top_k, gen):
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
def test_fused_moe_qwen3_30b_a3b(num_tokens):
    """Decode through prefill; at 2048 tokens (16k pairs) the alignment takes its launches for many pairs."""
    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i, k = QWEN3_30B_A3B.values()
    w13, w2, _, _ = _weights(e, h, i, gen)
    x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
    weights, ids = _routing(num_tokens, e, k, gen)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **BF16_TOL)


@pytest.mark.parametrize("num_tokens", [3, 300])
def test_fused_moe_gpt_oss_biases_and_expert_parallel(num_tokens):
    """gpt-oss-20b's experts (swigluoai, biases, dims the tiles do not divide) as rank 1 of 2 under expert
    parallelism: experts 16-31 here, int32 ids."""
    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i, k = GPT_OSS_20B.values()
    w13, w2, b13, b2 = _weights(e // 2, h, i, gen, bias=True)
    x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
    weights, ids = _routing(num_tokens, e, k, gen)
    kw = dict(expert_start=e // 2, w13_bias=b13, w2_bias=b2, activation="swigluoai")
    out = fused_moe(x, w13, w2, weights, ids.int(), **kw)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids, **kw), **BF16_TOL)


@pytest.mark.parametrize("num_tokens", [3, 600])
def test_fused_moe_fp32(num_tokens):
    """fp32 (the GPU engine tests' dtype) through both default tile rules: the tiles must fit in shared memory."""
    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13, w2, b13, b2 = (t.float() for t in _weights(8, 1024, 512, gen, bias=True))
    x = torch.randn(num_tokens, 1024, generator=gen, device="cuda")
    weights, ids = _routing(num_tokens, 8, 2, gen)
    out = fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    want = fused_moe_ref(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_align_many_pairs():
    """The launches for many pairs (64k) put every local pair in exactly one row of its expert's blocks."""
    from nanoserve.kernels.moe_align import moe_align_block_size, moe_align_block_size_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    _, ids = _routing(8192, 128, 8, gen)
    align = moe_align_block_size(ids, 64, 64, expert_start=32)
    runs, rows_used = moe_align_block_size_ref(ids, 64, 64, expert_start=32)
    assert int(align.rows_used) == rows_used
    sorted_ids, block_expert = align.sorted_ids.cpu(), align.block_expert.cpu()
    row = 0
    for e, run in enumerate(runs):
        padded = -(-len(run) // 64) * 64
        assert (block_expert[row // 64 : (row + padded) // 64] == e).all()
        assert sorted(sorted_ids[row : row + len(run)].tolist()) == run
        assert (sorted_ids[row + len(run) : row + padded] == ids.numel()).all()
        row += padded


@pytest.mark.parametrize("num_tokens", [4, 1024])
def test_fused_moe_in_a_cuda_graph(num_tokens):
    """Captured once, replayed with a new routing written into the same tensors: the new routing's answer (decode
    size, and 8k pairs where the alignment takes its launches for many pairs)."""
    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = QWEN3_30B_A3B.values()
    w13, w2, _, _ = _weights(e, h, i, gen)
    x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
    weights, ids = _routing(num_tokens, e, k, gen)
    first = fused_moe(x, w13, w2, weights, ids)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    new_weights, new_ids = _routing(num_tokens, e, k, gen)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn(num_tokens, h, generator=gen, device="cuda"))
    graph.replay()
    want = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, want, **BF16_TOL)
    assert not torch.allclose(out, first, **BF16_TOL)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_moe_gemv_qwen3_30b_a3b(num_tokens):
    """The decode GEMVs (kernels/moe_gemv.py) at Qwen3-30B-A3B's shape, whole and as rank 1 of 2 under tensor
    parallelism (I = 384: other tiles); the same bits on a second run (the sum over top-k has a fixed order)."""
    from nanoserve.kernels.moe_gemv import moe_gemv
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i, k = QWEN3_30B_A3B.values()
    for inter in (i, i // 2):
        w13, w2, _, _ = _weights(e, h, inter, gen)
        x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
        weights, ids = _routing(num_tokens, e, k, gen)
        out = moe_gemv(x, w13, w2, weights, ids.int())
        torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), **BF16_TOL)
        assert torch.equal(out, moe_gemv(x, w13, w2, weights, ids.int()))


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_moe_gemv_gpt_oss_biases_and_expert_parallel(num_tokens):
    """gpt-oss-20b's experts (swigluoai, biases, dims no tile divides) as rank 1 of 2 under expert parallelism."""
    from nanoserve.kernels.moe_gemv import moe_gemv
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    e, h, i, k = GPT_OSS_20B.values()
    w13, w2, b13, b2 = _weights(e // 2, h, i, gen, bias=True)
    x = torch.randn(num_tokens, h, generator=gen, device="cuda").bfloat16()
    weights, ids = _routing(num_tokens, e, k, gen)
    kw = dict(expert_start=e // 2, w13_bias=b13, w2_bias=b2, activation="swigluoai")
    out = moe_gemv(x, w13, w2, weights, ids, **kw)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids, **kw), **BF16_TOL)


def test_moe_gemv_fp32_in_a_cuda_graph():
    """fp32 (the GPU engine tests' dtype), captured at one token and replayed with a new routing and input."""
    from nanoserve.kernels.moe_gemv import moe_gemv
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, w2, b13, b2 = (t.float() for t in _weights(64, 1024, 512, gen, bias=True))
    x = torch.randn(1, 1024, generator=gen, device="cuda")
    weights, ids = _routing(1, 64, 8, gen)
    first = moe_gemv(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    new_weights, new_ids = _routing(1, 64, 8, gen)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    x.copy_(torch.randn(1, 1024, generator=gen, device="cuda"))
    graph.replay()
    want = fused_moe_ref(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out, first, atol=1e-4, rtol=1e-4)


def test_router_topk_in_a_cuda_graph():
    """router_topk (norm, router GEMV and top-k in one launch; the last of its programs takes the top-k) replayed
    from a graph with new inputs, fp32 against the three steps it replaces: the counter protocol must hand every
    program's logits to the last one, and leave the counter zero for the next replay."""
    from nanoserve.kernels.moe_reference import topk_softmax_ref
    from nanoserve.kernels.moe_routing import router_topk
    from nanoserve.kernels.rms_norm import rms_norm_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, _, k = QWEN3_30B_A3B.values()
    x, residual = (torch.randn(1, h, generator=gen, device="cuda") for _ in range(2))
    norm_w = torch.rand(h, generator=gen, device="cuda") + 0.5
    w = torch.randn(e, h, generator=gen, device="cuda") * h**-0.5
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    router_topk(x, residual, norm_w, 1e-6, w, None, k, True, counter)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, res_out = router_topk(x, residual, norm_w, 1e-6, w, None, k, True, counter)
    for _ in range(20):
        x.copy_(torch.randn(1, h, generator=gen, device="cuda") * 3)
        residual.copy_(torch.randn(1, h, generator=gen, device="cuda"))
        graph.replay()
        want_res = residual.clone()
        logits = rms_norm_ref(x, norm_w, 1e-6, want_res) @ w.T
        want_weights, want_ids = topk_softmax_ref(logits, k, True)
        assert counter.item() == 0
        torch.testing.assert_close(res_out, want_res)
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 3, 300])
def test_mxfp4_gpt_oss_20b(num_tokens):
    """gpt-oss-20b's experts in MXFP4 as it ships them (kernels/mxfp4_unpack.py's layout), rank 1 of 2 under expert
    parallelism: moe_gemv at one token, fused_moe beyond, against the reference on the dequantized bf16 weights."""
    from mxfp4_layout import random_mxfp4

    from nanoserve.kernels.fused_moe import fused_moe
    from nanoserve.kernels.moe_gemv import moe_gemv
    from nanoserve.kernels.moe_reference import fused_moe_ref

    gen = torch.Generator().manual_seed(num_tokens)
    e, h, i, k = GPT_OSS_20B.values()
    # Scales near 2^-7 put the weights about where trained layers' are (h^-0.5).
    (w13, s13, v13), (w2, s2, v2) = (random_mxfp4(e // 2, n, kk, gen, scales=(118, 122)) for n, kk in ((2 * i, h),
                                                                                                     (h, i)))
    w13, s13, w2, s2 = (t.cuda() for t in (w13, s13, w2, s2))
    v13, v2 = v13.cuda().bfloat16(), v2.cuda().bfloat16()
    cuda_gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    b13, b2 = (torch.randn(e // 2, n, generator=cuda_gen, device="cuda").bfloat16() for n in (2 * i, h))
    x = torch.randn(num_tokens, h, generator=cuda_gen, device="cuda").bfloat16()
    weights, ids = _routing(num_tokens, e, k, cuda_gen)
    kw = dict(expert_start=e // 2, w13_bias=b13, w2_bias=b2, activation="swigluoai")
    run = moe_gemv if num_tokens == 1 else fused_moe
    out = run(x, w13, w2, weights, ids.int(), w13_scale=s13, w2_scale=s2, **kw)
    torch.testing.assert_close(out, fused_moe_ref(x, v13, v2, weights, ids, **kw), **BF16_TOL)
