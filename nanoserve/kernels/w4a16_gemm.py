"""W4A16 GEMM: out[M, N] = x[M, K] @ W[K, N] (+ bias) for a weight of 4-bit integers with per-group scales and zero
points, in the W4 layout (nanoserve/quantization/w4_packing.py): qweight int32 [K / 8, N] holding row k of W at
entry [k // 8, n], bits 4 (k % 8); scales [G, N]; zeros uint8 [G, N] or none (8); perm int32 [K] or none (x's
columns in the rows' order: act-order). W[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n].

The packed weight is read from memory once and unpacked in registers; the products are summed in fp32. Two kernels:
- one row (batch-1 decode, bound by the weight's bytes): a program owns BLOCK_N output columns and walks its slab of
  qweight in [BLOCK_K / 8, BLOCK_N] tiles of int32, each read once (not once per value, as a tile of unpacked rows
  would), and takes the eight values of its int32s one at a time as q - z (by float bit tricks, MAGIC below); x's
  values, a few KB, come from cache. Each tile lies in one group, so its sums are scaled once.
- more rows: a [BLOCK_M, BLOCK_N] tile on the tensor cores, each [BLOCK_K, BLOCK_N] weight tile (its int32s read
  once and unpacked as above) turned into (q - z), small integers that x's dtype holds exactly, multiplied by the x
  tile and scaled per group in fp32.
Both split K over several programs where the column tiles alone would leave the GPU's SMs idle (the partial sums go
through an fp32 buffer and a second launch adds them), so the results of a split differ from one program's by the
order of fp32 sums only. Tile sizes come from shapes by a rule (no autotuning, which cannot run inside a CUDA graph);
the one-row rule was timed on an H200 (in _config), the GEMM's is a first guess.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.w4a16_reference import PACK

# 2^23 as fp32: OR-ing a 4-bit value q into its low mantissa bits gives the float 2^23 + q, so that q - z is one
# subtraction of 2^23 + z, with no integer-to-float conversion (a quarter-rate instruction, which at eight a packed
# int32 would make the one-row GEMV compute-bound rather than bound by the weight's bytes).
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


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
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.minimum(offs_n, N - 1)  # tail columns read a valid one again; the store drops them
    offs_p = tl.arange(0, BLOCK_K // 8)
    # Summed over the tile's rows only after the loop: reducing every tile would cost a cross-thread exchange per
    # iteration.
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        p = k0 // 8 + offs_p
        p_mask = p < k_end // 8
        packed = tl.load(qw_ptr + p[:, None] * N + cols[None, :], mask=p_mask[:, None], other=0)
        s, z = _group_scale_zero(s_ptr, z_ptr, k0, cols, N, GROUP, HAS_ZEROS)
        # The eight values of each int32 one at a time, as [BLOCK_K / 8, BLOCK_N] tiles: a [BLOCK_K / 8, 8, BLOCK_N]
        # tile of all of them at once (the first form of this kernel) ran at 173-195 GB/s of packed bytes on an
        # H200, this one at 820-1,570 GB/s (Llama-3.1-8B's projections at one row, 2026-11-28).
        part = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(8):
            k = p * 8 + j
            if HAS_PERM:
                k = tl.load(perm_ptr + k, mask=p_mask, other=0)
            x = tl.load(x_ptr + m * stride_xm + k, mask=p_mask, other=0.0).to(tl.float32)
            q = (((packed >> (4 * j)) & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)  # 2^23 + q
            part += (q - z[None, :]) * x[:, None]
        acc += part * s[None, :]
    _store(out_ptr, tl.sum(acc, axis=0)[None, :], b_ptr, m + tl.arange(0, 1), offs_n, cols, M, N, pid_k, SPLIT,
           HAS_BIAS)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, M, N, K, stride_xm, k_per_split,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, M - 1)
    cols = tl.minimum(offs_n, N - 1)
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
    gemv: bool
    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int


def _sm_count(x: torch.Tensor) -> int:
    """The SMs of x's GPU; 4 for the interpreter on the CPU (so its tests split K too)."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4


def _config(m: int, n: int, k: int, group: int, sms: int) -> _Config:
    """Tiles by shape: a tile of K lies in one group (block_k divides it, 16..128). One row: the measured rule
    below. More rows (a first rule, untimed): K is split until the tiles give about four programs an SM, a split
    being whole tiles."""
    block_k = 128 if group <= 0 else min(128, group & -group)
    gemv = m == 1
    if gemv:
        # Measured at Llama-3.1-8B's four projections on an H200 (128 or 256 columns, K split 1, 2 or 4, 4 or 8
        # warps): 128 columns and a split of 4 were fastest at every shape.
        split = 4 if triton.cdiv(k, block_k) >= 8 else 1
        return _Config(True, 1, 128, block_k, split, 4)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while tiles * split * 2 <= 4 * sms and triton.cdiv(k, block_k) >= split * 2 * 2 and split < 16:
        split *= 2
    return _Config(gemv, block_m, block_n, block_k, split, 4)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (contiguous last dim) @ the W4 weight (+ bias [N]) -> [M, N] in x's dtype; group_size -1: one group
    per output column."""
    m, k = x.shape
    k8, n = qweight.shape
    if k8 * PACK != k or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, {k8 * PACK}] with a contiguous last dim, got {tuple(x.shape)}")
    # The kernels index the weight's tensors as row-major.
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("perm", perm), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if group_size != -1 and k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")
    group = 0 if group_size == -1 else group_size
    cfg = _config(m, n, k, group, _sm_count(x))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if cfg.split == 1 else torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split)
    args = (x, qweight, scales, zeros if zeros is not None else scales, perm if perm is not None else qweight,
            bias if bias is not None else scales, target, m, n, k, x.stride(0), k_per_split)
    flags = dict(GROUP=group, HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
                 SPLIT=cfg.split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if cfg.gemv:
        _w4a16_gemv_kernel[grid](*args, **flags)
    else:
        _w4a16_gemm_kernel[grid](*args, **flags, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                 BLOCK_M=cfg.block_m)
    if cfg.split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, bias if bias is not None else target, out, m * n, n,
                                                         SPLIT=cfg.split, HAS_BIAS=bias is not None, BLOCK=block)
    return out
