"""y = x W^T (+ b) for a weight stored block-wise in FP8 (DeepSeek-V3, Qwen3-FP8): W [N, K] as float8_e4m3fn with
one fp32 scale per block of block_n rows x block_k columns, and the activations quantized dynamically per row and
group of block_k columns, as that scheme defines. torch._scaled_mm takes no block scales, so this Triton kernel
does it: each program computes a [BLOCK_M, BLOCK_N] tile of y, one group of block_k columns at a time (BLOCK_K =
block_k), and quantizes its rows of x itself: scale = max|group| / 448, x / scale cast to FP8 (rounded to nearest,
as PyTorch divides), an FP8 x FP8 product on the tensor cores into fp32, times the row's and the weight block's
scales. Quantizing in the kernel spares a launch and a round trip of x through memory; each column tile redoes it,
which costs little next to the weight bytes it streams at decode sizes.

Under the Triton interpreter (tests on the CPU) the FP8 operands are upcast to fp32 for the product (FP8_DOT off),
which is exact: an FP8 x FP8 product and its fp32 sums are what the tensor cores compute too; and x is rounded to
FP8's grid before its cast, whose rounding the interpreter gets wrong (kernels/fp8_quant.py).

The reference (fp8_block_linear_ref) runs it in PyTorch; it is the scheme's definition, the CPU path's
(nanoserve/quantization/fp8_math.py), in the kernel's order of sums per group.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fp8_quant import round_to_fp8_grid


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn,
                           stride_wsn, stride_ym, tiles_per_split, splits, BLOCK_SCALE_N: tl.constexpr,
                           HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr, SPLIT_K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + (offs_n // BLOCK_SCALE_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    kb_start = pid_k * tiles_per_split
    for kb in range(kb_start, tl.minimum(kb_start + tiles_per_split, tl.cdiv(K, BLOCK_K))):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
        xq = tl.clamp(tl.math.div_rn(x, x_scale[:, None]), -448.0, 448.0)
        if not FP8_DOT:
            xq = round_to_fp8_grid(xq)
        xq = xq.to(tl.float8e4nv)
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        w_scale = tl.load(ws_rows + kb, mask=mask_n, other=0.0)
        if FP8_DOT:
            part = tl.dot(xq, tl.trans(w))
        else:
            part = tl.dot(xq.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        acc += part * x_scale[:, None] * w_scale[None, :]
    if SPLIT_K:  # one tile of rows (pid_m 0): the split's last program to finish sums the partials, in split order
        offs_part = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_part = part_ptr + pid_n * splits * BLOCK_M * BLOCK_N
        tl.store(tile_part + pid_k * BLOCK_M * BLOCK_N + offs_part, acc)
        tl.debug_barrier()  # every thread's partial stored before the arrival is counted
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i in range(splits):
                acc += tl.load(tile_part + i * BLOCK_M * BLOCK_N + offs_part, cache_modifier=".cg")
            _store(acc, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)
            tl.store(count_ptr + pid_n, 0)  # left zero for the next launch
    else:
        _store(acc, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


@triton.jit
def _store(acc, b_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


MAX_SPLIT = 16
MAX_PROGRAMS = 1024
MIN_TILES_PER_SPLIT = 4


def split_k(m: int, n: int, k: int, block: tuple[int, int]) -> int:
    """How many ways one tile of rows (m up to _tiles' BLOCK_M: 16, 32 or 64) splits K: powers of two while the launch
    stays within MAX_PROGRAMS and each split keeps MIN_TILES_PER_SPLIT blocks of K. Why: a program's loop is
    latency-bound at decode sizes (each block of K loads, quantizes x's group with a reduction, multiplies), and
    unsplit Qwen3-30B-A3B-FP8's attention projections (64-160 column tiles of 16-32 blocks each) took 7.2 of a batch-1
    step's 9.7 ms on an H200 (1496ef1, `bench latency --profile`); split, the step took 4.4 ms (0d72012). Not swept."""
    if m > _tiles(m)[0]:
        return 1
    columns, tiles = triton.cdiv(n, _tiles(m)[1]), triton.cdiv(k, block[1])
    split = 1
    while split < MAX_SPLIT and columns * split * 2 <= MAX_PROGRAMS and tiles >= MIN_TILES_PER_SPLIT * split * 2:
        split *= 2
    return split


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for m rows. Narrow column tiles at decode sizes, so that a weight
    of 4,096 rows still spreads over more programs than an H100 has SMs (and K splits: split_k); not tuned on a GPU
    yet."""
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 32 if m <= 32 else 64, 64, 4, 3
    return 128, 128, 8, 3


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                     split: int | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) times weight [N, K] (float8_e4m3fn) scaled per block [ceil(N / block[0]),
    ceil(K / block[1])] (fp32), plus bias, in x's dtype. split: K's split (split_k's by default; only for one tile
    of rows); counters: fp8_gemv.split_counters' where K is split (None: a fresh one each call)."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    assert weight_scale.shape == (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, warps, stages = _tiles(m)
    # tl.dot takes FP8 operands only with K >= 32 per tile; narrower blocks upcast the tile (as the interpreter does).
    fp8_dot = x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9) and block[1] >= 32
    tiles = triton.cdiv(k, block[1])
    split = min(split_k(m, n, k, block) if split is None else split, tiles)
    if split > 1 and m > block_m:
        raise ValueError(f"K splits only for one tile of rows (M <= {block_m}), got M = {m}")
    tiles_per_split = triton.cdiv(tiles, split)
    splits = triton.cdiv(tiles, tiles_per_split)
    n_tiles = triton.cdiv(n, block_n)
    if splits > 1:
        partials = torch.empty(n_tiles * splits * block_m * block_n, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(n_tiles, dtype=torch.int32, device=x.device)
        elif counters.dtype != torch.int32 or counters.numel() < n_tiles or counters.device != x.device:
            raise ValueError(f"counters must be int32 on {x.device} with at least {n_tiles} entries")
    else:
        partials = counters = y
    grid = (triton.cdiv(m, block_m), n_tiles, splits)
    _fp8_block_gemm_kernel[grid](x, weight, weight_scale, bias if bias is not None else y, y, partials, counters, m, n,
                                 k, x.stride(0), weight.stride(0), weight_scale.stride(0), y.stride(0),
                                 tiles_per_split, splits, BLOCK_SCALE_N=block[0], HAS_BIAS=bias is not None,
                                 FP8_DOT=fp8_dot, SPLIT_K=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
                                 BLOCK_K=block[1], num_warps=warps, num_stages=stages)
    return y


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                               block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_block_linear in PyTorch (fp32): per group of block[1] columns, the quantized x times the fp8 weight,
    scaled by both scales, summed over the groups."""
    m, k = x.shape
    n = weight.shape[0]
    rows, cols = block
    acc = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    for g, start in enumerate(range(0, k, cols)):
        xg = x[:, start:start + cols].float()
        x_scale = xg.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / 448.0
        xq = (xg / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        w_scale = weight_scale[:, g].float().repeat_interleave(rows)[:n]
        acc += (xq @ weight[:, start:start + cols].float().T) * x_scale * w_scale
    if bias is not None:
        acc += bias.float()
    return acc.to(x.dtype)
