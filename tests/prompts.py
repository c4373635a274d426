"""Prompts tests share: a mixed batch where every other prompt starts with one system prompt (prefix hits, the GPU
tests), and three of mixed lengths for the speculative-decoding tests."""

import torch


def mixed_prompts(vocab: int, system_len: int, max_len: int, num: int = 64) -> list[list[int]]:
    """`num` prompts of random ids in [2, vocab), lengths uniform in [1, max_len), the odd ones after a shared
    `system_len`-token system prompt; the same for every call (seeded)."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, vocab, (system_len,), generator=g).tolist()
    lens = torch.randint(1, max_len, (num,), generator=g).tolist()
    return [(system if i % 2 else []) + torch.randint(2, vocab, (n,), generator=g).tolist()
            for i, n in enumerate(lens)]


def three_prompts() -> list[list[int]]:
    """Mixed lengths, the first two sharing a 40-token prefix (prefix hits); ids in [2, 384)."""
    g = torch.Generator().manual_seed(6)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [
        system + torch.randint(2, 384, (5,), generator=g).tolist(),
        system + torch.randint(2, 384, (19,), generator=g).tolist(),
        torch.randint(2, 384, (27,), generator=g).tolist(),
    ]
