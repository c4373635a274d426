"""Random tensors in the engine's W4 layout (nanoserve/quantization/w4_packing.py), for the W4 kernel tests."""

import torch


def random_w4(n: int, k: int, group: int, zeros: bool, perm: bool, gen: torch.Generator):
    """qweight int32 [K / 8, N] of random bits, fp16 scales [G, N], uint8 zero points 0..16 [G, N] or None, an
    act-order permutation of K or None; group -1: one group."""
    groups = 1 if group == -1 else k // group
    qweight = torch.randint(-1 << 31, 1 << 31, (k // 8, n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    z = torch.randint(0, 17, (groups, n), generator=gen).to(torch.uint8) if zeros else None
    p = torch.randperm(k, generator=gen).to(torch.int32) if perm else None
    return qweight, scales, z, p
