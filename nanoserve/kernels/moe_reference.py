"""The mixture-of-experts computation in plain PyTorch: the CPU path of layers/moe.py and the reference that
kernels/fused_moe.py is tested against. No triton import, so the CPU engine runs it without triton installed.

Weights are stacked per expert: w13 [E, 2I, H] holds each expert's gate rows then its up rows, w2 [E, H, I] its
down projection. With expert parallelism a rank holds experts [expert_start, expert_start + E) of the model's;
(token, expert) pairs routed to other ranks' experts contribute nothing here (their rank adds them in the
all-reduce that follows).
"""

import torch
import torch.nn.functional as F

# gpt-oss's clamped SwiGLU (transformers' GptOssExperts): gate clamped above, up both ways, up shifted by one.
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def topk_softmax_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Qwen, Mixtral): each token's top_k experts by probability and their weights (fp32),
    rescaled to sum to one if `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[N, 2I] (gate | up) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swigluoai":
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA)
    raise ValueError(f"activation: {activation!r} is not supported")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for each token t: x [T, H] -> [T, H].

    Each expert runs once on the tokens that chose it (a host loop over the experts present: fine on the CPU).
    """
    num_experts = w13.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = topk_ids.long() - expert_start
    for e in torch.unique(local).tolist():
        if not 0 <= e < num_experts:
            continue
        tokens, slot = (local == e).nonzero(as_tuple=True)
        h = x[tokens] @ w13[e].t()
        if w13_bias is not None:
            h = h + w13_bias[e]
        y = moe_activation(h, activation) @ w2[e].t()
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slot, None].float())
    return out.to(x.dtype)
