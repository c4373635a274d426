"""The one-row W4A16 GEMV (batch-1 decode, kernels/w4a16_gemm.py's w4a16_linear at M = 1): out[M, N] = x[M, K] @
W[K, N] (+ bias) for a weight in the W4 layout (nanoserve/quantization/w4_packing.py), one program per (BLOCK_N
columns, row, K split). Bound by the weight's bytes, so its structure is what keeps the loop short (each point found
in its sm_90 SASS, compiled on a CPU):
- full column tiles are not clamped to N (EVEN_N): clamping hid the columns' contiguity, so Triton gave each
  thread one column of the tile, loading the weight 4 bytes at a time and loading and converting x once per 4-bit
  value; unclamped, a thread holds 4 adjacent columns (16-byte loads) and shares its x work over them;
- x is read at a pointer plus a constant (the compiler folds it into the load; an index plus a constant cost three
  instructions a load to form a 64-bit address);
- the weight is prefetched into registers one or two tiles ahead of the one multiplied (as kernels/gemv.py does for
  bf16), with its scales and zero points where a tile is a group; narrower tiles reload those at each group's first
  tile only, since unless BLOCK_N is 128 x num_warps Triton moves them into the tile's layout through shared
  memory, with barriers;
- a split of K is summed by the split's last program to finish (an arrival counter per column tile, which that
  program resets: the caller's buffer, split_counters), not by a second launch: at batch 1 a launch costs about as
  much as streaming a small layer;
- the zero point and the magic number leave the inner loop ("hoisted"). Each shift of the int32 brings two values
  at once into the mantissa's bits 15..18 and 19..22, where one LOP3 each makes the floats 2^23 + q 2^15 and
  2^23 + q 2^19 (the second's x pre-scaled by 1/16); these are multiplied into x and added as they are, and per
  tile row the sum less 2^23 (S_even + S_odd / 16) and less z 2^15 (S_even + S_odd) is 2^15 Σ (q - z) x (S: the
  row's x summed over its even and odd positions, once for all of a thread's columns). Exactness: 2^23 + q 2^19 <
  2^24 is an fp32 integer, and the 2^23 x carried along is at most 2^8 times the term that matters (q 2^15 x), so
  the subtraction costs ~8 of fp32's 24 bits: ~1e-5 relative, far below bf16's rounding of the output.
Main loop per 128 values (16 int32 a thread; 128 columns, 128-row tiles, 4 warps): 561 SASS instructions (128 FFMA
+ 128 LOP3 + 64 shifts at its core); the one-row kernel it replaced (the weight's values taken one at a time as
(2^23 + q) - (2^23 + z), columns clamped) 1153, and that arithmetic unclamped and prefetched ("magic") 760.

A tile lies in one group of the quantization (BLOCK_K divides the group size) and K is whole tiles (the wrapper
narrows BLOCK_K to the largest power of two dividing K), so no load is masked. Tiles and split by shape: gemv_config.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.w4a16_reference import PACK

VALUES_PER_INT32 = tl.constexpr(PACK)  # PACK, as the kernels may read it
MAGIC_BITS = tl.constexpr(0x4B000000)  # the fp32 2^23: OR-ing into its mantissa's bits gives 2^23 + that integer
MAGIC = tl.constexpr(8388608.0)
# Mantissa bits 15..18 (2^23 + q 2^15) and 19..22 (2^23 + q 2^19). Passed as arguments: as constants, ptxas
# rematerialized one into a register before every other LOP3 (which takes one immediate, and 2^23's is the other).
LOW_FIELD = 0xF << 15
HIGH_FIELD = 0xF << 19


@triton.jit
def _x_at(row_ptrs, x_row, j, HAS_PERM: tl.constexpr):
    """x (fp32) at weight rows k8 + j, for row_ptrs = x_row + k8, or perm + k8 with act-order (x's columns perm[k]).
    A pointer plus a constant, so that the compiler folds j into the load's address (an index plus j, it computed
    each load's 64-bit address: three instructions a load)."""
    if HAS_PERM:
        return tl.load(x_row + tl.load(row_ptrs + j)).to(tl.float32)
    return tl.load(row_ptrs + j).to(tl.float32)


@triton.jit
def _tile(packed, row_ptrs, x_row, s, z, low_field, high_field, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr):
    """Σ_j (q - z) x s over the eight values of each int32 of a [P, BLOCK_N] tile (rows k8 + j), not summed over P,
    the magic number and the zero point subtracted once per tile element (module doc); row_ptrs as _x_at's."""
    part = tl.zeros(packed.shape, dtype=tl.float32)
    sum_even = tl.zeros(row_ptrs.shape, dtype=tl.float32)
    sum_odd = tl.zeros(row_ptrs.shape, dtype=tl.float32)
    for i in tl.static_range(4):
        # Values 2i and 2i + 1 (bits 8i..8i+7) to bits 15..22; an arithmetic right shift's sign copies land above.
        if 8 * i <= 15:
            t = packed << (15 - 8 * i)
        else:
            t = packed >> (8 * i - 15)
        x_even = _x_at(row_ptrs, x_row, 2 * i, HAS_PERM)
        x_odd = _x_at(row_ptrs, x_row, 2 * i + 1, HAS_PERM)
        sum_even += x_even
        sum_odd += x_odd
        part += ((t & low_field) | MAGIC_BITS).to(tl.float32, bitcast=True) * x_even[:, None]
        part += ((t & high_field) | MAGIC_BITS).to(tl.float32, bitcast=True) * (x_odd * 0.0625)[:, None]
    # part = 2^23 (S_even + S_odd / 16) + 2^15 Σ q x
    bias = MAGIC * (sum_even + sum_odd * 0.0625)
    x_sum = (sum_even + sum_odd) * 32768.0
    if HAS_ZEROS:
        qz = (part - bias[:, None]) - z[None, :] * x_sum[:, None]
    else:
        qz = (part - bias[:, None]) - 8.0 * x_sum[:, None]
    return qz * (s * (1.0 / 32768.0))[None, :]


@triton.jit
def _group_params(s_ptr, z_ptr, k0, cols, N, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """The scales and zero points (fp32; zeros 8 without them) of the group holding weight row k0."""
    g = k0 // GROUP if GROUP > 0 else 0
    s = tl.load(s_ptr + g * N + cols).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + g * N + cols).to(tl.float32)
    else:
        z = s
    return s, z


@triton.jit
def _w4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, b_ptr, out_ptr, part_ptr, count_ptr, N, K, stride_xm,
                    k_per_split, splits, low_field, high_field, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, AHEAD: tl.constexpr,
                    EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        # Unclamped, the columns are known contiguous: each thread loads 16 bytes of int32 (4 columns) at once and
        # shares its x work over them. Clamped, Triton gave each thread one column of the tile: a load and a
        # conversion of x per 4-bit value (sm_90 SASS).
        cols = offs_n
    else:
        cols = tl.minimum(offs_n, N - 1)  # tail columns read a valid one again; the store drops them
    offs_p = tl.arange(0, BLOCK_K // VALUES_PER_INT32)
    w_ptrs = qw_ptr + offs_p[:, None] * N + cols[None, :]
    x_row = x_ptr + m * stride_xm
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # Loads past the split's end take its last tile again (a cache hit) rather than a predicate on every load.
    last = k_end - BLOCK_K
    w = tl.load(w_ptrs + (k_start // VALUES_PER_INT32) * N)
    s, z = _group_params(s_ptr, z_ptr, k_start, cols, N, GROUP, HAS_ZEROS)
    # A tile a group: its scales and zero points are prefetched with it. Narrower tiles reload them at each group's
    # first tile only, as moving them into the tile's layout may take a pass through shared memory (module doc).
    if AHEAD == 2:
        k_ahead = tl.minimum(k_start + BLOCK_K, last)
        w_ahead = tl.load(w_ptrs + (k_ahead // VALUES_PER_INT32) * N)
        if GROUP == BLOCK_K:
            s_ahead, z_ahead = _group_params(s_ptr, z_ptr, k_ahead, cols, N, GROUP, HAS_ZEROS)
    # Summed over the tile's rows only after the loop: a reduction per tile would be a cross-thread exchange each.
    acc = tl.zeros([BLOCK_K // VALUES_PER_INT32, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_next = tl.minimum(k0 + AHEAD * BLOCK_K, last)
        w_next = tl.load(w_ptrs + (k_next // VALUES_PER_INT32) * N)
        if GROUP == BLOCK_K:
            s_next, z_next = _group_params(s_ptr, z_ptr, k_next, cols, N, GROUP, HAS_ZEROS)
        elif GROUP > 0:
            if k0 % GROUP == 0:
                s, z = _group_params(s_ptr, z_ptr, k0, cols, N, GROUP, HAS_ZEROS)
        row_ptrs = (perm_ptr if HAS_PERM else x_row) + k0 + offs_p * VALUES_PER_INT32
        acc += _tile(w, row_ptrs, x_row, s, z, low_field, high_field, HAS_ZEROS, HAS_PERM)
        if AHEAD == 2:
            w, w_ahead = w_ahead, w_next
            if GROUP == BLOCK_K:
                s, z, s_ahead, z_ahead = s_ahead, z_ahead, s_next, z_next
        else:
            w = w_next
            if GROUP == BLOCK_K:
                s, z = s_next, z_next
    res = tl.sum(acc, axis=0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs_n < N
    if SPLIT_K:
        tile = m * tl.num_programs(0) + pid_n
        tile_part = part_ptr + tile * splits * BLOCK_N
        tl.store(tile_part + pid_k * BLOCK_N + offs, res)
        # Every thread's partial is stored before the arrival is counted (one thread counts it, releasing them).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            # The last to arrive sums the partials in split order (so the result does not depend on who is last),
            # from L2 (.cg: L1 is not coherent), and resets the counter for the next launch.
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for i in range(splits):
                total += tl.load(tile_part + i * BLOCK_N + offs, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + cols).to(tl.float32)
            tl.store(out_ptr + m * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(count_ptr + tile, 0)
    else:
        if HAS_BIAS:
            res += tl.load(b_ptr + cols).to(tl.float32)
        tl.store(out_ptr + m * N + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask)


class GemvConfig(NamedTuple):
    """A launch's tiles: BLOCK_N columns a program, BLOCK_K rows a tile (narrowed to fit the groups and K), K split
    `split` ways (fewer where K has fewer tiles), `ahead` weight tiles loaded ahead of the one multiplied (1 or 2;
    each holds a tile's int32s in registers)."""
    block_n: int = 128
    block_k: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 1
    ahead: int = 1


BLOCK_N = GemvConfig().block_n  # the rule's columns a program, which split_counters sizes for
MAX_SPLIT = 16
MAX_PROGRAMS = 1024
MIN_TILES_PER_SPLIT = 4


def gemv_config(n: int, k: int, group_size: int) -> GemvConfig:
    """The tiles by shape, from a probe at cf1ec25, deleted since (H200, 2026-11-28; Llama-3.1-8B's projections at
    one row, bf16 x, group 128 with zero points, CUDA graphs, weights rotated past L2), microseconds:

        shape (K, N)           old one-row kernel   "magic"   this kernel (split)   bf16 skinny GEMV
        qkv (4096, 6144)            18.67             11.54      9.62 (8)              16.68
        o (4096, 4096)              17.62              9.97      8.09 (8)              12.78
        gate_up (4096, 28672)       51.06             36.99     28.50 (4)              61.73
        down (14336, 4096)          52.00             22.25     17.48 (16)             35.62

    The best at every shape was 128 columns, 128-row tiles, 4 warps, 1 stage, one tile ahead (of 128 to 1024
    columns, 16 to 128 rows, 2 to 8 warps, 1 or 3 stages, one or two ahead, splits 1 to 32). Its split is the
    largest power of two up to MAX_SPLIT that launches at most MAX_PROGRAMS programs (column tiles x split) and
    leaves each at least MIN_TILES_PER_SPLIT tiles of K (8, 8, 4, 16 above). Narrower groups narrow the tiles (to the
    group size's largest power of two), as does a K that is not a multiple of 128 (one group per column)."""
    group = 0 if group_size == -1 else group_size
    block_k = min(128, k & -k, group & -group if group else k & -k)  # as w4a16_gemv narrows it
    tiles = k // block_k
    columns = triton.cdiv(n, BLOCK_N)
    split = 1
    while (split * 2 <= MAX_SPLIT and columns * split * 2 <= MAX_PROGRAMS
           and tiles >= MIN_TILES_PER_SPLIT * split * 2):
        split *= 2
    return GemvConfig(block_k=block_k, split=split)


def check_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None) -> None:
    """ValueError unless x [M, K] (contiguous last dim) and the W4 weight's tensors fit together, as the kernels here
    and in w4a16_gemm.py index them (row-major)."""
    k = x.shape[1]
    k8 = qweight.shape[0]
    if k8 * PACK != k or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, {k8 * PACK}] with a contiguous last dim, got {tuple(x.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("perm", perm), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if group_size != -1 and k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")


def split_counters(n: int, device: torch.device | str, rows: int = 1) -> torch.Tensor:
    """The zeroed int32 arrival counters a split launch of `rows` rows of an N-column weight counts on at the rule's
    tiles, which each launch leaves zero again: a layer allocates its own once, before any CUDA graph capture, and
    passes it to every call (launches in stream order may share one; concurrent ones may not)."""
    return torch.zeros(rows * triton.cdiv(n, BLOCK_N), dtype=torch.int32, device=device)


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               perm: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None,
               counters: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (contiguous last dim) @ the W4 weight (+ bias [N]) -> [M, N] in x's dtype; group_size -1: one group
    per column. config: gemv_config's by default. counters: split_counters' (a zeroed int32 per row and column tile,
    left zero), used where K is split; None: a fresh one each call (a memset launch more)."""
    check_operands(x, qweight, scales, zeros, perm, group_size, bias)
    m, k = x.shape
    n = qweight.shape[1]
    cfg = config or gemv_config(n, k, group_size)
    if cfg.ahead not in (1, 2):
        raise ValueError(f"ahead must be 1 or 2, got {cfg.ahead}")
    group = 0 if group_size == -1 else group_size
    # A tile lies in one group and K is whole tiles: the largest power of two dividing both, at most block_k.
    block_k = min(cfg.block_k, k & -k, group & -group if group else k & -k)
    tiles = k // block_k
    tiles_per_split = triton.cdiv(tiles, min(cfg.split, tiles))
    splits = triton.cdiv(tiles, tiles_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if splits > 1:
        partials = torch.empty(m * n_tiles * splits * cfg.block_n, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(m * n_tiles, dtype=torch.int32, device=x.device)
        elif counters.dtype != torch.int32 or counters.numel() < m * n_tiles or counters.device != x.device:
            raise ValueError(f"counters must be int32 on {x.device} with at least {m * n_tiles} entries, got "
                             f"{counters.numel()} {counters.dtype} on {counters.device}")
    else:
        partials = counters = out
    _w4_gemv_kernel[(n_tiles, m, splits)](
        x, qweight, scales, zeros if zeros is not None else scales, perm if perm is not None else qweight,
        bias if bias is not None else scales, out, partials, counters, n, k, x.stride(0), tiles_per_split * block_k,
        splits, LOW_FIELD, HIGH_FIELD, GROUP=group, HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None, SPLIT_K=splits > 1, AHEAD=cfg.ahead, EVEN_N=n % cfg.block_n == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
