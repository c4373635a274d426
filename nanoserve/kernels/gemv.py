"""Skinny GEMM for decode: out[M, N] = x[M, K] @ weight[N, K].T (+ bias) for a handful of rows.

At M <= 32 a linear layer is a pass over its weight, so the kernel is built to stream each weight byte
once at full bandwidth: a program owns BLOCK_N output columns for all M rows and walks its [BLOCK_N, K]
slab of the weight (contiguous along K) in wide, coalesced [BLOCK_N, BLOCK_K] tiles: on the CUDA cores at
M = 1 (but for weights of 32 MB and more) and at M = 2 up to N = 2048, on the tensor cores (M padded to 16 or
32) otherwise (from M = 9 when N < 2048). (The grid also tiles M, so a config with BLOCK_M < M runs, as the
decode-step probes at 275aa23 timed.) There is one launch and no split-K partials to reduce, so a call adds one node
to a CUDA graph, and block sizes come from shapes by an explicit rule (no autotuning, which cannot run inside
graph capture).

Two variants fold the elementwise kernel that would otherwise run just before the GEMM into how it reads x,
since at batch 1 each launch costs about as much as streaming a small layer's weight: skinny_norm_linear
(residual add + RMSNorm, for qkv_proj and gate_up_proj; Gemma's 1 + weight too) and skinny_silu_mul_linear
(SiLU-and-mul, or Gemma's tanh-GELU-and-mul, for down_proj).
The activation rows are a few KB, so every program recomputing them from L1/L2 costs little next to its
slab of the weight.

FP8 weights (weight_scale given: float8_e4m3fn [N, K] and one fp32 scale per output row, the form
quantization/fp8_linear.py's per-tensor and per-channel schemes hold) run the same kernel with the weight dequantized
in registers: tiles load at one byte an element and widen to fp32 (the CUDA cores) or to the activations' dtype (the
tensor cores; exact, as every e4m3 value is a bf16 and an fp16), and each row's sum is multiplied by its scale once,
after the K reduction, before the bias. The activations stay in their 16-bit dtype: at a few rows the step is bound
by the weight's bytes, which fp8 halves, and the math is more exact than quantizing the activations too. The shape
rule (_config) counts the weight's bytes, not its elements: an fp8 weight takes the path of a 16-bit weight of as
many bytes. A constexpr switch (W_SCALED) leaves the 16-bit weights' code as it was (the kernel gains one unused
pointer argument).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.activation import act_and_mul_ref, act_mul
from nanoserve.kernels.pdl import launch_dependents, use_pdl, wait_for_prior_grids, wait_for_prior_grids_only
from nanoserve.kernels.rms_norm import rms_norm_ref

MAX_M = 32
TENSOR_CORES_FROM_BYTES_AT_ONE_ROW = 32 << 20  # measured in _config


@triton.jit
def _load(ptrs, mask, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_tile(w_ptrs, k, K, offs_k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The weight tile starting at column k of the slab whose first tile is at w_ptrs; past the end, the last tile
    again (a cache hit, rather than a predicate on every load) or nothing (ragged K, masked anyway)."""
    if EVEN_K:
        return tl.load(w_ptrs + tl.minimum(k, K - BLOCK_K))
    else:
        return tl.load(w_ptrs + k, mask=(k + offs_k)[None, :] < K, other=0.0)


@triton.jit
def _residual_sum(x_ptrs, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """x + residual rounded to the activation dtype, as the standalone add+RMSNorm computes it, in fp32."""
    h = _load(x_ptrs, mask, EVEN_K)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + _load(r_ptrs, mask, EVEN_K).to(tl.float32)).to(x_ptrs.dtype.element_ty)
    return h.to(tl.float32)


