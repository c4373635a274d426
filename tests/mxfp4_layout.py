"""Random MXFP4 expert weights in the kernels' layout (nanoserve/kernels/mxfp4_unpack.py), for the MXFP4 tests."""

import torch

from nanoserve.quantization.mxfp4 import dequantize_mxfp4


def random_mxfp4(num_experts: int, n: int, k: int, gen: torch.Generator, scales: tuple[int, int] = (120, 130)):
    """(w [E, N, K / 2] uint8 of random bits, scale [E, N, K / 32] uint8 in scales' range, inclusive, and the
    values they hold, fp32 [E, N, K])."""
    w = torch.randint(0, 256, (num_experts, n, k // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(scales[0], scales[1] + 1, (num_experts, n, k // 32), dtype=torch.uint8, generator=gen)
    values = dequantize_mxfp4(w.view(num_experts, n, k // 32, 16), scale, torch.float32)
    return w, scale, values
