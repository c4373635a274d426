"""RMSNorm, optionally adding the residual first (one fused kernel on the GPU instead of eight)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """offset: the row is scaled by offset + weight. Gemma's norms store weight - 1 (offset 1.0) and, as transformers'
    Gemma RMSNorm, multiply in fp32 before the one rounding; Llama's (offset 0) rounds the normalized row first."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if x.is_cuda:
            from nanoserve.kernels.rms_norm import rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps, weight_offset=self.offset)
            # residual updated in place
            return rms_norm(x, self.weight, self.eps, residual, weight_offset=self.offset), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
