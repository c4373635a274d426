"""W4A16 GEMM: out[M, N] = x[M, K] @ W[K, N] (+ bias) for a weight of 4-bit integers with per-group scales and zero
points, in the W4 layout (nanoserve/quantization/w4_packing.py): qweight int32 [K / 8, N] holding row k of W at
entry [k // 8, n], bits 4 (k % 8); scales [G, N]; zeros uint8 [G, N] or none (8); perm int32 [K] or none (x's
columns in the rows' order: act-order). W[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n].

One row (batch-1 decode, bound by the weight's bytes) goes to kernels/w4a16_gemv.py. More rows: a [BLOCK_M,
BLOCK_N] tile on the tensor cores, each [BLOCK_K, BLOCK_N] weight tile's int32s read once and unpacked in registers
(by float bit tricks, MAGIC below) into (q - z), small integers that x's dtype holds exactly, multiplied by the x
tile and scaled per group in fp32 (a tile of K lies in one group). K is split over several programs where the column
tiles alone would leave the GPU's SMs idle (the partial sums go through an fp32 buffer and a second launch adds
them), so the results of a split differ from one program's by the order of fp32 sums only. Tile sizes come from
shapes by a rule (no autotuning, which cannot run inside a CUDA graph): the one-row kernel's was timed on an H200
(w4a16_gemv.gemv_config), the GEMM's is a first guess.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# MAGIC_BITS, the fp32 2^23: OR-ing a 4-bit value q into its low mantissa bits gives the float 2^23 + q, so that
# q - z is one subtraction of 2^23 + z (MAGIC + z), with no integer-to-float conversion (a quarter-rate instruction,
# eight a packed int32).
from nanoserve.kernels.w4a16_gemv import MAGIC, MAGIC_BITS, check_operands, w4a16_gemv


@triton.jit
def _unpack(packed, shifts):
    """[P, BLOCK_N] int32 -> [P, 8, BLOCK_N] fp32 2^23 + q, q the value at bits `shifts` of each."""
    return (((packed[:, None, :] >> shifts[None, :, None]) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, k0, cols, N, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """The scales (fp32) of the group holding input row k0, for columns `cols`, and 2^23 plus their zero points
    (what _unpack's values less it are q - z); GROUP 0: one group."""
    g = k0 // GROUP if GROUP > 0 else 0
    s = tl.load(s_ptr + g * N + cols).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * N + cols).to(tl.float32) + MAGIC
    else:
        z = tl.full(s.shape, MAGIC + 8.0, tl.float32)
    return s, z


@triton.jit
def _store(out_ptr, acc, b_ptr, offs_m, offs_n, cols, M, N, pid_k, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] result: with bias, in out's dtype; or one split's fp32 partial into its slice."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT > 1:
        tl.store(out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, M - 1)
    if EVEN_N:
        # Unclamped, the columns are known contiguous, so Triton can give a thread adjacent ones (wide loads); the
        # clamp hid that in the one-row kernel this file had (w4a16_gemv.py's module doc).
        cols = offs_n
    else:
        cols = tl.minimum(offs_n, N - 1)  # tail columns read a valid one again; the store drops them
    offs_k = tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    act_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        xk = k
        if HAS_PERM:
            xk = tl.load(perm_ptr + k, mask=k_mask, other=0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + xk[None, :], mask=k_mask[None, :], other=0.0)
        # Each int32 loaded once, its eight values unpacked into the eight rows it holds (row 8p + j at bits 4j).
        p = k0 // 8 + offs_p
        packed = tl.load(qw_ptr + p[:, None] * N + cols[None, :], mask=(p < K // 8)[:, None], other=0)
        s, z = _group_scale_zero(s_ptr, z_ptr, k0, cols, N, GROUP, HAS_ZEROS)
        w = tl.reshape(_unpack(packed, shifts) - z[None, None, :], [BLOCK_K, BLOCK_N])
        # q - z is an integer in -16..15, exact in fp16 / bf16; x beyond K is 0, so masked rows add nothing.
        part = tl.dot(x, w.to(act_dtype), input_precision=DOT_PRECISION)
        acc += part * s[None, :]
    _store(out_ptr, acc, b_ptr, offs_m, offs_n, cols, M, N, pid_k, SPLIT, HAS_BIAS)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int


def _sm_count(x: torch.Tensor) -> int:
    """The SMs of x's GPU; 4 for the interpreter on the CPU (so its tests split K too)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


def _config(m: int, n: int, k: int, group: int, sms: int) -> _Config:
    """Tiles by shape (a first rule, untimed): a tile of K lies in one group (block_k divides it, 16..128); K is
    split until the tiles give about four programs an SM, a split being whole tiles."""
    block_k = 128 if group <= 0 else min(128, group & -group)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while tiles * split * 2 <= 4 * sms and triton.cdiv(k, block_k) >= split * 2 * 2 and split < 16:
        split *= 2
    return _Config(block_m, block_n, block_k, split, 4)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous last dim) @ the W4 weight (+ bias [N]) -> [M, N] in x's dtype; group_size -1: one group
    per output column. counters: the layer's w4a16_gemv.split_counters, for one row (None: a fresh one a call)."""
    m, k = x.shape
    n = qweight.shape[1]
    if m == 1:
        return w4a16_gemv(x, qweight, scales, zeros, perm, group_size, bias, counters)
    check_operands(x, qweight, scales, zeros, perm, group_size, bias)
    group = 0 if group_size == -1 else group_size
    cfg = _config(m, n, k, group, _sm_count(x))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if cfg.split == 1 else torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split)
    _w4a16_gemm_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, perm if perm is not None else qweight,
        bias if bias is not None else scales, target, m, n, k, x.stride(0), k_per_split, GROUP=group,
        HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT=cfg.split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", EVEN_N=n % cfg.block_n == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if cfg.split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, bias if bias is not None else target, out, m * n, n,
                                                         SPLIT=cfg.split, HAS_BIAS=bias is not None, BLOCK=block)
    return out
