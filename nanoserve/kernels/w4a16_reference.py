"""The W4 layout's definition in PyTorch (no Triton, so the CPU path imports it without the kernels): the weight
dequantized, and w4a16_linear's reference. The layout: nanoserve/kernels/w4a16_gemm.py's docstring."""

import torch

PACK = 8


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int) -> torch.Tensor:
    """The W4 weight as fp32 [K, N] (exact: (q - z) * s needs at most 5 + 11 bits of fp32's 24)."""
    k8, n = qweight.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(k8 * PACK, n).float()
    rows = torch.arange(k8 * PACK, device=qweight.device)
    groups = rows // group_size if group_size != -1 else torch.zeros_like(rows)
    z = zeros.float()[groups] if zeros is not None else 8.0
    return (q - z) * scales.float()[groups]


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """w4a16_linear in PyTorch, fp32: x (its columns in perm's order) times the dequantized weight."""
    xs = x.float() if perm is None else x.float()[:, perm.long()]
    y = xs @ dequantize_w4(qweight, scales, zeros, group_size)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
