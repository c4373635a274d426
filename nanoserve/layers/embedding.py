"""Token embedding and the LM head (which may share the embedding's weight)."""

import torch
import torch.nn.functional as F
from torch import nn


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
