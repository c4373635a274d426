"""4-bit weights unpacked in registers, for the MoE kernels (fused_moe.py, moe_gemv.py): kernels/w4_experts.py's
layout, eight values of a row an int32 along K.

A value q at bits 4j of an int32 becomes (q - z) by w4a16_gemv.py's magic number: q OR-ed into the low mantissa bits
of the fp32 2^23 is the float 2^23 + q, and one subtraction of 2^23 + z leaves q - z exactly, with no integer-to-
float conversion. The eight values of an int32 are columns 8j..8j+7 of its row, in order, so unpacking a tile of P
int32s along K and merging its last two dims gives the tile of 8P columns in column order.
"""

import triton
import triton.language as tl

from nanoserve.kernels.w4a16_gemv import MAGIC, MAGIC_BITS


@triton.jit
def _magic(packed, shifts):
    """2^23 + the value at bits `shifts` of each int32 of `packed` (broadcast together), in fp32."""
    return (((packed >> shifts) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit
def zero_points(z_ptrs, HAS_ZEROS: tl.constexpr):
    """2^23 plus the zero points at z_ptrs (uint8), or (symmetric: none stored) plus 8, in fp32."""
    if HAS_ZEROS:
        z = tl.load(z_ptrs).to(tl.float32) + MAGIC
    else:
        z = tl.full(z_ptrs.shape, MAGIC + 8.0, tl.float32)
    return z


@triton.jit
def unpack_w4_k_major(packed, magic_z):
    """A [P, BLOCK_N] tile of int32s along K (rows: the packed columns, tl.dot's K) and 2^23 + each column's zero
    point [1, BLOCK_N] -> (q - z) fp32 [8P, BLOCK_N], value 8p + j of column n at [8p + j, n]."""
    shifts = tl.arange(0, 8) * 4
    p: tl.constexpr = packed.shape[0]
    n: tl.constexpr = packed.shape[1]
    values = _magic(packed[:, None, :], shifts[None, :, None])
    return tl.reshape(values - magic_z[None, :, :], [p * 8, n])


@triton.jit
def unpack_w4_rows(packed, magic_z):
    """A [BLOCK_N, P] tile of int32s (a row's packed columns along the last dim) and 2^23 + each row's zero point
    [BLOCK_N] -> (q - z) fp32 [BLOCK_N, 8P] in column order."""
    rows: tl.constexpr = packed.shape[0]
    p: tl.constexpr = packed.shape[1]
    values = _magic(packed[:, :, None], tl.arange(0, 8)[None, None, :] * 4) - magic_z[:, None, None]
    return tl.reshape(values, [rows, p * 8])


@triton.jit
def unpack_w4_pairs(packed, magic_z):
    """unpack_w4_rows for a [J, BLOCK_N, P] tile (J pairs' rows) and zero points [J, BLOCK_N] -> [J, BLOCK_N, 8P]."""
    pairs: tl.constexpr = packed.shape[0]
    rows: tl.constexpr = packed.shape[1]
    p: tl.constexpr = packed.shape[2]
    values = _magic(packed[:, :, :, None], tl.arange(0, 8)[None, None, None, :] * 4) - magic_z[:, :, None, None]
    return tl.reshape(values, [pairs, rows, p * 8])