@triton.jit
def _skinny_linear_kernel(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, w_ptr, w_scale_ptr, b_ptr, out_ptr, M, N, K,
                          stride_xm, stride_rm, stride_wn, stride_om, eps, NORM: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr, NORM_OFFSET: tl.constexpr, SILU_MUL: tl.constexpr,
                          ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, W_SCALED: tl.constexpr,
                          USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                          USE_PDL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          LATE_DEPENDENTS: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Tail rows and columns read a valid row again instead of being masked, so full tiles load without
    # predicates; the store below drops them.
    rows_w = tl.minimum(offs_n, N - 1)
    rows_x = tl.minimum(offs_m, M - 1)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
    act_dtype = x_ptr.dtype.element_ty
    if not USE_DOT:
        # The CUDA-core path keeps two weight tiles in flight ahead of the one it multiplies, and the first two
        # are loaded before waiting on the kernels launched before this one: no kernel writes weights, so under
        # PDL they stream while those kernels finish (slabs of at most two tiles, the common case at batch 1,
        # are then entirely in flight before x is known). The tensor-core path's loads are pipelined by the
        # compiler, which would hoist x's loads above the wait with them.
        w = _load_tile(w_ptrs, 0, K, offs_k, BLOCK_K, EVEN_K)
        w_ahead = _load_tile(w_ptrs, BLOCK_K, K, offs_k, BLOCK_K, EVEN_K)
    if LATE_DEPENDENTS:
        wait_for_prior_grids_only(USE_PDL)
    else:
        wait_for_prior_grids(USE_PDL)
    if NORM:
        # Prologue RMSNorm(x + residual): every program needs each row's rms before its first tile, so it first
        # walks the rows once (K is at most a few thousand, and the rows stay in L1/L2 for the second walk). The
        # program owning the first columns also writes x + residual out as the next residual: into a buffer of
        # its own, since the other programs are still reading the residual it replaces.
        r_ptrs = res_ptr + rows_x[:, None] * stride_rm + offs_k[None, :]
        res_out_ptrs = res_out_ptr + offs_m[:, None] * K + offs_k[None, :]
        sum_sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + offs_k)[None, :] < K
            h = _residual_sum(x_ptrs + k0, r_ptrs + k0, k_mask, HAS_RESIDUAL, EVEN_K)
            if HAS_RESIDUAL and pid == 0:
                tl.store(res_out_ptrs + k0, h.to(act_dtype), mask=(offs_m < M)[:, None] & k_mask)
            sum_sq += h * h
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)[:, None]
        norm_w_ptrs = norm_w_ptr + offs_k
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        # The K reduction is deferred to after the loop: reducing every tile would cost a cross-warp
        # exchange and a barrier per iteration.
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        if USE_DOT:
            w = _load(w_ptrs, k_mask[None, :], EVEN_K)
        if NORM:
            # Rounded where the standalone RMSNorm kernel rounds: its normalized row, then its output.
            h = _residual_sum(x_ptrs, r_ptrs, k_mask[None, :], HAS_RESIDUAL, EVEN_K)
            norm_w = _load(norm_w_ptrs, k_mask, EVEN_K).to(tl.float32)
            if NORM_OFFSET != 0.0:
                # Gemma's norm (kernels/rms_norm.py's weight_offset): scaled in fp32, rounded once.
                x = (h * rstd * (norm_w[None, :] + NORM_OFFSET)).to(act_dtype)
            else:
                x = ((h * rstd).to(act_dtype).to(tl.float32) * norm_w[None, :]).to(act_dtype)
            r_ptrs += BLOCK_K
            norm_w_ptrs += BLOCK_K
        elif SILU_MUL:
            # x holds [gate | up] with K columns each; act(gate) * up in fp32, rounded as the standalone kernel.
            gate = _load(x_ptrs, k_mask[None, :], EVEN_K).to(tl.float32)
            up = _load(x_ptrs + K, k_mask[None, :], EVEN_K).to(tl.float32)
            x = act_mul(gate, up, ACTIVATION).to(act_dtype)
        else:
            x = _load(x_ptrs, k_mask[None, :], EVEN_K)
        if USE_DOT:
            # Tensor cores take the weight tile as it is (the A operand, K-contiguous) and x as B [K, M]
            # (also K-contiguous), accumulating in fp32.
            if W_SCALED:
                w = w.to(act_dtype)  # fp8 -> the activations' dtype, exactly (module docstring)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            w_next = _load_tile(w_ptrs, k0 + 2 * BLOCK_K, K, offs_k, BLOCK_K, EVEN_K)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            w = w_ahead
            w_ahead = w_next
        if USE_DOT:
            w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if LATE_DEPENDENTS:  # every weight tile is loaded: the next kernel's programs may take their room
        launch_dependents(USE_PDL)
    if USE_DOT:
        res = tl.trans(acc)
    else:
        res = tl.sum(acc, axis=2)
    if W_SCALED:
        res *= tl.load(w_scale_ptr + rows_w)[None, :]
    if HAS_BIAS:
        res += tl.load(b_ptr + rows_w).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


