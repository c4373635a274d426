"""Softmax top-k routing in one launch: a token's router logits -> its top_k experts and their weights
(kernels/moe_reference.py's topk_softmax_ref is the same in PyTorch).

In PyTorch this is softmax, topk and (renormalized) a sum and a division: four launches a layer, each a few
microseconds at batch 1, where a whole layer's experts stream in about 40 us. One program per token holds the
row of E logits, takes the softmax in fp32, then the top_k by repeated argmax (lowest expert id first among
equal probabilities).

router_topk goes one launch further for the one-row decode step: the residual add and RMSNorm before the MoE block,
the router's GEMV and the top-k above. Each program computes a few experts' logits (as kernels/gemv.py's norm
prologue does, every program normalizing the row itself) and bumps a counter; the last to arrive takes the top-k
over all of them and resets the counter for the next launch (decode attention's in-launch merge does the same).
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids


@triton.jit
def _topk_softmax_row(logits, offs, weights_ptr, ids_ptr, t, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                      RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """Token t's weights and ids from its fp32 logits (-inf past the experts). They are gathered in registers and
    stored once: a program of several warps must not read back what one of its threads stored."""
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    offs_j = tl.arange(0, K_PAD)
    best_weights = tl.zeros([K_PAD], dtype=tl.float32)
    best_ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        expert = tl.min(tl.where(probs == best, offs, BLOCK_E), axis=0)
        best_weights = tl.where(offs_j == j, best, best_weights)
        best_ids = tl.where(offs_j == j, expert, best_ids)
        probs = tl.where(offs == expert, -1.0, probs)
    if RENORMALIZE:
        best_weights = best_weights / tl.sum(best_weights, axis=0)
    tl.store(weights_ptr + t * TOP_K + offs_j, best_weights, mask=offs_j < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_j, best_ids, mask=offs_j < TOP_K)


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * stride_t + offs, mask=offs < num_experts, other=-float("inf")).to(tl.float32)
    _topk_softmax_row(logits, offs, weights_ptr, ids_ptr, t, TOP_K, K_PAD, RENORMALIZE, BLOCK_E)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, top_k] fp32, expert ids [T, top_k] int32), as topk_softmax_ref."""
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        pdl = use_pdl(logits)
        _topk_softmax_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                            K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
                                            BLOCK_E=triton.next_power_of_2(num_experts), USE_PDL=pdl, num_warps=1,
                                            launch_pdl=pdl)
    return weights, ids


@triton.jit
def _normed_slice(x_ptr, res_ptr, norm_w_ptr, k0, offs_k, K, rstd, HAS_RESIDUAL: tl.constexpr):
    """Columns k0 + offs_k of RMSNorm(x + residual), rounded where kernels/rms_norm.py rounds (the sum, the
    normalized row and the output, to x's dtype), in fp32; and x + residual itself (the first walk, which computes
    rstd, passes 1.0 and takes only that)."""
    in_k = k0 + offs_k < K
    h = tl.load(x_ptr + k0 + offs_k, mask=in_k, other=0.0)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(res_ptr + k0 + offs_k, mask=in_k, other=0.0).to(tl.float32)).to(h.dtype)
    norm_w = tl.load(norm_w_ptr + k0 + offs_k, mask=in_k, other=0.0).to(tl.float32)
    return h, ((h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32) * norm_w).to(h.dtype).to(tl.float32)


@triton.jit
def _router_topk_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, b_ptr, logits_ptr, weights_ptr, ids_ptr,
                        counter_ptr, num_experts, K, eps, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, num_experts - 1)  # rows past E read the last again; the store drops them
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    # The first weight tile streams while the kernels before this one finish: no kernel writes weights.
    w = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    wait_for_prior_grids(USE_PDL)
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        h, _ = _normed_slice(x_ptr, res_ptr, norm_w_ptr, k0, offs_k, K, 1.0, HAS_RESIDUAL)
        if HAS_RESIDUAL and pid == 0:  # the next residual, into a buffer of its own: the others still read this one
            tl.store(res_out_ptr + k0 + offs_k, h, mask=k0 + offs_k < K)
        sum_sq += h.to(tl.float32) * h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        _, x = _normed_slice(x_ptr, res_ptr, norm_w_ptr, k0, offs_k, K, rstd, HAS_RESIDUAL)
        w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=(k0 + BLOCK_K + offs_k < K)[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(b_ptr + rows).to(tl.float32)
    # Rounded to the activations' dtype, as the router's Linear returns them to route().
    logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + offs_n, logits, mask=offs_n < num_experts)
    # The semaphore of decode_split.py's fused merge (its comment has the ordering argument): every thread's logit
    # stores, then one acq_rel bump at gpu scope; the program that sees the last count reads them all through L2.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.debug_barrier()
        tl.store(counter_ptr, 0)  # every other program is done with it; the kernel's end publishes the reset
        offs_e = tl.arange(0, BLOCK_E)
        all_logits = tl.load(logits_ptr + offs_e, mask=offs_e < num_experts, other=-float("inf"),
                             cache_modifier=".cg")
        _topk_softmax_row(all_logits, offs_e, weights_ptr, ids_ptr, 0, TOP_K, K_PAD, RENORMALIZE, BLOCK_E)


ROUTER_BLOCK_N = 2  # rows a program: E / 2 programs (64 for 128 experts), as gemv.py's one-row rule gives for E


def router_topk(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token: topk_softmax(RMSNorm(x + residual) @ weight.T + bias) in one launch, as the residual add and norm,
    the router's Linear (its logits rounded to x's dtype) and topk_softmax do it in three. Returns (weights [1, top_k]
    fp32, ids [1, top_k] int32, x + residual: the next residual, in a new tensor; x itself without a residual).
    counter: an int32 zero of the caller's own that the launch leaves zero again (a block's, reused every step)."""
    if x.dim() != 2 or x.shape[0] != 1 or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, H], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    num_experts = weight.shape[0]
    if weight.shape != (num_experts, hidden) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [E, {hidden}], got shape {tuple(weight.shape)}")
    if counter.dtype != torch.int32 or counter.numel() < 1:
        raise ValueError(f"counter must be an int32 tensor, got {counter.dtype} {tuple(counter.shape)}")
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
        raise ValueError(f"residual must be contiguous {tuple(x.shape)}, got {tuple(residual.shape)}")
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(num_experts, dtype=torch.float32, device=x.device)
    residual_out = torch.empty_like(x) if residual is not None else x
    pdl = use_pdl(x)
    _router_topk_kernel[(triton.cdiv(num_experts, ROUTER_BLOCK_N),)](
        x, residual if residual is not None else x, norm_weight, residual_out, weight,
        bias if bias is not None else weight, logits, weights, ids, counter, num_experts, hidden, eps,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        USE_PDL=pdl, BLOCK_N=ROUTER_BLOCK_N, BLOCK_K=min(1024, triton.next_power_of_2(hidden)),
        BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4, launch_pdl=pdl)
    return weights, ids, residual_out
