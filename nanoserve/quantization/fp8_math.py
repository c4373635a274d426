"""The FP8 schemes' arithmetic in plain PyTorch: quantizing weights and activations, dequantizing weights, and the
linear layer they make. This is the CPU path (fp32 throughout, the reference the CUDA kernels are tested against)
and what tests use to write checkpoints.

A quantized value is x / scale rounded to float8_e4m3fn after clamping to its largest finite value, 448 (torch's cast
does not saturate); a dynamic scale is max|x| / 448 over the values it covers, at least MIN_AMAX / 448 so that an
all-zero row divides by no zero.
"""

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-10


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (broadcast) as float8_e4m3fn."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dynamic_scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=MIN_AMAX) / FP8_MAX


def _pad_columns(x: torch.Tensor, multiple: int) -> torch.Tensor:
    return F.pad(x, (0, -x.shape[-1] % multiple))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K], scale [M, 1]), one dynamic scale per row."""
    scale = dynamic_scale(x.abs().amax(dim=-1, keepdim=True))
    return quantize(x, scale), scale


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K], scale [M, ceil(K / group)]), one dynamic scale per row and group of columns."""
    m, k = x.shape
    groups = _pad_columns(x, group).view(m, -1, group)
    scale = dynamic_scale(groups.abs().amax(dim=-1))
    return quantize(groups, scale[..., None]).view(m, -1)[:, :k], scale


def fake_quantize_activation(x: torch.Tensor, activations: str | None, input_scale: torch.Tensor | None = None,
                             group: int = 0) -> torch.Tensor:
    """x [M, K] quantized as the scheme's activations are and back, in fp32 (scheme.py names the strategies)."""
    if activations is None:
        return x.float()
    if activations == "tensor":
        return quantize(x, input_scale).float() * input_scale
    if activations == "token":
        q, scale = quantize_per_token(x)
        return q.float() * scale
    q, scale = quantize_per_token_group(x, group)
    return q.float() * expand_group_scale(scale, x.shape[1], group)


def expand_group_scale(scale: torch.Tensor, columns: int, group: int) -> torch.Tensor:
    """[..., ceil(columns / group)] -> [..., columns]: each column's scale."""
    return scale.repeat_interleave(group, dim=-1)[..., :columns]


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """A block scale [ceil(N / rows), ceil(K / cols)] as the scale of each element of an [N, K] weight."""
    rows = scale.repeat_interleave(block[0], dim=0)[:shape[0]]
    return expand_group_scale(rows, shape[1], block[1])


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """fp32 [N, K] of a weight stored as q (fp8) and its scale: one number, [N] or [N, 1] per channel, or
    per block."""
    if block is not None:
        return q.float() * expand_block_scale(scale.float(), tuple(q.shape), block)
    scale = scale.float()
    return q.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def quantize_weight(w: torch.Tensor, strategy: str,
                    block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q, scale): scale [1] ("tensor"), [N, 1] ("channel") or [ceil(N / rows), ceil(K / cols)]
    ("block"), each max|w| / 448 over what it covers."""
    if strategy == "tensor":
        scale = dynamic_scale(w.abs().amax()).reshape(1)
        return quantize(w, scale), scale
    if strategy == "channel":
        scale = dynamic_scale(w.abs().amax(dim=1, keepdim=True))
        return quantize(w, scale), scale
    n, k = w.shape
    rows, cols = block
    padded = F.pad(w.float(), (0, -k % cols, 0, -n % rows))
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    scale = dynamic_scale(blocks.abs().amax(dim=(1, 3)))
    return quantize(w, expand_block_scale(scale, (n, k), block)), scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, activations: str | None, input_scale: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None) -> torch.Tensor:
    """y = fake_quantize(x) dequantize(W)^T + b in fp32, returned in x's dtype; x [..., K]."""
    x2 = x.reshape(-1, x.shape[-1])
    xq = fake_quantize_activation(x2, activations, input_scale, block[1] if block else 0)
    y = F.linear(xq, dequantize_weight(weight, weight_scale, block), None if bias is None else bias.float())
    return y.to(x.dtype).view(*x.shape[:-1], -1)