class _Config(NamedTuple):
    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tensor_cores_at(m: int, weight: torch.Tensor) -> bool:
    """Whether m rows times this weight take the tensor-core path. layers/step_plan.py fuses no prologue into it:
    at one row, with the norm fused in, Llama-3.1-8B's batch-1 decode was slower (see _config)."""
    return _config(m, weight.shape[0], weight.shape[1], weight.element_size()).use_dot


def _pow2_floor(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _config(m: int, n: int, k: int, elem_size: int) -> _Config:
    """Block sizes from shapes alone, by a rule fitted to a sweep on an H200 (132 SMs, bf16, the Qwen3-0.6B and
    Llama-3.1-8B decode layers at M = 1, 2, 4, 8, 16, in CUDA graphs): the rule's pick was within 5% of the
    sweep's best config in most cases, 12% at worst (M = 2, N = 6144, where the tensor-core path won). M = 17-32
    was added later from whole decode steps on an H100 (below). elem_size: the weight's bytes an element (1 for
    fp8), which the byte-based rules count; tile widths are in elements, as measured in bf16 (not retuned for fp8)."""
    block_m = triton.next_power_of_2(m)
    k_cap = max(16, triton.next_power_of_2(k))
    # Two rows of a wide layer (N > 2048) take the tensor-core path: in whole decode steps at batch 2 (`nanoserve
    # bench latency --batch-size 2`, 2026-11-24) it took Qwen3-0.6B from 1.23 to 1.12-1.17 ms a step on an H100 and
    # 1.12 to 0.97 on an H200, and Llama-3.1-8B from 6.29 to 6.07 and 4.78 to 4.48, where the CUDA-core path's two
    # rows hold half the weight bytes in flight that one row does (cuBLAS in its place gained about half as much).
    # One row of a weight of 32 MB or more (Llama-3.1-8B's qkv_proj and o_proj) takes it too, with the prologue
    # left to its own kernel (tensor_cores_at): whole batch-1 decode on an H200 went 4.555 -> 4.505 ms a token, and
    # stayed at 6.01 on an H100; with the prologue fused in, the tensor-core path was slower (4.72-4.76).
    # An fp8 weight stays on the CUDA cores at one row whatever its size: Llama-3.1-8B's fp8 down_proj (59 MB) took
    # 77.8 us on the tensor-core path and 33.6 on the CUDA cores (H200, c14782a, CUDA graphs, weights past L2).
    small_one_row = block_m == 1 and (elem_size == 1 or n * k * elem_size < TENSOR_CORES_FROM_BYTES_AT_ONE_ROW)
    narrow_two_rows = block_m == 2 and n <= 2048
    if small_one_row or narrow_two_rows or (block_m <= 8 and n < 2048):
        # CUDA-core path. Its weight loads go to registers, so memory latency is hidden only by many resident
        # programs: slabs of 2-8 rows give 512+ programs at M = 1 (about 4 per SM). The accumulator holds
        # BLOCK_M x BLOCK_N x BLOCK_K fp32 values, so wider M takes narrower slabs.
        block_n = max(2, min(_pow2_floor(n // (512 * block_m)), 8 // block_m))
        # Two-row slabs (small N, or M >= 4) stream the longest K stretch, up to 1024, that keeps the accumulator
        # within 64 registers a thread; wider slabs measured best at 512 (1024 was 5-20% slower at K = 1024).
        block_k = min(1024, 8192 // (block_m * block_n)) if block_n == 2 else 512
        if block_m == 1 and block_n == 2 and k >= 3072:
            # A long two-row slab at M = 1 (Qwen3-0.6B's down_proj) is three or more tiles, only two of them
            # loaded before the PDL wait: four rows in 1024-wide tiles halve the programs and measured 1.0 us
            # a layer faster in the chained batch-1 GEMVs on an H100 (20.5 vs 21.6 us; probe at 275aa23).
            block_n, block_k = 4, 1024
        return _Config(False, block_m, block_n, min(block_k, k_cap), 4, 1)
    # Tensor-core path for M >= 3 (M >= 9 at small N): M FMAs per weight element would make the CUDA-core
    # path compute bound (an H200 has about 67 fp32 TFLOP/s against 4.8 TB/s): at N >= 4096 it measured
    # 1.3-1.7x slower than this one at M = 4 and 2.2-2.6x at M = 8. Below N = 2048 the CUDA-core path
    # stays up to M = 8, since 16-row slabs would give under 128 programs. tl.dot needs every tile dim
    # >= 16, so M is padded to 16 (free: the weight stream dominates). Its loads are asynchronous copies
    # pipelined over 4 stages (32 KB each for a 64 x 256 bf16 tile), so a few programs per SM already keep
    # the memory busy: 64-row slabs measured best wherever that still gives 64+ programs, 16-row ones below.
    # M = 17-32 pads to 32 rows with the same slabs: in whole Qwen3-0.6B decode steps on an H100 this beat cuBLAS
    # by 2.8 % at 24 rows and 1.0 % at 32, and lost at 48 (probe at 275aa23).
    block_n = max(16, min(64, _pow2_floor(n // 64)))
    # fp32 tiles are twice the bytes (4 stages would need 320 KB): two fit in the 227 KB of shared memory. An fp8
    # weight's tile is half a bf16 one's, so 4 stages fit beside x's tile at any activation dtype.
    return _Config(True, max(16, block_m), block_n, min(256, k_cap), 4, 4 if elem_size <= 2 else 2)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg: _Config, *,
            norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor | None] | None = None,
            norm_offset: float = 0.0, silu_mul: bool = False, activation: str = "silu",
            late_dependents: bool = False, weight_scale: torch.Tensor | None = None) -> None:
    """One launch of the kernel; `norm` = (residual, norm weight, eps, residual out) adds the RMSNorm prologue
    (scaling by norm_offset + weight), `silu_mul` the act-and-mul one (x then holds [gate | up], 2K columns;
    activation "silu" or "gelu_tanh"). late_dependents: see skinny_norm_linear. weight_scale: an fp8 weight's
    per-row scales (module docstring)."""
    m = x.shape[0]
    n, k = weight.shape
    residual, norm_weight, eps, residual_out = norm if norm is not None else (None, None, 0.0, None)
    pdl = use_pdl(x)
    _skinny_linear_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        residual_out if residual_out is not None else x, weight, weight_scale if weight_scale is not None else weight,
        bias if bias is not None else weight, out, m, n, k,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0), eps,
        NORM=norm is not None, HAS_RESIDUAL=residual is not None, NORM_OFFSET=float(norm_offset), SILU_MUL=silu_mul,
        ACTIVATION=activation, HAS_BIAS=bias is not None, W_SCALED=weight_scale is not None,
        USE_DOT=cfg.use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32 would lose bits
        EVEN_K=k % cfg.block_k == 0, USE_PDL=pdl, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        LATE_DEPENDENTS=late_dependents and not cfg.use_dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=pdl)


def _check(x: torch.Tensor, k: int, weight: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Validates the GEMM operands (x holding K = k columns per row, or 2k for SiLU-and-mul; an fp8 weight with
    its per-row scales); returns out, allocated if None."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D [M, K] with a contiguous last dim, got shape {tuple(x.shape)}")
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x has {m} rows; skinny_linear handles 1..{MAX_M} (use F.linear above that)")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [N, {k}] with a contiguous last dim, got shape {tuple(weight.shape)}")
    n = weight.shape[0]
    if weight_scale is None and weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    if weight_scale is not None:
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight dtype {weight.dtype}: a weight with weight_scale must be float8_e4m3fn")
        if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
            raise ValueError(f"weight_scale must be contiguous fp32 of shape ({n},), got {weight_scale.dtype} "
                             f"{tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous of shape ({n},), got {tuple(bias.shape)}")
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be [{m}, {n}] of {x.dtype} with a contiguous last dim, got {tuple(out.shape)}")
    return out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype, accumulated in fp32, for 1 <= M <= MAX_M.
    weight_scale [N] (fp32): weight is float8_e4m3fn and row n stands for weight[n] * weight_scale[n].

    Inputs need a contiguous last dimension; out, if given, is written in place and returned.
    """
    out = _check(x, x.shape[-1], weight, bias, out, weight_scale)
    m, k = x.shape
    _launch(x, weight, bias, out, _config(m, weight.shape[0], k, weight.element_size()), weight_scale=weight_scale)
    return out


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, late_dependents: bool = False, weight_offset: float = 0.0,
                       weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x + residual) @ weight.T (+ bias) in one launch, and x + residual: the next residual, in a new
    tensor (`residual` is left as it is). Without a residual, RMSNorm(x) @ weight.T and x itself. weight_offset:
    the norm scales by weight_offset + norm_weight (Gemma: 1.0; kernels/rms_norm.py). weight_scale: an fp8 weight's
    per-row scales, as in skinny_linear.

    late_dependents (CUDA-core path only): under PDL the next kernel's programs start once this kernel's have
    streamed their weight, not as soon as they pass their wait. The CUDA-core path hides memory latency with many
    resident programs, and a next kernel with heavy programs that start early and wait beside them takes that
    room: Qwen3-0.6B's batch-1 qkv GEMV followed by decode_rope_attention measured 0.961 -> 0.901 ms a token
    with it, against 0.922 for the unfused pair (H200; on an H100 1.024 -> 0.989 against the pair).
    Where the next kernel waits for weights of its own (a GEMV) it costs more than it gains: every batch-1 GEMV
    with it, 0.945-0.952 -> 0.971-0.983 (H200).

    Rounds as kernels/rms_norm.py followed by skinny_linear does (the sum and the normalized row to x's
    dtype), so the two paths agree but for the order of the fp32 sum of squares.
    """
    k = x.shape[-1]
    out = _check(x, k, weight, bias, out, weight_scale)
    m = x.shape[0]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous of shape ({k},), got {tuple(norm_weight.shape)}")
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype:
            raise ValueError(f"residual must be [{m}, {k}] of {x.dtype} with a contiguous last dim, "
                             f"got {tuple(residual.shape)}")
        residual_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, _config(m, weight.shape[0], k, weight.element_size()),
            norm=(residual, norm_weight, eps, residual_out), norm_offset=weight_offset, late_dependents=late_dependents,
            weight_scale=weight_scale)
    return out, residual_out if residual_out is not None else x


def skinny_silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, activation: str = "silu",
                           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """(SiLU(gate) * up) @ weight.T (+ bias) in one launch, for x = [gate | up] of shape [M, 2K] and weight [N, K];
    rounds the product to x's dtype first, as kernels/activation.py does. activation "gelu_tanh": Gemma's GELU
    in SiLU's place. weight_scale: an fp8 weight's per-row scales, as in skinny_linear."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [M, 2K] (gate | up), got shape {tuple(x.shape)}")
    m, k = x.shape[0], x.shape[1] // 2
    out = _check(x, k, weight, bias, out, weight_scale)
    _launch(x, weight, bias, out, _config(m, weight.shape[0], k, weight.element_size()), silu_mul=True,
            activation=activation, weight_scale=weight_scale)
    return out


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch version of skinny_linear, in fp32 (an fp8 weight dequantized: weight * weight_scale[:, None])."""
    w = weight.float() if weight_scale is None else weight.float() * weight_scale.float()[:, None]
    res = x.float() @ w.T
    if bias is not None:
        res += bias.float()
    res = res.to(x.dtype)
    if out is None:
        return res
    return out.copy_(res)


def skinny_norm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, bias: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, weight_offset: float = 0.0,
                           weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation: the add+RMSNorm reference, then skinny_linear_ref."""
    if residual is None:
        normed = rms_norm_ref(x, norm_weight, eps, weight_offset=weight_offset).to(x.dtype)
        return skinny_linear_ref(normed, weight, bias, out, weight_scale), x
    residual = residual.clone()  # rms_norm_ref writes x + residual into it
    normed = rms_norm_ref(x, norm_weight, eps, residual, weight_offset).to(x.dtype)
    return skinny_linear_ref(normed, weight, bias, out, weight_scale), residual


def skinny_silu_mul_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               out: torch.Tensor | None = None, activation: str = "silu",
                               weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The unfused computation: the act-and-mul reference, then skinny_linear_ref."""
    return skinny_linear_ref(act_and_mul_ref(x, activation), weight, bias, out, weight_scale)
