"""Eight 4-bit values in an int32: the packing all three 4-bit formats use, and the one layout the engine runs.

A packed int32 holds values v0..v7 at bits 4j..4j+3 (v0 lowest). Along an axis, packed entry i holds the values at
positions 8i..8i+7, in order, except AWQ's, which holds positions 8i + AWQ_ORDER[j] at bits 4j (the order its GEMM
kernel unpacks in).

The engine's layout ("the W4 layout"; kernels/w4a16_gemm.py runs it) is GPTQ's, for every format:
- qweight int32 [K / 8, N]: unsigned q of the weight's input column k, output row n, at entry [k // 8, n], bits
  4 (k % 8);
- scales [groups, N], in the checkpoint's dtype (or a narrower one that holds them exactly);
- zeros uint8 [groups, N], the zero points 0..16 (GPTQ's original format can mean 16), or none: 8;
- perm int32 [K] or none (act-order): row k of qweight is the checkpoint's input column perm[k], so the layer
  multiplies x[:, perm]; rows are sorted by group, so row k's group is k // group_size as without act-order. A rank's
  share of a row-parallel layer's columns (tensor parallelism) fills its groups partly: there perm is longer than
  K, its rows padded to whole groups with weights of q = z whose perm is K, a column of zeros appended to x
  (quantization/w4_linear.py's _sort_by_group).
"""

import torch

PACK = 8  # 4-bit values in an int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the position (within its 8) of the value at bits 4j of an AWQ int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 packed along `dim` -> uint8 values 0..15, 8 times as long along `dim`."""
    moved = packed.movedim(dim, -1)
    values = (moved[..., None] >> _SHIFTS.to(packed.device)) & 0xF
    return values.flatten(-2).to(torch.uint8).movedim(-1, dim)


def pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Values 0..15 (any integer dtype) -> int32 packed along `dim` (its length a multiple of 8), contiguous."""
    moved = values.movedim(dim, -1).to(torch.int64)
    groups = moved.unflatten(-1, (-1, PACK)) << _SHIFTS.to(values.device, torch.int64)
    # Summed as int64 then wrapped: the top value's bit 31 makes a negative int32.
    word = groups.sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).movedim(-1, dim).contiguous()


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [rows, cols / 8] -> uint8 [rows, cols] in column order."""
    interleaved = unpack(packed, 1).unflatten(1, (-1, PACK))
    ordered = torch.empty_like(interleaved)
    ordered[..., list(AWQ_ORDER)] = interleaved
    return ordered.flatten(1)
