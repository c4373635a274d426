"""RMSNorm, optionally adding the residual first (one fused kernel on the GPU instead of eight)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if x.is_cuda:
            from nanoserve.kernels.rms_norm import rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return rms_norm(x, self.weight, self.eps, residual), residual  # residual updated in place
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
