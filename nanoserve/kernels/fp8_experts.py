"""FP8 expert weights for the MoE kernels (fused_moe.py, moe_gemv.py), weight-only: their layout, its checks and the
arguments the kernels take for it, and its dequantization (the kernels' reference).

The layout (quantization/moe_experts.py keeps an FP8 Qwen3-MoE, Qwen2-MoE or Mixtral checkpoint's routed experts in
it on CUDA): a weight [E, N, K] is
- `w` [E, N, K] float8_e4m3fn, each row contiguous along K as the 16-bit weights' rows are;
- `scale` fp32, the weight being w * scale, either
  - per row, [E, N] (a checkpoint's per-tensor and per-channel scales, one per output row once expanded), or
  - per block of block = (rows, columns), [E, ceil(N / rows), ceil(K / columns)] (quant_method fp8's
    weight_scale_inv: Qwen3-FP8 and DeepSeek-V3 use 128 x 128).
w13 stacks each expert's gate rows then its up rows (N = 2I); with block scales its scale stacks gate's
ceil(I / rows) rows of blocks, then up's, so that gate's last block may be partial.

Weight-only: the kernels convert each fp8 tile to the activations' dtype in registers (exact: every e4m3 value is a
bf16, an fp16 and an fp32) and multiply it by the activations as they are, accumulating in fp32; a scale multiplies
those fp32 products, per row once after the reduction, per block once per tile of columns (a tile lies within one
block of columns: widest_tile). The activations are not quantized, whatever the checkpoint's activation scheme: a
W8A8 checkpoint (static, dynamic per token or per token group) runs as W8A16 here, as quantization/fp8_linear.py's
skinny path runs it, which is closer to the unquantized model than the format's definition, and not bit-equal to it.
"""

import torch

FP8 = torch.float8_e4m3fn


def scale_shape(num_experts: int, n: int, k: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of the scales of an FP8 weight [num_experts, n, k] (per row if block is None)."""
    if block is None:
        return num_experts, n
    return num_experts, -(-n // block[0]), -(-k // block[1])


def stacked_scale_shape(num_experts: int, inter: int, hidden: int,
                        block: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of w13's scales: gate's rows (or rows of blocks) of each expert, then up's."""
    e, rows, *cols = scale_shape(num_experts, inter, hidden, block)
    return e, 2 * rows, *cols


def widest_tile(block: tuple[int, int] | None, widest: int) -> int:
    """The widest tile of columns, up to `widest` (a power of two), that lies within one block of scales wherever
    the tiles start on multiples of it: the largest power of two that divides the block's columns."""
    if block is None:
        return widest
    return min(widest, block[1] & -block[1])


def scale_operand(w: torch.Tensor, scale: torch.Tensor | None,
                  block: tuple[int, int] | None) -> tuple[torch.Tensor, int, int, int, int, int]:
    """What the MoE kernels take for the scales of w: the tensor (w itself where there is none: never read), its
    strides along experts, rows and columns of blocks, SCALE_N (the rows a scale covers) and SCALE_K (the columns;
    0: a whole row). MXFP4's scales (kernels/mxfp4_unpack.py) go as per-row ones, the kernels indexing them their
    own way."""
    if scale is None:
        return w, 0, 0, 0, 1, 0
    if block is None:
        return scale, scale.stride(0), scale.stride(1), 0, 1, 0
    return scale, scale.stride(0), scale.stride(1), scale.stride(2), block[0], block[1]


def check_fp8_experts(hidden: int, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                      w2_scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    """FP8 w13 [E, 2I, H] and w2 [E, H, I] with their fp32 scales in the layout above, each wrong one named in a
    ValueError; block scales' columns a multiple of 16 (the narrowest tile of the tensor cores)."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be FP8 [E, 2I, {hidden}], got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if block is not None and (len(block) != 2 or block[0] < 1 or block[1] % 16):
        raise ValueError(f"weight_block {block}: FP8 experts' scale blocks must be (rows, columns) with columns a "
                         "multiple of 16")
    for name, t, shape in (("w13", w13, (num_experts, 2 * inter, hidden)), ("w2", w2, (num_experts, hidden, inter))):
        if t.dtype != FP8 or tuple(t.shape) != shape or t.stride(2) != 1:
            raise ValueError(f"{name} must be float8_e4m3fn {shape} with a contiguous last dim, got {t.dtype} "
                             f"{tuple(t.shape)}")
    for name, t, shape in (("w13_scale", w13_scale, stacked_scale_shape(num_experts, inter, hidden, block)),
                           ("w2_scale", w2_scale, scale_shape(num_experts, hidden, inter, block))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"{name} must be fp32 {shape} ({'per row' if block is None else f'per {block} block'}) "
                             f"with a contiguous last dim, got {t.dtype} {tuple(t.shape)}")


def _element_scales(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return scale[..., None]
    return scale.repeat_interleave(block[0], dim=1)[:, :n].repeat_interleave(block[1], dim=2)[:, :, :k]


def dequantize_fp8_experts(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype,
                           stacked: bool = False) -> torch.Tensor:
    """The weight [E, N, K] that FP8 w and its scales stand for, in dtype (computed in fp32, rounded once). stacked:
    w is w13, gate's rows then up's, each with its own rows of blocks."""
    e, n, k = w.shape
    if stacked and block is not None:
        gate_blocks = scale.shape[1] // 2
        scales = torch.cat([_element_scales(scale[:, :gate_blocks], n // 2, k, block),
                            _element_scales(scale[:, gate_blocks:], n // 2, k, block)], dim=1)
    else:
        scales = _element_scales(scale, n, k, block)
    return (w.float() * scales.float()).to(dtype)
