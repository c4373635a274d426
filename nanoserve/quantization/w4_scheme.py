"""W4Scheme: 4-bit integer weights with 16-bit activations (W4A16), as GPTQ, AWQ and compressed-tensors'
`pack-quantized` format store them.

Every format means the same arithmetic: a weight W [N, K] (N output rows, K input columns) is stored as unsigned 4-bit
integers q in 0..15, and each group of `group_size` consecutive input columns of a row has a scale s and a zero point
z: W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]. Symmetric formats fix z at 8 (GPTQ sym, compressed-tensors
symmetric, whose signed values in -8..7 are q - 8); asymmetric ones store it. With act-order (GPTQ desc_act,
compressed-tensors actorder "group") a column's group is g_idx[k] rather than k // group_size: the quantizer took the
columns in another order. The activations are not quantized. The formats differ only in how they pack q, z and s
(quantization/w4_formats.py).
"""

from dataclasses import dataclass, field

import torch

from nanoserve.quantization.scheme import ignored

W4_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class W4Scheme:
    """method: the quant_method it came from; group_size: input columns a scale covers (-1: all of a row's, one
    scale per output row); symmetric: zero point 8, no zero tensor read; act_order: the checkpoint has g_idx
    (groups in another column order); zero_offset: added to a stored zero (GPTQ's original format stores z - 1);
    ignore: layers left unquantized, as FP8Scheme.ignore."""

    method: str
    group_size: int
    symmetric: bool
    act_order: bool = False
    zero_offset: int = 0
    ignore: tuple[str, ...] = field(default=())

    serialized = True  # a 4-bit checkpoint always holds its packed weights (no quantizing at load)
    block = None  # no FP8 blocks

    def __post_init__(self) -> None:
        assert self.method in W4_METHODS and (self.group_size == -1 or self.group_size > 0)

    def describe(self) -> str:
        """For the start-up line and /v1/models, e.g. "w4a16 (awq): int4 weights, asymmetric, groups of 128,
        activations unquantized"."""
        groups = "one group per row" if self.group_size == -1 else f"groups of {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        order = ", act-order" if self.act_order else ""
        return f"w4a16 ({self.method}): int4 weights, {kind}, {groups}{order}, activations unquantized"

    def ignores(self, name: str) -> bool:
        """Whether the checkpoint module `name` stays unquantized."""
        return ignored(self.ignore, name)

    def groups(self, columns: int) -> int:
        """Groups along `columns` input columns (a rank's share, or the whole row)."""
        return 1 if self.group_size == -1 else -(-columns // self.group_size)

    @property
    def group_field(self) -> str:
        """The config.json field that set group_size."""
        if self.method == "compressed-tensors":
            return "quantization_config.config_groups.*.weights.group_size"
        return "quantization_config.group_size"


def runs_w4(device: torch.device) -> bool:
    """Whether 4-bit experts on `device` stay packed for the MoE kernels (else they are dequantized while loading): on
    CUDA, as mxfp4.runs_packed decides (the W4 variants need nothing past what the kernels already run on)."""
    return device.type == "cuda"


def w4_experts_fit(scheme: W4Scheme, start: int, size: int, total: int) -> bool:
    """Whether the MoE kernels take a rank's share [start, start + size) of the experts' intermediate size `total`
    packed (kernels/w4_experts.py): not act-order (its groups are not runs of columns), groups of whole tiles of 16
    columns or one a row, and down's columns of this share whole int32s of eight and (unless one group a row) whole
    groups, the last one possibly cut at `total`. Else that rank's 4-bit experts are dequantized while loading
    (quantization/model.py)."""
    group = scheme.group_size
    if scheme.act_order or (group != -1 and group % 16) or start % 8 or size % 8:
        return False
    return group == -1 or (start % group == 0 and (size % group == 0 or start + size == total))
