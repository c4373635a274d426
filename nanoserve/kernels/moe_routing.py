"""Softmax top-k routing in one launch: a token's router logits -> its top_k experts and their weights
(kernels/moe_reference.py's topk_softmax_ref is the same in PyTorch).

In PyTorch this is softmax, topk and (renormalized) a sum and a division: four launches a layer, each a few
microseconds at batch 1, where a whole layer's experts stream in about 40 us. One program per token holds the
row of E logits, takes the softmax in fp32, then the top_k by repeated argmax (lowest expert id first among
equal probabilities).
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
                         RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_t + offs, mask=offs < num_experts, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        expert = tl.min(tl.where(probs == best, offs, BLOCK_E), axis=0)
        tl.store(weights_ptr + t * TOP_K + j, best)
        tl.store(ids_ptr + t * TOP_K + j, expert)
        total += best
        probs = tl.where(offs == expert, -1.0, probs)
    if RENORMALIZE:
        for j in tl.static_range(TOP_K):
            w = tl.load(weights_ptr + t * TOP_K + j)
            tl.store(weights_ptr + t * TOP_K + j, w / total)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int32), as topk_softmax_ref."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        pdl = use_pdl(logits)
        _topk_softmax_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
                                            USE_PDL=pdl, num_warps=1, launch_pdl=pdl)
    return weights, ids
