"""act(gate) * up over the fused gate_up projection: SiLU (Llama, Qwen) or tanh-approximated GELU (Gemma)."""

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    activation = "silu"  # the fused kernels' name for it (kernels/activation.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from nanoserve.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh)."""

    activation = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from nanoserve.kernels.activation import act_and_mul

            return act_and_mul(x, "gelu_tanh")
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
