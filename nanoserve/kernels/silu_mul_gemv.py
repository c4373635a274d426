"""One row of SiLU-and-mul (or Gemma's tanh-GELU-and-mul), then a projection too large for the skinny GEMM
(Llama-3.1-8B's down_proj, 117 MB).

At batch 1 such a weight went to cuBLAS, after SiLU-and-mul as a kernel of its own, and cuBLAS then reduced its
K splits in a second kernel. Here one launch streams the weight: each program owns 16-row blocks and walks them in
512-wide tiles, two tiles in flight ahead of the one it multiplies (the first two loaded before the PDL wait, since
no kernel writes weights), applying SiLU-and-mul to each slice of the row as it uses it. The grid is at most two
programs an SM; a program with several row blocks walks them as one flattened loop over (row block, tile), so its
stream does not drain between blocks.

Measured on an H200 (`nanoserve bench latency --model .../llama-3.1-8b`, 2026-11-24, A/B copies of the tree):
4.444-4.459 ms a token with cuBLAS, 4.273-4.278 with this kernel's first version (probe at 275aa23)
(128 programs of 32 rows: 4.343); this file's version then ran 4.281-4.286 on another H200, and 5.806 on an H100
(5.951-5.979 with cuBLAS). The skinny GEMM's CUDA-core path with the same blocks was slower than cuBLAS in the
chained GEMVs (+2.75 us a layer, measured at c0ef833; probe at 275aa23) and in the whole model (4.607-4.611 ms),
and this kernel with the RMSNorm prologue on gate_up_proj lost to cuBLAS in the whole model (4.465-4.491 ms), so
gate_up stays on cuBLAS.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.activation import act_and_mul_ref, act_mul
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

BLOCK_N, BLOCK_K, NUM_WARPS, PROGRAMS_PER_SM = 16, 512, 8, 2
_ASSUMED_SMS = 4  # off CUDA (the interpreter): few programs, so that tests walk several row blocks each


@triton.jit
def _tile(w_ptr, t, pid, G, N, K, offs_n, offs_k, K_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Tile t of this program's walk: row block pid + (t // K_TILES) * G, K tile t % K_TILES. Rows past N read the
    last row again (dropped at the store); columns past K read zeros."""
    rows = tl.minimum((pid + (t // K_TILES) * G) * BLOCK_N + offs_n, N - 1)
    cols = (t % K_TILES) * BLOCK_K + offs_k
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :]
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(cols < K)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, x, w, t, pid, G, out_ptr, N, offs_n, K_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """acc plus the row slice x times weight tile t; at a row block's last tile its rows summed and stored, and acc
    zeroed for the next block."""
    acc += x.to(tl.float32)[None, :] * w.to(tl.float32)
    if t % K_TILES == K_TILES - 1:
        rows = (pid + (t // K_TILES) * G) * BLOCK_N + offs_n
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc


@triton.jit
def _silu_mul_gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, K_TILES: tl.constexpr, EVEN_K: tl.constexpr,
                          ACTIVATION: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    pid, G = tl.program_id(0), tl.num_programs(0)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, G) * K_TILES  # this program's tiles
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w = _tile(w_ptr, 0, pid, G, N, K, offs_n, offs_k, K_TILES, BLOCK_N, BLOCK_K, EVEN_K)
    w_ahead = _tile(w_ptr, tl.minimum(1, total - 1), pid, G, N, K, offs_n, offs_k, K_TILES, BLOCK_N, BLOCK_K,
                    EVEN_K)
    wait_for_prior_grids(USE_PDL)
    # The K reduction is deferred to the end of each row block: reducing every tile would cost a cross-warp
    # exchange and a barrier per tile.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for t in range(total):
        kt = t % K_TILES
        # Past the end, the last tile again: a cache hit, rather than a predicate on every load.
        w_next = _tile(w_ptr, tl.minimum(t + 2, total - 1), pid, G, N, K, offs_n, offs_k, K_TILES, BLOCK_N,
                       BLOCK_K, EVEN_K)
        cols = kt * BLOCK_K + offs_k
        in_k = cols < K
        gate = tl.load(x_ptr + cols, mask=in_k, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=in_k, other=0.0).to(tl.float32)
        x = act_mul(gate, up, ACTIVATION).to(x_ptr.dtype.element_ty)  # rounded as the standalone kernel rounds
        acc = _accumulate(acc, x, w, t, pid, G, out_ptr, N, offs_n, K_TILES, BLOCK_N, BLOCK_K)
        w = w_ahead
        w_ahead = w_next


def silu_mul_gemv(x: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """(SiLU(gate) * up) @ weight.T for one row x = [gate | up] of shape [1, 2K] and weight [N, K] -> [1, N], in x's
    dtype, accumulated in fp32; the product is rounded to x's dtype first, as kernels/activation.py rounds it.
    activation "gelu_tanh": Gemma's GELU in SiLU's place."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] % 2 or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, 2K] (gate | up), got shape {tuple(x.shape)}")
    k = x.shape[1] // 2
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, {k}], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    n = weight.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else _ASSUMED_SMS
    programs = min(triton.cdiv(n, BLOCK_N), PROGRAMS_PER_SM * sms)
    pdl = use_pdl(x)
    _silu_mul_gemv_kernel[(programs,)](x, weight, out, n, k, K_TILES=triton.cdiv(k, BLOCK_K),
                                       EVEN_K=k % BLOCK_K == 0, ACTIVATION=activation, USE_PDL=pdl,
                                       BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                       num_warps=NUM_WARPS, launch_pdl=pdl)
    return out


def silu_mul_gemv_ref(x: torch.Tensor, weight: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The unfused computation in fp32: act-and-mul rounded to x's dtype, then the projection."""
    return (act_and_mul_ref(x.float(), activation).to(x.dtype).float() @ weight.float().T).to(x.dtype)
