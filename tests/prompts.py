"""Prompts the GPU tests share: a mixed batch where every other prompt starts with one system prompt (prefix hits)."""

import torch


def mixed_prompts(vocab: int, system_len: int, max_len: int, num: int = 64) -> list[list[int]]:
    """`num` prompts of random ids in [2, vocab), lengths uniform in [1, max_len), the odd ones after a shared
    `system_len`-token system prompt; the same for every call (seeded)."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, vocab, (system_len,), generator=g).tolist()
    lens = torch.randint(1, max_len, (num,), generator=g).tolist()
    return [(system if i % 2 else []) + torch.randint(2, vocab, (n,), generator=g).tolist()
            for i, n in enumerate(lens)]
