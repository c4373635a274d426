"""Attention logit soft-capping (Gemma 2's attn_logit_softcapping) on a tile of scores, for every attention kernel.

A score s (scaled by the softmax scale) becomes cap * tanh(s / cap) before the mask and the softmax, as transformers
applies it. The kernels hold scores in log2 units (scaled by log2(e) for exp2), so they pass cap * log2(e): then
(cap log2e) tanh(s log2e / (cap log2e)) = log2e * cap * tanh(s / cap), the capped score in their units. Each kernel
takes it behind a SOFTCAP constexpr, so a model without it compiles the kernel it had.
"""

import triton
import triton.language as tl


@triton.jit
def softcap_scores(qk, cap):
    """cap * tanh(qk / cap), with tanh(z) = 2 sigmoid(2z) - 1 (one formula that the interpreter and compiled Triton
    share; fp32 in, fp32 out)."""
    return cap * (2.0 * tl.sigmoid(2.0 * qk / cap) - 1.0)
