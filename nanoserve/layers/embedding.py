"""Token embedding and the LM head (which may share the embedding's weight)."""

import torch
import torch.nn.functional as F
from torch import nn


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the weight's dtype. The fused sampler reads bf16 logits as they are and the others convert
        once: an fp32 copy here cost ~120 us per batch-256 step on an H100 (a [256, 152k] write and a re-read)."""
        return F.linear(hidden, self.weight)
