"""MXFP4 weights unpacked in registers, for the MoE kernels (fused_moe.py, moe_gemv.py).

The layout those kernels read (model/gpt_oss.py keeps gpt-oss's experts in it on the GPU): a weight [E, N, K] of
MXFP4 values is two uint8 tensors,
- `w` [E, N, K / 2]: the values of columns 2j and 2j + 1 of a row in its byte j, the low nibble first (E2M1: sign,
  2 exponent bits, 1 mantissa bit). It is the checkpoint's `*_blocks` [E, N, K / 32, 16] with its last two dims
  merged: each row contiguous along K, as the 16-bit weights' rows are;
- `scale` [E, N, K / 32]: one E8M0 byte per 32 columns of a row, 2^(byte - 127) (the checkpoint's `*_scales`).
So K is a multiple of 32, and a tensor-parallel slice along K starts and ends on whole blocks of 32.

A kernel loads a tile of bytes and multiplies its low nibbles' values by the activations' even columns and its high
nibbles' by the odd ones: two products of half the width, rather than interleaving the halves back into one tile in
registers. Each byte's lane reads its block's scale itself (column // 32), an L1 hit after the first.
"""

import triton
import triton.language as tl


@triton.jit
def e2m1_to_fp32(code):
    """E2M1 codes (0..15, an integer tensor) -> their values in fp32. The code's sign bit and its 2 exponent and 1
    mantissa bits are moved to fp16's sign, lowest exponent bits and top mantissa bit: an fp16 of exponent field e and
    mantissa m, 2^(e - 15) (1 + m / 2), or for e = 0 the subnormal m 2^-15, which is the E2M1 value 2^(e - 1) (1 + m /
    2) (e > 0) or m / 2 (e = 0) times 2^-14, exactly; the conversion to fp32 keeps it (fp16's subnormals included), and
    2^14 undoes the factor. Two shifts, two ANDs, an OR, a conversion and a multiply a value: the magnitude's case
    analysis this replaced (selects and compares) kept gpt-oss-20b's MXFP4 experts compute-bound on an H200 (1496ef1:
    a batch-1 step 4.5 ms against bf16's 2.75)."""
    code = code.to(tl.uint16)
    bits = (code & 8) << 12 | (code & 7) << 9
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_fp32(scale):
    """E8M0 bytes -> 2^(byte - 127) in fp32: the byte is fp32's exponent field; byte 0 (2^-127) is fp32's subnormal
    with only its top mantissa bit set."""
    s = scale.to(tl.uint32)
    return tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def unpack_mxfp4(packed, scale):
    """Bytes of MXFP4 values and each byte's block scale (uint8 tensors of one shape) -> (the low nibbles' values,
    the high nibbles'), fp32. Exact, as quantization/mxfp4.py's dequantize_mxfp4: a power-of-two scale times a value
    of 2 significant bits, in range for gpt-oss's scales (near 127)."""
    s = e8m0_to_fp32(scale)
    return e2m1_to_fp32(packed & 15) * s, e2m1_to_fp32(packed >> 4) * s


@triton.jit
def load_bytes(ptrs, mask, MASKED: tl.constexpr):
    """The bytes at ptrs; MASKED: those off the mask read as zeros."""
    if MASKED:
        loaded = tl.load(ptrs, mask=mask, other=0)
    else:
        loaded = tl.load(ptrs)
    return loaded


@triton.jit
def load_mxfp4(w_ptrs, s_ptrs, mask, MASKED: tl.constexpr):
    """unpack_mxfp4 of the bytes at w_ptrs and their scales at s_ptrs; MASKED: bytes off the mask read as zeros."""
    return unpack_mxfp4(load_bytes(w_ptrs, mask, MASKED), load_bytes(s_ptrs, mask, MASKED))


def mxfp4_shapes(num_experts: int, n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of `w` and `scale` of an MXFP4 weight [num_experts, n, k] (k a multiple of 32)."""
    return (num_experts, n, k // 2), (num_experts, n, k // 32)
