"""4-bit expert weights for the MoE kernels (fused_moe.py, moe_gemv.py), weight-only: their layout, its checks and
its dequantization (the kernels' reference). GPTQ, AWQ and compressed-tensors pack-quantized experts are all
converted to it while loading (quantization/moe_experts.py's keep_w4).

The layout ("W4 experts"): a weight [E, N, K] of unsigned 4-bit values q with a scale s and a zero point z per row
and group of group_size columns, W[e, n, k] = (q - z) * s, is
- `w` int32 [E, N, K / 8]: the values of columns 8j..8j+7 of a row at bits 0, 4, .., 28 of its entry j (the
  dense W4 layout's packing, quantization/w4_packing.py, along K instead of along the rows: each row contiguous
  along K, as the 16-bit and FP8 weights' rows are, which is what the MoE kernels walk);
- `scale` fp32 [E, N, ceil(K / group_size)]: kernels/fp8_experts.py's block scales with blocks of (1, group_size),
  or per row, [E, N], for group_size -1 (one group a row). fp32 holds any checkpoint's fp16 / bf16 scales exactly:
  4 bytes a group, 1/32 byte a weight at groups of 128;
- `zeros` uint8 of scale's shape, the zero points 0..16 (an asymmetric checkpoint's), or none: 8 (symmetric).
w13 stacks each expert's gate rows then its up rows (N = 2I), their scales and zeros likewise. Act-order checkpoints
(g_idx: a column's group is not k // group_size) are not in it: they are dequantized while loading.

Weight-only: the kernels unpack each int32 in registers into (q - z), small integers that the activations' dtype
holds exactly, multiply them by the activations as they are, accumulating in fp32, and scale the products per group
once a tile of columns (a tile lies within one group: widest_tile with the block (1, group_size)), or per row once
after the reduction.
"""

import torch

from nanoserve.kernels.w4a16_reference import PACK


def weight_block(group_size: int) -> tuple[int, int] | None:
    """The kernels' weight_block for W4 experts of group_size (-1: None, scales per row): a block of one row."""
    return None if group_size == -1 else (1, group_size)


def w4_shapes(num_experts: int, n: int, k: int, group_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of `w` and of `scale` (and `zeros`) of a W4 weight [num_experts, n, k]."""
    scales = (num_experts, n) if group_size == -1 else (num_experts, n, -(-k // group_size))
    return (num_experts, n, k // PACK), scales


def check_w4_experts(hidden: int, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                     w2_scale: torch.Tensor, w13_zeros: torch.Tensor | None, w2_zeros: torch.Tensor | None,
                     block: tuple[int, int] | None) -> None:
    """W4 w13 [E, 2I, H / 8] and w2 [E, H, I / 8] (int32) with their fp32 scales and uint8 zeros (both or neither)
    in the layout above, each wrong one named in a ValueError; block: weight_block's (1, group_size), or None."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be W4 [E, 2I, {hidden // PACK}], got {tuple(w13.shape)}")
    if block is not None and (len(block) != 2 or block[0] != 1 or block[1] % 16):
        raise ValueError(f"weight_block {block}: W4 experts' groups must be (1, group_size) with group_size a "
                         "multiple of 16")
    if (w13_zeros is None) != (w2_zeros is None):
        raise ValueError("w13_zeros and w2_zeros: asymmetric W4 weights need both (or neither)")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if hidden % PACK or w2.dim() != 3:
        raise ValueError(f"W4 experts: the hidden size {hidden} must be a multiple of {PACK}, and w2 [E, H, I / 8]")
    inter_k = w2.shape[2] * PACK
    group = -1 if block is None else block[1]
    for name, t, s, z, (n, k) in (("w13", w13, w13_scale, w13_zeros, (2 * inter, hidden)),
                                  ("w2", w2, w2_scale, w2_zeros, (hidden, inter_k))):
        w_shape, s_shape = w4_shapes(num_experts, n, k, group)
        if t.dtype != torch.int32 or tuple(t.shape) != w_shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32 {w_shape}, got {t.dtype} {tuple(t.shape)}")
        if s.dtype != torch.float32 or tuple(s.shape) != s_shape or not s.is_contiguous():
            raise ValueError(f"{name}_scale must be contiguous fp32 {s_shape}, got {s.dtype} {tuple(s.shape)}")
        if z is not None and (z.dtype != torch.uint8 or tuple(z.shape) != s_shape or not z.is_contiguous()):
            raise ValueError(f"{name}_zeros must be contiguous uint8 {s_shape}, got {z.dtype} {tuple(z.shape)}")
    if inter_k != inter:
        raise ValueError(f"w2 must be W4 [{num_experts}, {hidden}, {inter // PACK}], got {tuple(w2.shape)}")


def dequantize_w4_experts(w: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                          dtype: torch.dtype) -> torch.Tensor:
    """The weight [E, N, K] that W4 w, its scales and zeros stand for, in dtype (computed in fp32, exact there: q - z
    needs 5 bits and s 11 or 8 of fp32's 24; rounded once)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    q = ((w[..., None] >> shifts) & 0xF).flatten(2).float()
    k = q.shape[2]
    groups = torch.zeros(k, dtype=torch.long, device=w.device) if group_size == -1 else \
        torch.arange(k, device=w.device) // group_size
    per_group = scale[..., None] if group_size == -1 else scale
    z = 8.0 if zeros is None else (zeros[..., None] if group_size == -1 else zeros).float()[..., groups]
    return ((q - z) * per_group.float()[..., groups]).to(dtype)
