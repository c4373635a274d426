"""W8A8 GEMM for a few rows on the tensor cores: out[M, N] = (q[M, K] @ w[N, K].T) * x_scale[M] * w_scale[N] (+ bias),
q and w float8_e4m3fn, for M <= MAX_M; what torch._scaled_mm computes with row-wise scales, as one skinny launch.

Why: at batch 1 decode streams the weights, and fp8 halves their bytes, but the skinny GEMM that widens each fp8 value
on the CUDA cores (kernels/gemv.py, weight-only) streamed them at 1.5-1.85 TB/s on an H200 in every tile config swept
(issue 41, c14782a): as slow in time as bf16's GEMV, since each value costs conversions on top of its FMA. Widening to
bf16 for the tensor cores was slower still. Here nothing is converted: the input rows come quantized (q, x_scale: the
kernel before, rms_norm_fp8, act_and_mul_fp8 or quantize_rows, made them) and the tensor cores multiply fp8 by fp8
into fp32 (mma's fp8 shapes on sm_89+), the products exact; the scales multiply once, after the K reduction.

A program owns BLOCK_N output columns and walks its [BLOCK_N, K] slab of w (contiguous along K) in [BLOCK_N,
BLOCK_K] tiles, the A operand; q's rows, padded to 16 by reading the last row again, are B. The loads are
pipelined over num_stages by the compiler. K may be split over programs (Fp8GemvConfig.split): the split's last
program to finish sums the partials, as kernels/w4a16_gemv.py does (one launch, one node in a graph). Tiles by shape:
fp8_gemv_config (a sweep on an H200). First measured (Llama-3.1-8B batch 1, H200, 7563300, 16-64 rows a program,
256 columns a tile, no split): 4.453 ms a token against 5.027 through the weight-only skinny GEMM
(quantization/fp8_linear.py).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_M = 32


class Fp8GemvConfig(NamedTuple):
    """A launch's tiles: BLOCK_N rows of w a program, BLOCK_K columns a tile, K split `split` ways (fewer where K has
    fewer tiles), each split's partial sums added by the split's last program to finish (kernels/w4a16_gemv.py's
    arrival counters)."""
    block_n: int = 32
    block_k: int = 256
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_gemv_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_qm,
                     stride_wn, stride_om, k_per_split, splits, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Tail rows and columns read a valid row again instead of being masked; the store drops them.
    rows_w = tl.minimum(offs_n, N - 1)
    rows_q = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    q_ptrs = q_ptr + rows_q[:, None] * stride_qm + offs_k[None, :]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            q = tl.load(q_ptrs + k0)
        else:
            k_mask = (k0 + offs_k)[None, :] < K
            w = tl.load(w_ptrs + k0, mask=k_mask, other=0.0)
            q = tl.load(q_ptrs + k0, mask=k_mask, other=0.0)
        acc = tl.dot(w, tl.trans(q), acc)
    if SPLIT_K:
        tile_part = part_ptr + pid_n * splits * BLOCK_N * BLOCK_M
        offs_part = offs_n[:, None] % BLOCK_N * BLOCK_M + offs_m[None, :]
        tl.store(tile_part + pid_k * BLOCK_N * BLOCK_M + offs_part, acc)
        # Every thread's partial is stored before the arrival is counted (one thread counts it, releasing them).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            # The last to arrive sums the partials in split order (the result does not depend on who is last), from
            # L2 (.cg: L1 is not coherent), and resets the counter for the next launch.
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for i in range(splits):
                acc += tl.load(tile_part + i * BLOCK_N * BLOCK_M + offs_part, cache_modifier=".cg")
            _store(acc, xs_ptr, ws_ptr, b_ptr, out_ptr, rows_q, rows_w, offs_m, offs_n, M, N, stride_om, HAS_BIAS)
            tl.store(count_ptr + pid_n, 0)
    else:
        _store(acc, xs_ptr, ws_ptr, b_ptr, out_ptr, rows_q, rows_w, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _store(acc, xs_ptr, ws_ptr, b_ptr, out_ptr, rows_q, rows_w, offs_m, offs_n, M, N, stride_om,
           HAS_BIAS: tl.constexpr):
    res = tl.trans(acc) * tl.load(xs_ptr + rows_q)[:, None] * tl.load(ws_ptr + rows_w)[None, :]
    if HAS_BIAS:
        res += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


MAX_PROGRAMS = 128  # about a wave: the sweep's best launched 64-128 programs at every shape
MIN_TILES_PER_SPLIT = 8


def fp8_gemv_config(n: int, k: int) -> Fp8GemvConfig:
    """The tiles by shape, from a sweep at 1496ef1 (scripts/probe_fp8_gemv.py, deleted since; H200, 2026-11-29;
    Llama-3.1-8B's projections at one row, CUDA graphs, weights rotated past the L2), microseconds:

        shape (K, N)          bf16 skinny GEMV   first rule (32 x 256, no split)   this rule
        qkv (4096, 6144)           18.04                 16.78                     9.95
        o (4096, 4096)             12.15                 12.30                     7.81
        gate_up (4096, 28672)      59.32                 37.36                    34.54
        down (14336, 4096)         35.04                 32.93                    18.55 (split 2)

    The best at every shape was 64 rows of w a program, 512-column tiles, 4 warps, 4 stages (of 16-64 rows, 128-512
    columns, splits 1-8, 2-8 warps, 2-6 stages): 2.2-3.4 TB/s of fp8 weight. K is split (powers of two, up to 8)
    while the launch stays within MAX_PROGRAMS and each split keeps MIN_TILES_PER_SPLIT tiles: down_proj's 2.
    Quantizing the input row where no kernel before does it (o_proj's, kernels/fp8_quant.py) costs 2.6-6.6 us more."""
    cfg = Fp8GemvConfig(block_n=64, block_k=512, num_warps=4, num_stages=4)
    columns = triton.cdiv(n, cfg.block_n)
    tiles = triton.cdiv(k, cfg.block_k)
    split = 1
    while split < 8 and columns * split * 2 <= MAX_PROGRAMS and tiles >= MIN_TILES_PER_SPLIT * split * 2:
        split *= 2
    return cfg._replace(split=split)


def fp8_gemv(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             counters: torch.Tensor | None = None, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """q [M, K] and weight [N, K] float8_e4m3fn, x_scale [M, 1] and weight_scale [N] fp32 -> [M, N] of out_dtype,
    accumulated in fp32 (+ bias [N]), for 1 <= M <= MAX_M. config: fp8_gemv_config's by default. counters: a zeroed
    int32 per column tile (split_counters), left zero, used where K is split; None: a fresh one each call."""
    m, k = q.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"q has {m} rows; fp8_gemv handles 1..{MAX_M}")
    if q.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q and weight must be float8_e4m3fn, got {q.dtype} and {weight.dtype}")
    if weight.shape != (n, k) or q.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] and both contiguous along K, got {tuple(weight.shape)}")
    if x_scale.numel() != m or weight_scale.shape != (n,):
        raise ValueError(f"x_scale must hold {m} and weight_scale ({n},) values, got {tuple(x_scale.shape)} and "
                         f"{tuple(weight_scale.shape)}")
    cfg = config or fp8_gemv_config(n, k)
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(tiles, min(cfg.split, tiles))
    splits = triton.cdiv(tiles, tiles_per_split)
    n_tiles = triton.cdiv(n, cfg.block_n)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if splits > 1:
        partials = torch.empty(n_tiles * splits * cfg.block_n * block_m, dtype=torch.float32, device=q.device)
        if counters is None:
            counters = torch.zeros(n_tiles, dtype=torch.int32, device=q.device)
        elif counters.dtype != torch.int32 or counters.numel() < n_tiles or counters.device != q.device:
            raise ValueError(f"counters must be int32 on {q.device} with at least {n_tiles} entries, got "
                             f"{counters.numel()} {counters.dtype} on {counters.device}")
    else:
        partials = counters = out
    _fp8_gemv_kernel[(n_tiles, splits)](
        q, x_scale.reshape(m).float(), weight, weight_scale, bias if bias is not None else weight_scale, out,
        partials, counters, m, n, k, q.stride(0), weight.stride(0), out.stride(0), tiles_per_split * cfg.block_k,
        splits, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, SPLIT_K=splits > 1, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def split_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 arrival counters a split launch of an N-row weight counts on at fp8_gemv_config's tiles (the
    smallest block_n, so any of its configs fits), which each launch leaves zero again: a layer allocates its own
    once, before any CUDA graph capture."""
    return torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)


def fp8_gemv_ref(q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp8_gemv in PyTorch (fp32)."""
    res = (q.float() @ weight.float().T) * x_scale.reshape(-1, 1).float() * weight_scale.float()[None, :]
    return (res if bias is None else res + bias.float()).to(out_dtype)
