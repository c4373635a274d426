"""The one-launch softmax top-k router against PyTorch's softmax + topk (+ renormalization)."""

import pytest
import torch
from conftest import DEVICE

from nanoserve.kernels.moe_reference import topk_softmax_ref
from nanoserve.kernels.moe_routing import topk_softmax


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (5, 128, 8), (33, 60, 4), (3, 4, 1)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_topk_softmax_matches_torch(num_tokens, num_experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    logits = (3 * torch.randn(num_tokens, num_experts, generator=g)).to(dtype).to(DEVICE)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    want_weights, want_ids = topk_softmax_ref(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights.cpu(), want_weights.cpu(), rtol=1e-5, atol=1e-6)
    # 16-bit logits can tie, and torch.topk orders ties its own way: the experts chosen must carry the top
    # probabilities, each once; without ties (fp32) they are torch's exactly.
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    torch.testing.assert_close(probs.gather(1, ids.long().cpu()), topk_softmax_ref(logits, top_k, False)[0].cpu())
    assert all(len(set(row)) == top_k for row in ids.tolist())
    if dtype == torch.float32:
        assert torch.equal(ids.long().cpu(), want_ids.cpu())
    if renormalize:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(num_tokens))


def test_ties_take_the_lowest_expert():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    _, ids = topk_softmax(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 3]]


def test_no_tokens():
    weights, ids = topk_softmax(torch.empty(0, 8, device=DEVICE), 2, renormalize=True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("num_experts, top_k, hidden, dtype, residual, bias, renormalize",
                         [(64, 8, 96, torch.float32, True, False, True),
                          (16, 4, 1100, torch.float32, False, True, True),  # two weight tiles a program
                          (60, 4, 80, torch.float16, True, True, False)])
def test_router_topk(num_experts, top_k, hidden, dtype, residual, bias, renormalize):
    """router_topk (norm, router GEMV and top-k in one launch) as the three steps it replaces, twice on one counter:
    the launch leaves it zero for the next."""
    from nanoserve.kernels.moe_routing import router_topk
    from nanoserve.kernels.rms_norm import rms_norm_ref

    g = torch.Generator().manual_seed(num_experts)
    x = (2 * torch.randn(1, hidden, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(1, hidden, generator=g).to(dtype).to(DEVICE) if residual else None
    norm_w = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)
    w = (torch.randn(num_experts, hidden, generator=g) * hidden**-0.5).to(dtype).to(DEVICE)
    b = torch.randn(num_experts, generator=g).to(dtype).to(DEVICE) if bias else None
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        weights, ids, res_out = router_topk(x, res, norm_w, 1e-6, w, b, top_k, renormalize, counter)
        assert counter.item() == 0
        want_res = res.clone() if residual else None
        normed = rms_norm_ref(x, norm_w, 1e-6, want_res).to(dtype)
        logits = torch.nn.functional.linear(normed.float(), w.float(), b.float() if bias else None).to(dtype)
        want_weights, want_ids = topk_softmax_ref(logits, top_k, renormalize)
        torch.testing.assert_close(res_out, want_res if residual else x, atol=0, rtol=0)
        torch.testing.assert_close(weights.cpu(), want_weights.cpu(), rtol=1e-5, atol=1e-6)
        # 16-bit logits can tie (see above): there the experts chosen must carry the top probabilities.
        probs = torch.softmax(logits.float(), dim=-1)
        torch.testing.assert_close(probs.gather(1, ids.long()), topk_softmax_ref(logits, top_k, False)[0])
        if dtype == torch.float32:
            assert torch.equal(ids.long().cpu(), want_ids.cpu())
