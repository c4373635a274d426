"""The routed experts of a decode step of a token or two as two GEMVs (kernels/fused_moe.py's semantics, fewer
launches): moe_gemv.

At a handful of (token, expert) pairs the grouped GEMMs of fused_moe pay for machinery decode does not need: the
alignment launch sorts pairs into 16-row blocks that each hold one real row, the tensor cores multiply those mostly
empty blocks, and a third launch sums the top-k outputs. Here a pair's expert id is read straight from topk_ids (at
one token its k distinct experts are the blocks), and each weight byte is streamed once by the CUDA cores in wide,
coalesced tiles, as the dense models' batch-1 GEMV (kernels/gemv.py) does:
1. gate/up: a program owns BLOCK_N rows of gate and the matching rows of up of one pair's expert, walks them along
   the hidden size and writes act(gate + bias, up + bias), rounded to x's dtype, into [T * top_k, I];
2. down: a program owns BLOCK_N output columns of one token and walks the same rows of all its k experts at once
   (a [k, BLOCK_N, BLOCK_K] tile), so that the routing weights and the sum over top_k happen in its registers. The
   sum needs no atomics and no third launch, and its order is fixed: a step's output does not depend on which
   program ran first (the engine's bf16 tests compare tokens of two runs).
Pairs routed to other ranks' experts (expert parallelism) are skipped: their gate/up programs return at once and
down masks their rows, so their weights are never read. No host sync and buffers sized from the shapes alone, so a
decode step captured in a CUDA graph replays for any routing.

Under PDL (kernels/pdl.py) down loads its first weight tiles before its wait, so that its stream starts while gate/up's
last programs drain, not after. Which tiles depends on the expert ids, which the router wrote, and pdl.py's rule lets
nothing before the wait read what an earlier kernel wrote. The router is two launches back, though: down's programs
start only once every gate/up program has passed its own wait, that is once the router has finished and its writes
are visible GPU-wide, so the ids are final; they are read through L2, the point of coherence. The activations (gate/
up's output) are read after the wait as the rule says. DOWN_WEIGHTS_BEFORE_WAIT = False puts every load after it.

MXFP4 weights (w13_scale and w2_scale given; kernels/mxfp4_unpack.py's layout) are walked as bytes: each tile of
BLOCK_K columns is BLOCK_K / 2 bytes a row, unpacked in registers, its low nibbles multiplied by the activations' even
columns and its high nibbles by the odd ones. FP8 weights (float8_e4m3fn w13 and w2 with fp32 scales per row or per
weight_block; kernels/fp8_experts.py's layout) are walked a byte an element, weight-only: each tile converted in
registers and multiplied by the activations as they are (not quantized: a W8A8 checkpoint runs W8A16 here), its
products scaled per block of scales once a tile (the walk's tiles narrowed to lie within a block's columns), or per
row once after the walk. W4 weights (int32 w13 and w2, eight 4-bit values along K an int32, fp32 scales per row or
per group and uint8 zero points if asymmetric; kernels/w4_experts.py's layout) are walked an int32 at a time,
weight-only: each tile unpacked in registers into (q - z) times its group's scale (the walk's tiles narrowed to lie
within a group), multiplied by the activations as they are; per-row scales once after the walk. Its tiles hold as
many values as a 16-bit walk's, a quarter of the bytes (untuned).

Which path a step takes is decided by its size alone (takes_gemv): up to MAX_PAIRS pairs. The GEMVs read one expert
slab per pair where the grouped GEMMs read one per distinct expert, so tokens that share an expert read it twice;
programs of the same rows of different pairs are adjacent in the grid, so such a second read is mostly an L2 hit.
16 pairs is batch 1-2 on Qwen3-30B-A3B (top 8 of 128), where two tokens share under one expert on average.
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fp8_experts import FP8, scale_operand, widest_tile
from nanoserve.kernels.fused_moe import check_moe_args
from nanoserve.kernels.moe_reference import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from nanoserve.kernels.mxfp4_unpack import load_bytes, unpack_mxfp4
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids
from nanoserve.kernels.w4_unpack import unpack_w4_pairs, unpack_w4_rows, zero_points

MAX_PAIRS = 16
# Weight elements a program holds per step of its walk: gemv.py's one-row tile ([8, 512], 8 KB in bf16), which with
# two more tiles loaded ahead of it keeps about 24 KB in flight per program at 4 warps.
TILE_ELEMENTS = 4096
NUM_WARPS = 4
# Down's first weight tiles load before its PDL wait, while gate/up's last programs still run (the docstring has why
# that is safe); False: after it, as pdl.py's rule has every kernel.
DOWN_WEIGHTS_BEFORE_WAIT = True
_OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)
_OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)


def takes_gemv(num_tokens: int, top_k: int) -> bool:
    """Whether a step of num_tokens tokens runs its experts as moe_gemv (else fused_moe's grouped GEMMs)."""
    return 0 < num_tokens * top_k <= MAX_PAIRS


@triton.jit
def _load(ptrs, k, K, offs_k, row_mask, ROW_MASK: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The tile at column k of a walk whose first tile is at ptrs, reading only the rows of row_mask if ROW_MASK.
    Past the end, the last tile again (a cache hit, instead of a predicate on every column) when the tiles divide
    K; masked otherwise."""
    if EVEN_K:
        if ROW_MASK:
            tile = tl.load(ptrs + tl.minimum(k, K - BLOCK_K), mask=row_mask, other=0.0)
        else:
            tile = tl.load(ptrs + tl.minimum(k, K - BLOCK_K))
    else:
        in_k = (k + offs_k) < K
        if ROW_MASK:
            in_k = in_k & row_mask
        tile = tl.load(ptrs + k, mask=in_k, other=0.0)
    return tile


@triton.jit
def _x_cols(x_row, norm_w_ptr, cols, in_k, rstd, NORM: tl.constexpr):
    """x's columns cols (zeros off in_k), in fp32; NORM: of RMSNorm(x), rounded where the standalone RMSNorm
    (kernels/rms_norm.py) rounds: the normalized row, then its output."""
    x = tl.load(x_row + cols, mask=in_k, other=0.0)
    if NORM:
        norm_w = tl.load(norm_w_ptr + cols, mask=in_k, other=0.0).to(tl.float32)
        x = ((x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * norm_w).to(x.dtype)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["expert_start"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    norm_w_ptr,
    ids_ptr,
    out_ptr,
    num_pairs,
    top_k,
    expert_start,
    num_experts,
    N,
    K,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_op,
    eps,
    NORM: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr,
    FP8: tl.constexpr,
    W4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair, n] = act(x[t] @ w[e, n] + b[e, n], x[t] @ w[e, N + n] + b[e, N + n]) for N = I, e = pair's expert.
    Program pid: pair pid % num_pairs, rows (pid // num_pairs) * BLOCK_N on (pairs vary fastest, so the programs
    of two tokens that share an expert read its rows together). NORM: x[t] is RMSNorm(x[t]) with weight norm_w.
    MXFP4: w holds the bytes and s_ptr the scales, strides in bytes of each. FP8: w holds fp8 values and s_ptr their
    fp32 scales, one per SCALE_N rows and SCALE_K columns (0: per row; a BLOCK_K tile lies within one block). W4: w
    holds int32s of eight 4-bit values along K, s_ptr their scales as FP8's (SCALE_N 1, SCALE_K the group) and z_ptr
    their zero points in the scales' layout (HAS_ZEROS; else 8)."""
    pid = tl.program_id(0)
    pair = pid % num_pairs
    wait_for_prior_grids(USE_PDL)  # the expert ids are the router's output
    expert = tl.load(ids_ptr + pair).to(tl.int32) - expert_start
    if (expert < 0) | (expert >= num_experts):
        return  # another rank's expert: its row of out stays unwritten, and down skips it
    offs_n = (pid // num_pairs) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The walk is over weight elements: K values, or (MXFP4) their K / 2 bytes, or (W4) their K / 8 int32s, BLOCK_W
    # a tile.
    BLOCK_W: tl.constexpr = BLOCK_K // 8 if W4 else (BLOCK_K // 2 if MXFP4 else BLOCK_K)
    KW = K // 8 if W4 else (K // 2 if MXFP4 else K)
    offs_k = tl.arange(0, BLOCK_W)
    # Rows past N read the last row again instead of being masked; the store drops them.
    rows = tl.minimum(offs_n, N - 1)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + N * stride_wn
    if FP8 or W4:  # a scale per row of the tile; up's rows of blocks follow gate's
        gate_s = expert.to(tl.int64) * stride_se + (rows // SCALE_N) * stride_sn
    else:
        gate_s = expert.to(tl.int64) * stride_se + rows[:, None] * stride_sn + offs_k[None, :] // 16
    gate_s_ptrs = s_ptr + gate_s
    up_s_ptrs = gate_s_ptrs + tl.cdiv(N, SCALE_N) * stride_sn
    gate_z_ptrs = z_ptr + gate_s  # (W4 with zeros only: their layout is the scales')
    up_z_ptrs = gate_z_ptrs + N * stride_sn
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    cols = offs_k[None, :]
    # Two steps of both tiles in flight ahead of the one multiplied (registers, not the compiler's pipeline: these
    # are not tl.dot operands), as gemv.py's CUDA-core path keeps them.
    gate = _load(gate_ptrs, 0, KW, cols, cols, False, BLOCK_W, EVEN_K)
    up = _load(up_ptrs, 0, KW, cols, cols, False, BLOCK_W, EVEN_K)
    gate_ahead = _load(gate_ptrs, BLOCK_W, KW, cols, cols, False, BLOCK_W, EVEN_K)
    up_ahead = _load(up_ptrs, BLOCK_W, KW, cols, cols, False, BLOCK_W, EVEN_K)
    if NORM:
        # Prologue RMSNorm while those tiles load: every program walks its token's row once for the rms (a few KB,
        # from L2 after the first), then normalizes each slice as it uses it.
        sum_sq = tl.zeros([BLOCK_W], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_W):
            r = tl.load(x_row + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
            sum_sq += r * r
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
    else:
        rstd = 1.0
    # The K reduction waits until after the walk: reducing each tile would cost a cross-warp exchange per step.
    # (W4: a tile's int32s unpack into BLOCK_K columns.)
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K if W4 else BLOCK_W], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K if W4 else BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw0 = k0 // 8 if W4 else (k0 // 2 if MXFP4 else k0)
        gate_next = _load(gate_ptrs, kw0 + 2 * BLOCK_W, KW, cols, cols, False, BLOCK_W, EVEN_K)
        up_next = _load(up_ptrs, kw0 + 2 * BLOCK_W, KW, cols, cols, False, BLOCK_W, EVEN_K)
        if MXFP4:  # byte j of the tile: columns k0 + 2j (its low nibble) and k0 + 2j + 1
            x_cols = k0 + 2 * offs_k
            in_k = x_cols < K
            x_even = _x_cols(x_row, norm_w_ptr, x_cols, in_k, rstd, NORM)[None, :]
            x_odd = _x_cols(x_row, norm_w_ptr, x_cols + 1, in_k, rstd, NORM)[None, :]
            gate_lo, gate_hi = unpack_mxfp4(gate, load_bytes(gate_s_ptrs + kw0 // 16, in_k[None, :], not EVEN_K))
            up_lo, up_hi = unpack_mxfp4(up, load_bytes(up_s_ptrs + kw0 // 16, in_k[None, :], not EVEN_K))
            acc_gate += gate_lo * x_even + gate_hi * x_odd
            acc_up += up_lo * x_even + up_hi * x_odd
        elif W4:  # int32 j of a row's tile: columns k0 + 8j .. k0 + 8j + 7
            x_cols = k0 + tl.arange(0, BLOCK_K)
            x = _x_cols(x_row, norm_w_ptr, x_cols, x_cols < K, rstd, NORM)[None, :]
            group = (k0 // SCALE_K) * stride_sk if SCALE_K > 0 else 0
            w_gate = unpack_w4_rows(gate, zero_points(gate_z_ptrs + group, HAS_ZEROS))
            w_up = unpack_w4_rows(up, zero_points(up_z_ptrs + group, HAS_ZEROS))
            if SCALE_K > 0:  # this tile's group
                w_gate *= tl.load(gate_s_ptrs + group)[:, None]
                w_up *= tl.load(up_s_ptrs + group)[:, None]
            acc_gate += w_gate * x
            acc_up += w_up * x
        elif FP8 and SCALE_K > 0:  # this tile's block of scales, a scale per row
            x = _x_cols(x_row, norm_w_ptr, k0 + offs_k, k0 + offs_k < K, rstd, NORM)[None, :]
            k_block = (k0 // SCALE_K) * stride_sk
            acc_gate += gate.to(tl.float32) * tl.load(gate_s_ptrs + k_block)[:, None] * x
            acc_up += up.to(tl.float32) * tl.load(up_s_ptrs + k_block)[:, None] * x
        else:
            x = _x_cols(x_row, norm_w_ptr, k0 + offs_k, k0 + offs_k < K, rstd, NORM)[None, :]
            acc_gate += gate.to(tl.float32) * x
            acc_up += up.to(tl.float32) * x
        gate, gate_ahead = gate_ahead, gate_next
        up, up_ahead = up_ahead, up_next
    g = tl.sum(acc_gate, axis=1)
    u = tl.sum(acc_up, axis=1)
    if (FP8 or W4) and SCALE_K == 0:
        g *= tl.load(gate_s_ptrs)
        u *= tl.load(up_s_ptrs)
    if HAS_BIAS:
        b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + rows
        g += tl.load(b_ptrs).to(tl.float32)
        u += tl.load(b_ptrs + N).to(tl.float32)
    if ACTIVATION == "silu":
        h = g * tl.sigmoid(g) * u
    else:  # swigluoai, as moe_reference.moe_activation
        g = tl.minimum(g, _OAI_LIMIT)
        u = tl.minimum(tl.maximum(u, -_OAI_LIMIT), _OAI_LIMIT)
        h = (u + 1) * g * tl.sigmoid(g * _OAI_ALPHA)
    tl.store(out_ptr + pair.to(tl.int64) * stride_op + offs_n, h.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit(do_not_specialize=["expert_start"])
def _down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    ids_ptr,
    topk_w_ptr,
    out_ptr,
    num_tokens,
    expert_start,
    num_experts,
    N,
    K,
    stride_hp,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_ot,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MXFP4: tl.constexpr,
    FP8: tl.constexpr,
    W4: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, n] = sum over j of topk_weight[t, j] * (h[t, j] @ w[e_j, n] + b[e_j, n]) for N = H, K = I, over this
    rank's experts. Program pid: token pid % num_tokens, columns (pid // num_tokens) * BLOCK_N on. MXFP4, FP8 and W4
    as in _gate_up_kernel."""
    pid = tl.program_id(0)
    t = pid % num_tokens
    offs_n = (pid // num_tokens) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, K_PAD)
    BLOCK_W: tl.constexpr = BLOCK_K // 8 if W4 else (BLOCK_K // 2 if MXFP4 else BLOCK_K)
    KW = K // 8 if W4 else (K // 2 if MXFP4 else K)
    offs_k = tl.arange(0, BLOCK_W)
    rows = tl.minimum(offs_n, N - 1)
    if not EARLY_WEIGHTS:
        wait_for_prior_grids(USE_PDL)
    pairs = t * TOP_K + offs_j
    # Read through L2 (.cg): with EARLY_WEIGHTS this is before the wait (the module docstring has why that is safe),
    # and an L1 line of an earlier kernel's tensor at the same address would be stale.
    expert = tl.load(ids_ptr + pairs, mask=offs_j < TOP_K, other=-1, cache_modifier=".cg").to(tl.int32)
    expert -= expert_start
    local = (offs_j < TOP_K) & (expert >= 0) & (expert < num_experts)
    # Other ranks' pairs read nothing: neither weights nor their rows of h, which gate/up never wrote.
    expert = tl.where(local, expert, 0).to(tl.int64)
    w_ptrs = (
        w_ptr + expert[:, None, None] * stride_we + rows[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :]
    )
    if FP8 or W4:  # [K_PAD, BLOCK_N]: a scale per row of each pair's tile
        s_off = expert[:, None] * stride_se + (rows // SCALE_N)[None, :].to(tl.int64) * stride_sn
        s_ptrs = s_ptr + s_off
        z_ptrs = z_ptr + s_off  # (W4 with zeros only: their layout is the scales')
    else:
        s_ptrs = (
            s_ptr + expert[:, None, None] * stride_se + rows[None, :, None].to(tl.int64) * stride_sn
            + offs_k[None, None, :] // 16
        )
    w_mask = local[:, None, None]
    w = _load(w_ptrs, 0, KW, offs_k[None, None, :], w_mask, True, BLOCK_W, EVEN_K)
    w_ahead = _load(w_ptrs, BLOCK_W, KW, offs_k[None, None, :], w_mask, True, BLOCK_W, EVEN_K)
    if EARLY_WEIGHTS:
        wait_for_prior_grids(USE_PDL)  # h is gate/up's output
    routing = tl.load(topk_w_ptr + pairs, mask=local, other=0.0).to(tl.float32)
    # W4: h's columns read whole, BLOCK_K of them for a tile's int32s.
    offs_h = tl.arange(0, BLOCK_K) if W4 else offs_k * (2 if MXFP4 else 1)
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * stride_hp + offs_h[None, :]
    acc = tl.zeros([K_PAD, BLOCK_N, BLOCK_K if W4 else BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw0 = k0 // 8 if W4 else (k0 // 2 if MXFP4 else k0)
        w_next = _load(w_ptrs, kw0 + 2 * BLOCK_W, KW, offs_k[None, None, :], w_mask, True, BLOCK_W, EVEN_K)
        if W4:
            h_mask = local[:, None] & (k0 + offs_h < K)[None, :]
        else:
            h_mask = local[:, None] & (kw0 + offs_k < KW)[None, :]
        h = tl.load(h_ptrs + k0, mask=h_mask, other=0.0).to(tl.float32)
        if W4:
            group = (k0 // SCALE_K) * stride_sk if SCALE_K > 0 else 0
            w4 = unpack_w4_pairs(w, zero_points(z_ptrs + group, HAS_ZEROS))
            if SCALE_K > 0:
                w4 *= tl.load(s_ptrs + group)[:, :, None]
            acc += w4 * h[:, None, :]
        elif MXFP4:  # h above is the even columns, matching the low nibbles
            h_odd = tl.load(h_ptrs + k0 + 1, mask=h_mask, other=0.0).to(tl.float32)
            w_lo, w_hi = unpack_mxfp4(w, tl.load(s_ptrs + kw0 // 16, mask=h_mask[:, None, :], other=0))
            acc += w_lo * h[:, None, :] + w_hi * h_odd[:, None, :]
        elif FP8 and SCALE_K > 0:
            acc += w.to(tl.float32) * tl.load(s_ptrs + (k0 // SCALE_K) * stride_sk)[:, :, None] * h[:, None, :]
        else:
            acc += w.to(tl.float32) * h[:, None, :]
        w, w_ahead = w_ahead, w_next
    y = tl.sum(acc, axis=2)
    if (FP8 or W4) and SCALE_K == 0:
        y *= tl.load(s_ptrs)
    if HAS_BIAS:
        y += tl.load(b_ptr + expert[:, None] * stride_be + rows[None, :], mask=local[:, None], other=0.0).to(tl.float32)
    out = tl.sum(y * routing[:, None], axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _walk(k: int, rows_per_step: int, widest: int = 512) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for a walk along k of rows_per_step rows per output row: tiles up to `widest` (a power of
    two, up to 512) wide, the widest of 512, 256 and 128 that divides k (no masked tail), and as many rows as fill
    TILE_ELEMENTS."""
    block_k = next((b for b in (512, 256, 128) if b <= widest and k % b == 0),
                   min(widest, max(16, triton.next_power_of_2(k))))
    return max(1, TILE_ELEMENTS // (rows_per_step * block_k)), block_k


def moe_gemv_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_bias: torch.Tensor | None,
    topk_ids: torch.Tensor,
    expert_start: int,
    activation: str,
    norm: tuple[torch.Tensor, float] | None = None,
    w13_scale: torch.Tensor | None = None,
    weight_block: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step 1: act(gate, up) of every pair, [T * top_k, I] indexed by pair (rows of other ranks' pairs unwritten).
    norm = (weight, eps): of RMSNorm(x) instead of x. w13_scale: w13 is MXFP4 (mxfp4_unpack.py's layout), FP8
    (fp8_experts.py's, per weight_block or per row) or W4 (int32; w4_experts.py's, w13_zeros if asymmetric)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    scale, stride_se, stride_sn, stride_sk, scale_n, scale_k = scale_operand(w13, w13_scale, weight_block)
    num_pairs = topk_ids.numel()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k = _walk(hidden, 2, widest_tile(weight_block, 512))
    block_n = min(block_n, triton.next_power_of_2(inter))
    pdl = use_pdl(x)
    _gate_up_kernel[(num_pairs * triton.cdiv(inter, block_n),)](
        x,
        w13,
        scale,
        w13_zeros if w13_zeros is not None else w13,
        w13_bias if w13_bias is not None else w13,
        norm[0] if norm is not None else x,
        topk_ids.reshape(-1),
        h,
        num_pairs,
        num_pairs // num_tokens,
        expert_start,
        num_experts,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        stride_se,
        stride_sn,
        stride_sk,
        w13_bias.stride(0) if w13_bias is not None else 0,
        h.stride(0),
        norm[1] if norm is not None else 0.0,
        NORM=norm is not None,
        ACTIVATION=activation,
        HAS_BIAS=w13_bias is not None,
        MXFP4=w13.dtype == torch.uint8,
        FP8=w13.dtype == FP8,
        W4=w13.dtype == torch.int32,
        HAS_ZEROS=w13_zeros is not None,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        EVEN_K=hidden % block_k == 0,
        USE_PDL=pdl,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
        launch_pdl=pdl,
    )
    return h


def moe_gemv_down(
    h: torch.Tensor,
    w2: torch.Tensor,
    w2_bias: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_start: int,
    after_gate_up: bool = False,
    w2_scale: torch.Tensor | None = None,
    weight_block: tuple[int, int] | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step 2: [T, H], each token's pairs of experts [expert_start, + E) times their routing weights, summed.
    after_gate_up: launched right after moe_gemv_gate_up on the same contiguous topk_ids (no kernel between), which
    lets its weights load before its PDL wait (DOWN_WEIGHTS_BEFORE_WAIT; the module docstring has why). w2_scale: w2
    is MXFP4, FP8 or W4 (w2_zeros), as in moe_gemv_gate_up."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape[0], w2.shape[1], h.shape[1]
    scale, stride_se, stride_sn, stride_sk, scale_n, scale_k = scale_operand(w2, w2_scale, weight_block)
    out = torch.empty(num_tokens, hidden, dtype=h.dtype, device=h.device)
    k_pad = triton.next_power_of_2(top_k)
    block_n, block_k = _walk(inter, k_pad, widest_tile(weight_block, 512))
    block_n = min(block_n, triton.next_power_of_2(hidden))
    pdl = use_pdl(h)
    _down_kernel[(num_tokens * triton.cdiv(hidden, block_n),)](
        h,
        w2,
        scale,
        w2_zeros if w2_zeros is not None else w2,
        w2_bias if w2_bias is not None else w2,
        topk_ids.reshape(-1),
        topk_weights.reshape(-1),
        out,
        num_tokens,
        expert_start,
        num_experts,
        hidden,
        inter,
        h.stride(0),
        w2.stride(0),
        w2.stride(1),
        stride_se,
        stride_sn,
        stride_sk,
        w2_bias.stride(0) if w2_bias is not None else 0,
        out.stride(0),
        TOP_K=top_k,
        K_PAD=k_pad,
        HAS_BIAS=w2_bias is not None,
        MXFP4=w2.dtype == torch.uint8,
        FP8=w2.dtype == FP8,
        W4=w2.dtype == torch.int32,
        HAS_ZEROS=w2_zeros is not None,
        SCALE_N=scale_n,
        SCALE_K=scale_k,
        EVEN_K=inter % block_k == 0,
        USE_PDL=pdl,
        EARLY_WEIGHTS=pdl and after_gate_up and DOWN_WEIGHTS_BEFORE_WAIT,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=NUM_WARPS,
        launch_pdl=pdl,
    )
    return out


def moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_start: int = 0,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    norm: tuple[torch.Tensor, float] | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    weight_block: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """fused_moe for steps of up to MAX_PAIRS (token, expert) pairs, in two launches: x [T, H] -> [T, H], as
    moe_reference.fused_moe_ref (fp32 accumulation, the intermediate rounded to x's dtype; the top-k outputs
    summed in fp32 before the one rounding).

    norm = (weight [H], eps): the experts of RMSNorm(x) with that weight, normalized inside the gate/up launch (the
    decoder layer's norm before its MoE block, whose own launch would cost as much as a tenth of the layer's experts
    at batch 1), rounded as kernels/rms_norm.py rounds.

    w13_scale, w2_scale: the weights are MXFP4, w13 and w2 their packed bytes, FP8 (float8_e4m3fn w13 and w2,
    scales per weight_block or per row) or W4 (int32 w13 and w2, w13_zeros and w2_zeros if asymmetric), as in
    fused_moe."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, w13_scale, w2_scale,
                   weight_block, w13_zeros, w2_zeros)
    if norm is not None and (norm[0].shape != (x.shape[1],) or not norm[0].is_contiguous()):
        raise ValueError(f"norm weight must be contiguous of shape ({x.shape[1]},), got {tuple(norm[0].shape)}")
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k > MAX_PAIRS:
        raise ValueError(f"moe_gemv takes up to {MAX_PAIRS} (token, expert) pairs, got {num_tokens} x {top_k}")
    if num_tokens == 0:
        return torch.empty_like(x)
    # Made contiguous up front, so that no copy kernel runs between the two launches (down reads the ids before its
    # PDL wait: they must come from before gate/up).
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    h = moe_gemv_gate_up(x, w13, w13_bias, topk_ids, expert_start, activation, norm, w13_scale, weight_block,
                         w13_zeros)
    return moe_gemv_down(h, w2, w2_bias, topk_weights, topk_ids, expert_start, after_gate_up=True, w2_scale=w2_scale,
                         weight_block=weight_block, w2_zeros=w2_zeros)
