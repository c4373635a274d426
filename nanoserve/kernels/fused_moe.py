"""The experts of a mixture-of-experts layer on the GPU: fused_moe, with the semantics of kernels/moe_reference.py.

Four steps, none of which syncs with the host, on buffers whose sizes follow from the shapes alone (so a decode step
captured in a CUDA graph replays for any routing):
1. kernels/moe_align.py sorts the (token, expert) pairs by local expert into blocks of BLOCK_M rows;
2. one grouped-GEMM launch for gate/up: each program multiplies one block's gathered token rows by matching gate and
   up tiles of the block's expert and writes act(gate + bias, up + bias) into a [T * top_k, I] intermediate;
3. one grouped-GEMM launch for down: (h @ w2[e].T + bias) * routing weight into [T, top_k, H];
4. the sum over top_k, skipping the pairs of other ranks' experts (their rows are never written).
Only blocks of experts that some token chose exist, so a decode step reads only those experts' weights. The grids are
sized for the most blocks any routing can need; programs past the rows used return at once.

The weights are in x's dtype, or MXFP4 (w13_scale and w2_scale given; kernels/mxfp4_unpack.py's layout): each weight
tile is then loaded as bytes, unpacked to x's dtype in registers, and multiplied on the tensor cores in two halves
(the low nibbles by x's even columns, the high by its odd ones). Or FP8 (float8_e4m3fn w13 and w2 with their fp32
scales, per row or per weight_block; kernels/fp8_experts.py's layout), weight-only: each fp8 tile (a byte an element)
is converted to x's dtype in registers and multiplied by x as it is, not quantized (a W8A8 checkpoint runs W8A16
here); the products are scaled per row after the reduction, or per block of scales once per tile. Or W4 (int32 w13
and w2: eight 4-bit values along K an int32, with fp32 scales per row or per group and uint8 zero points if
asymmetric; kernels/w4_experts.py's layout), weight-only: each tile's int32s unpacked in registers into (q - z),
exact in x's dtype, multiplied on the tensor cores and scaled per group once per tile (or per row after the loop).

Tile sizes come from a table measured by scripts/tune_fused_moe.py (fused_moe_configs/, one file per shape and
device), else from the default rule in default_config.
"""

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from nanoserve.kernels.fp8_experts import FP8, check_fp8_experts, scale_operand, widest_tile
from nanoserve.kernels.moe_align import MoeAlignment, moe_align_block_size
from nanoserve.kernels.moe_reference import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from nanoserve.kernels.mxfp4_unpack import load_mxfp4
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids
from nanoserve.kernels.w4_experts import check_w4_experts
from nanoserve.kernels.w4_unpack import unpack_w4_k_major, zero_points

CONFIG_DIR = Path(__file__).with_name("fused_moe_configs")
ACTIVATIONS = ("silu", "swigluoai")
# Kernels read module globals only as constexprs.
_OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)
_OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and launch options of one grouped GEMM (N: output columns, K: the reduction)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    """block_m is shared by both GEMMs: it is the alignment's block size."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "gate_up": asdict(self.gate_up), "down": asdict(self.down)}

    @staticmethod
    def from_json(d: dict) -> "MoeConfig":
        return MoeConfig(d["block_m"], GemmConfig(**d["gate_up"]), GemmConfig(**d["down"]))


def config_file(num_experts: int, hidden: int, inter: int, device_name: str) -> Path:
    """Where the measured table for this shape and device lives (written by scripts/tune_fused_moe.py)."""
    return CONFIG_DIR / f"E={num_experts},H={hidden},I={inter},device={device_name.replace(' ', '_')}.json"


@functools.lru_cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.lru_cache
def _tuned_table(path: Path) -> tuple[tuple[int, MoeConfig], ...] | None:
    if not path.is_file():
        return None
    table = json.loads(path.read_text())["configs"]
    return tuple((int(m), MoeConfig.from_json(c)) for m, c in table.items())


def default_config(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                   elem_size: int = 2) -> MoeConfig:
    """The rule for shapes and devices without a measured table (a guess, not measured): 16-row blocks while an
    expert averages at most 16 rows (decode: the GEMMs stream weights, so narrow tiles give more programs), 64-row
    blocks with wider tiles and grouped ordering beyond that (prefill: compute bound, operands reused from L2).
    4-byte dtypes get half the pipeline stages, so that their tiles fit in shared memory."""
    def fit(block: int, size: int) -> int:  # no wider than the dimension (small models, the CPU tests)
        return min(block, max(16, triton.next_power_of_2(size)))

    if num_tokens * top_k <= 16 * num_experts:
        stages = 4 if elem_size <= 2 else 2
        return MoeConfig(16, GemmConfig(fit(32, inter), fit(128, hidden), 1, 4, stages),
                         GemmConfig(fit(64, hidden), fit(128, inter), 1, 4, stages))
    stages = 3 if elem_size <= 2 else 2
    return MoeConfig(64, GemmConfig(fit(128, inter), fit(64, hidden), 8, 8, stages),
                     GemmConfig(fit(128, hidden), fit(64, inter), 8, 4, stages))


def nearest_config(table: tuple[tuple[int, MoeConfig], ...], num_tokens: int) -> MoeConfig:
    """The config of the tuned token count nearest num_tokens (the lower one on a tie)."""
    return min(table, key=lambda mc: (abs(mc[0] - num_tokens), mc[0]))[1]


def get_config(num_tokens: int, w13: torch.Tensor, top_k: int, act_size: int = 2) -> MoeConfig:
    """The measured config for the tuned M nearest num_tokens, where a table matches the shape and device (2-byte
    dtypes on CUDA; fp32 tiles would need twice the shared memory they were tuned with); else default_config. An
    MXFP4 w13 (uint8, two values a byte), an FP8 one or a W4 one (int32, eight values) takes default_config's rule for
    activations of act_size bytes (not tuned for them)."""
    num_experts, two_inter, hidden = w13.shape
    if w13.dtype == torch.uint8:
        return default_config(num_tokens, num_experts, 2 * hidden, two_inter // 2, top_k, act_size)
    if w13.dtype == torch.int32:
        return default_config(num_tokens, num_experts, 8 * hidden, two_inter // 2, top_k, act_size)
    if w13.dtype == FP8:
        return default_config(num_tokens, num_experts, hidden, two_inter // 2, top_k, act_size)
    if w13.is_cuda and w13.element_size() == 2:
        index = w13.device.index if w13.device.index is not None else torch.cuda.current_device()
        table = _tuned_table(config_file(num_experts, hidden, two_inter // 2, _device_name(index)))
        if table:
            return nearest_config(table, num_tokens)
    return default_config(num_tokens, num_experts, hidden, two_inter // 2, top_k, w13.element_size())


@triton.jit
def _block_tile(num_blocks, n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (block, column tile), in groups of GROUP_M blocks that walk the column tiles together
    (neighbouring programs share weight tiles of an expert through L2)."""
    num_pid_n = tl.cdiv(n, BLOCK_N)
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """The pairs in this block's rows, which of them are real (not padding), and a valid pair in each row (padding
    rows compute on pair 0's row instead of predicating every load; the store drops them)."""
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pair < num_pairs
    return pair, real, tl.where(real, pair, 0)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, rows_used_ptr,
                    num_pairs, num_blocks, top_k, N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                    stride_sk, stride_be, stride_op, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                    MXFP4: tl.constexpr, FP8: tl.constexpr, W4: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, EVEN_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[pair, n] = act(x[token] @ w[e, n].T + b[e, n], x[token] @ w[e, N + n].T + b[e, N + n]) for N = I.
    MXFP4: w holds the bytes and s_ptr the scales (mxfp4_unpack.py's layout), strides in bytes of each. FP8: w holds
    fp8 values and s_ptr their fp32 scales, one per SCALE_N rows and SCALE_K columns (0: per row; fp8_experts.py's
    layout; a BLOCK_K tile lies within one block of columns). W4: w holds int32s of eight 4-bit values along K,
    s_ptr their fp32 scales as FP8's (blocks of one row and a group of columns, or per row) and z_ptr their zero
    points in the scales' layout (HAS_ZEROS; else 8; w4_experts.py's layout)."""
    wait_for_prior_grids(USE_PDL)
    pid_m, pid_n = _block_tile(num_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair, real, row_pair = _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # MXFP4: a tile of BLOCK_K columns is BLOCK_K / 2 bytes a row, and x's columns are read as even and odd halves.
    # W4: BLOCK_K / 8 int32s a row, x's columns read whole.
    BLOCK_W: tl.constexpr = BLOCK_K // 8 if W4 else (BLOCK_K // 2 if MXFP4 else BLOCK_K)
    offs_k = tl.arange(0, BLOCK_W)
    offs_x = tl.arange(0, BLOCK_K) if W4 else offs_k * (2 if MXFP4 else 1)
    x_ptrs = x_ptr + (row_pair // top_k).to(tl.int64)[:, None] * stride_xt + offs_x[None, :]
    # Tail columns read the last weight row again rather than being masked; the store drops them.
    w_rows = tl.minimum(offs_n, N - 1)
    gate_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_wn
    if FP8 or W4:  # a scale per column of the tile (its row of w); up's rows of blocks follow gate's
        gate_s = expert * stride_se + (w_rows // SCALE_N)[None, :] * stride_sn
    else:
        gate_s = expert * stride_se + w_rows[None, :] * stride_sn + offs_k[:, None] // 16
    gate_s_ptrs = s_ptr + gate_s
    up_s_ptrs = gate_s_ptrs + tl.cdiv(N, SCALE_N) * stride_sn
    gate_z_ptrs = z_ptr + gate_s  # (W4 with zeros only: their layout is the scales')
    up_z_ptrs = gate_z_ptrs + N * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if MXFP4:
            j_ok = k0 // 2 + offs_k < K // 2
            x_even = tl.load(x_ptrs, mask=j_ok[None, :], other=0.0)
            x_odd = tl.load(x_ptrs + 1, mask=j_ok[None, :], other=0.0)
            gate_lo, gate_hi = load_mxfp4(gate_ptrs, gate_s_ptrs, j_ok[:, None], not EVEN_K)
            up_lo, up_hi = load_mxfp4(up_ptrs, up_s_ptrs, j_ok[:, None], not EVEN_K)
            gate = tl.dot(x_even, gate_lo.to(x_even.dtype), gate, input_precision=DOT_PRECISION)
            gate = tl.dot(x_odd, gate_hi.to(x_even.dtype), gate, input_precision=DOT_PRECISION)
            up = tl.dot(x_even, up_lo.to(x_even.dtype), up, input_precision=DOT_PRECISION)
            up = tl.dot(x_odd, up_hi.to(x_even.dtype), up, input_precision=DOT_PRECISION)
            gate_ptrs += BLOCK_K // 2
            up_ptrs += BLOCK_K // 2
            gate_s_ptrs += BLOCK_K // 32
            up_s_ptrs += BLOCK_K // 32
        elif W4:
            if EVEN_K:
                x = tl.load(x_ptrs)
                p_gate = tl.load(gate_ptrs)
                p_up = tl.load(up_ptrs)
            else:  # (K is whole int32s: a masked int32 is all columns past K, where x reads as zeros)
                x = tl.load(x_ptrs, mask=(k0 + offs_x < K)[None, :], other=0.0)
                p_ok = k0 // 8 + offs_k < K // 8
                p_gate = tl.load(gate_ptrs, mask=p_ok[:, None], other=0)
                p_up = tl.load(up_ptrs, mask=p_ok[:, None], other=0)
            group = (k0 // SCALE_K) * stride_sk if SCALE_K > 0 else 0
            w_gate = unpack_w4_k_major(p_gate, zero_points(gate_z_ptrs + group, HAS_ZEROS))
            w_up = unpack_w4_k_major(p_up, zero_points(up_z_ptrs + group, HAS_ZEROS))
            # q - z is an integer in -16..15, exact in x's dtype.
            if SCALE_K > 0:  # this tile's group
                gate += tl.dot(x, w_gate.to(x.dtype), input_precision=DOT_PRECISION) * tl.load(gate_s_ptrs + group)
                up += tl.dot(x, w_up.to(x.dtype), input_precision=DOT_PRECISION) * tl.load(up_s_ptrs + group)
            else:
                gate = tl.dot(x, w_gate.to(x.dtype), gate, input_precision=DOT_PRECISION)
                up = tl.dot(x, w_up.to(x.dtype), up, input_precision=DOT_PRECISION)
            gate_ptrs += BLOCK_K // 8
            up_ptrs += BLOCK_K // 8
        else:
            if EVEN_K:
                x = tl.load(x_ptrs)
                w_gate = tl.load(gate_ptrs)
                w_up = tl.load(up_ptrs)
            else:
                k_ok = k0 + offs_k < K
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                w_gate = tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0)
                w_up = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
            if FP8 and SCALE_K > 0:  # this tile's block of scales
                k_block = (k0 // SCALE_K) * stride_sk
                gate += tl.dot(x, w_gate.to(x.dtype), input_precision=DOT_PRECISION) * tl.load(gate_s_ptrs + k_block)
                up += tl.dot(x, w_up.to(x.dtype), input_precision=DOT_PRECISION) * tl.load(up_s_ptrs + k_block)
            else:  # (an fp8 tile converted to x's dtype, exactly; its per-row scales applied after the loop)
                gate = tl.dot(x, w_gate.to(x.dtype), gate, input_precision=DOT_PRECISION)
                up = tl.dot(x, w_up.to(x.dtype), up, input_precision=DOT_PRECISION)
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if (FP8 or W4) and SCALE_K == 0:
        gate *= tl.load(gate_s_ptrs)
        up *= tl.load(up_s_ptrs)
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * stride_be + w_rows
        gate += tl.load(b_ptrs).to(tl.float32)[None, :]
        up += tl.load(b_ptrs + N).to(tl.float32)[None, :]
    if ACTIVATION == "silu":
        h = gate * tl.sigmoid(gate) * up
    else:  # swigluoai, as moe_reference.moe_activation
        gate = tl.minimum(gate, _OAI_LIMIT)
        up = tl.minimum(tl.maximum(up, -_OAI_LIMIT), _OAI_LIMIT)
        h = (up + 1) * gate * tl.sigmoid(gate * _OAI_ALPHA)
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_op + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=real[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_kernel(h_ptr, w_ptr, s_ptr, z_ptr, b_ptr, topk_w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
                 rows_used_ptr, num_pairs, num_blocks, N, K, stride_hp, stride_we, stride_wn, stride_se, stride_sn,
                 stride_sk, stride_be, stride_op, HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, FP8: tl.constexpr,
                 W4: tl.constexpr, HAS_ZEROS: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """out[pair, n] = (h[pair] @ w[e, n].T + b[e, n]) * topk_weight[pair], for N = H and K = I; MXFP4, FP8 and W4
    as in _gate_up_kernel."""
    wait_for_prior_grids(USE_PDL)
    pid_m, pid_n = _block_tile(num_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair, real, row_pair = _block_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    BLOCK_W: tl.constexpr = BLOCK_K // 8 if W4 else (BLOCK_K // 2 if MXFP4 else BLOCK_K)
    offs_k = tl.arange(0, BLOCK_W)
    offs_x = tl.arange(0, BLOCK_K) if W4 else offs_k * (2 if MXFP4 else 1)
    h_ptrs = h_ptr + row_pair.to(tl.int64)[:, None] * stride_hp + offs_x[None, :]
    w_rows = tl.minimum(offs_n, N - 1)
    w_ptrs = w_ptr + expert * stride_we + w_rows[None, :] * stride_wn + offs_k[:, None]
    if FP8 or W4:
        s_off = expert * stride_se + (w_rows // SCALE_N)[None, :] * stride_sn
    else:
        s_off = expert * stride_se + w_rows[None, :] * stride_sn + offs_k[:, None] // 16
    s_ptrs = s_ptr + s_off
    z_ptrs = z_ptr + s_off
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if MXFP4:
            j_ok = k0 // 2 + offs_k < K // 2
            h_even = tl.load(h_ptrs, mask=j_ok[None, :], other=0.0)
            h_odd = tl.load(h_ptrs + 1, mask=j_ok[None, :], other=0.0)
            w_lo, w_hi = load_mxfp4(w_ptrs, s_ptrs, j_ok[:, None], not EVEN_K)
            acc = tl.dot(h_even, w_lo.to(h_even.dtype), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(h_odd, w_hi.to(h_even.dtype), acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
        elif W4:
            if EVEN_K:
                h = tl.load(h_ptrs)
                packed = tl.load(w_ptrs)
            else:
                h = tl.load(h_ptrs, mask=(k0 + offs_x < K)[None, :], other=0.0)
                packed = tl.load(w_ptrs, mask=(k0 // 8 + offs_k < K // 8)[:, None], other=0)
            group = (k0 // SCALE_K) * stride_sk if SCALE_K > 0 else 0
            w = unpack_w4_k_major(packed, zero_points(z_ptrs + group, HAS_ZEROS))
            if SCALE_K > 0:
                acc += tl.dot(h, w.to(h.dtype), input_precision=DOT_PRECISION) * tl.load(s_ptrs + group)
            else:
                acc = tl.dot(h, w.to(h.dtype), acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K // 8
        else:
            if EVEN_K:
                h = tl.load(h_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = k0 + offs_k < K
                h = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if FP8 and SCALE_K > 0:
                acc += tl.dot(h, w.to(h.dtype), input_precision=DOT_PRECISION) * tl.load(
                    s_ptrs + (k0 // SCALE_K) * stride_sk)
            else:
                acc = tl.dot(h, w.to(h.dtype), acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    if (FP8 or W4) and SCALE_K == 0:
        acc *= tl.load(s_ptrs)
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + w_rows).to(tl.float32)[None, :]
    acc *= tl.load(topk_w_ptr + row_pair).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_op + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=real[:, None] & (offs_n < N)[None, :])


@triton.jit
def _sum_kernel(y_ptr, ids_ptr, out_ptr, H, top_k, expert_start, num_experts, BLOCK_H: tl.constexpr,
                USE_PDL: tl.constexpr):
    """out[t] = sum over j of y[t, j] in fp32, over this rank's experts only: rows of pairs routed elsewhere were
    never written (and may hold anything)."""
    wait_for_prior_grids(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(top_k):
        e = tl.load(ids_ptr + t * top_k + j).to(tl.int32) - expert_start
        # The row's length as the mask's bound, 0 for other ranks' pairs (one comparison, and the interpreter
        # mishandles a vector mask and-ed with a scalar one).
        row_len = tl.where((e >= 0) & (e < num_experts), H, 0)
        acc += tl.load(y_ptr + (t * top_k + j) * H + offs, mask=offs < row_len, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=in_row)


def _dot_precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # tf32 would lose fp32's bits; unused for 16-bit


def _block_k(cfg: GemmConfig, w: torch.Tensor, weight_block: tuple[int, int] | None) -> int:
    """An MXFP4 tile is at least one block of 32 columns (two tl.dot halves of at least 16); an FP8 tile lies within
    one block of scales, a W4 one within one group (and is at least 16 columns: whole int32s)."""
    if w.dtype == torch.uint8:
        return max(32, cfg.block_k)
    if w.dtype == torch.int32:
        return max(16, widest_tile(weight_block, cfg.block_k))
    return widest_tile(weight_block, cfg.block_k) if w.dtype == FP8 else cfg.block_k


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, w13_bias: torch.Tensor | None, align: MoeAlignment, top_k: int,
                activation: str, cfg: GemmConfig, w13_scale: torch.Tensor | None = None,
                weight_block: tuple[int, int] | None = None, w13_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """Step 2: act(gate, up) of every pair, [T * top_k, I] indexed by pair (rows of other ranks' pairs unwritten).
    w13_scale: w13 is MXFP4 (mxfp4_unpack.py's layout), FP8 (fp8_experts.py's, per weight_block or per row) or W4
    (int32; w4_experts.py's, with w13_zeros if asymmetric)."""
    inter, hidden = w13.shape[1] // 2, x.shape[1]
    out = torch.empty(align.num_pairs, inter, dtype=x.dtype, device=x.device)
    num_blocks = align.block_expert.numel()
    pdl = use_pdl(x)
    block_k = _block_k(cfg, w13, weight_block)
    scale, stride_se, stride_sn, stride_sk, scale_n, scale_k = scale_operand(w13, w13_scale, weight_block)
    grid = (num_blocks * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](
        x, w13, scale, w13_zeros if w13_zeros is not None else w13, w13_bias if w13_bias is not None else w13, out,
        align.sorted_ids, align.block_expert, align.rows_used, align.num_pairs, num_blocks, top_k, inter, hidden,
        x.stride(0), w13.stride(0),
        w13.stride(1), stride_se, stride_sn, stride_sk, w13_bias.stride(0) if w13_bias is not None else 0,
        out.stride(0), ACTIVATION=activation, HAS_BIAS=w13_bias is not None, MXFP4=w13.dtype == torch.uint8,
        FP8=w13.dtype == FP8, W4=w13.dtype == torch.int32, HAS_ZEROS=w13_zeros is not None, SCALE_N=scale_n,
        SCALE_K=scale_k, EVEN_K=hidden % block_k == 0,
        DOT_PRECISION=_dot_precision(x), USE_PDL=pdl, BLOCK_M=align.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out


def moe_down(h: torch.Tensor, w2: torch.Tensor, w2_bias: torch.Tensor | None, topk_weights: torch.Tensor,
             align: MoeAlignment, cfg: GemmConfig, w2_scale: torch.Tensor | None = None,
             weight_block: tuple[int, int] | None = None, w2_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """Step 3: each pair's expert output times its routing weight, [T * top_k, H] indexed by pair. w2_scale: w2 is
    MXFP4, FP8 or W4 (w2_zeros), as in moe_gate_up."""
    hidden, inter = w2.shape[1], h.shape[1]
    out = torch.empty(align.num_pairs, hidden, dtype=h.dtype, device=h.device)
    num_blocks = align.block_expert.numel()
    pdl = use_pdl(h)
    block_k = _block_k(cfg, w2, weight_block)
    scale, stride_se, stride_sn, stride_sk, scale_n, scale_k = scale_operand(w2, w2_scale, weight_block)
    grid = (num_blocks * triton.cdiv(hidden, cfg.block_n),)
    _down_kernel[grid](
        h, w2, scale, w2_zeros if w2_zeros is not None else w2, w2_bias if w2_bias is not None else w2,
        topk_weights.reshape(-1), out, align.sorted_ids, align.block_expert, align.rows_used, align.num_pairs,
        num_blocks, hidden, inter, h.stride(0), w2.stride(0),
        w2.stride(1), stride_se, stride_sn, stride_sk, w2_bias.stride(0) if w2_bias is not None else 0,
        out.stride(0), HAS_BIAS=w2_bias is not None, MXFP4=w2.dtype == torch.uint8, FP8=w2.dtype == FP8,
        W4=w2.dtype == torch.int32, HAS_ZEROS=w2_zeros is not None, SCALE_N=scale_n, SCALE_K=scale_k,
        EVEN_K=inter % block_k == 0,
        DOT_PRECISION=_dot_precision(h), USE_PDL=pdl, BLOCK_M=align.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out


def moe_sum(y: torch.Tensor, topk_ids: torch.Tensor, expert_start: int, num_experts: int) -> torch.Tensor:
    """Step 4: y [T * top_k, H] -> [T, H], summing each token's pairs of experts [expert_start, + num_experts)."""
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=y.dtype, device=y.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    pdl = use_pdl(y)
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](y, topk_ids.reshape(-1), out, hidden, top_k, expert_start,
                                                            num_experts, BLOCK_H=block_h, USE_PDL=pdl, num_warps=4,
                                                            launch_pdl=pdl)
    return out


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                   activation: str, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                   weight_block: tuple[int, int] | None = None, w13_zeros: torch.Tensor | None = None,
                   w2_zeros: torch.Tensor | None = None) -> None:
    """fused_moe's and moe_gemv's arguments, each wrong one named in a ValueError. With w13_scale and w2_scale, w13
    and w2 are FP8 (float8_e4m3fn; fp8_experts.py's layout, scales per weight_block or per row), W4 (int32;
    w4_experts.py's layout, weight_block (1, group_size) or per row, zeros if asymmetric) or MXFP4
    (mxfp4_unpack.py's layout), else in x's dtype."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} is not supported")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with a contiguous last dim, got shape {tuple(x.shape)}")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale and w2_scale: MXFP4 and FP8 weights need both (or neither)")
    fp8 = w13_scale is not None and w13.dtype == FP8
    w4 = w13_scale is not None and w13.dtype == torch.int32
    if weight_block is not None and not (fp8 or w4):
        raise ValueError("weight_block: only FP8 and W4 weights (float8_e4m3fn or int32 w13 and w2 with their "
                         "scales) take one")
    if (w13_zeros is not None or w2_zeros is not None) and not w4:
        raise ValueError("w13_zeros, w2_zeros: only W4 weights (int32 w13 and w2 with their scales) take them")
    num_tokens, hidden = x.shape
    if fp8:
        check_fp8_experts(hidden, w13, w2, w13_scale, w2_scale, weight_block)
        num_experts, inter = w13.shape[0], w13.shape[1] // 2
    elif w4:
        check_w4_experts(hidden, w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros, weight_block)
        num_experts, inter = w13.shape[0], w13.shape[1] // 2
    elif w13_scale is not None:
        _check_mxfp4_args(hidden, w13, w2, w13_scale, w2_scale)
        num_experts, inter = w13.shape[0], w13.shape[1] // 2
    else:
        if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2 or w13.stride(2) != 1:
            raise ValueError(f"w13 must be [E, 2I, {hidden}] with a contiguous last dim, got {tuple(w13.shape)}")
        num_experts, inter = w13.shape[0], w13.shape[1] // 2
        if w2.shape != (num_experts, hidden, inter) or w2.stride(2) != 1:
            raise ValueError(f"w2 must be [{num_experts}, {hidden}, {inter}] with a contiguous last dim, "
                             f"got {tuple(w2.shape)}")
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have x's dtype {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64 [{num_tokens}, top_k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)} as topk_ids, got {tuple(topk_weights.shape)}")
    for name, bias, shape in (("w13_bias", w13_bias, (num_experts, 2 * inter)), ("w2_bias", w2_bias,
                                                                                  (num_experts, hidden))):
        if bias is not None and (bias.shape != shape or bias.stride(1) != 1):
            raise ValueError(f"{name} must be {shape} with a contiguous last dim, got {tuple(bias.shape)}")


def _check_mxfp4_args(hidden: int, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                      w2_scale: torch.Tensor) -> None:
    """MXFP4 w13 [E, 2I, H / 2] and w2 [E, H, I / 2] (uint8, two values a byte) with their scales [E, 2I, H / 32]
    and [E, H, I / 32] (uint8 E8M0); H and I whole blocks of 32."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"w13 must be MXFP4 [E, 2I, {hidden // 2}], got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if hidden % 32 or inter % 32:
        raise ValueError(f"MXFP4 weights: the hidden size {hidden} and intermediate size {inter} must be multiples "
                         "of the 32-value block")
    for name, t, shape in (("w13", w13, (num_experts, 2 * inter, hidden // 2)),
                           ("w13_scale", w13_scale, (num_experts, 2 * inter, hidden // 32)),
                           ("w2", w2, (num_experts, hidden, inter // 2)),
                           ("w2_scale", w2_scale, (num_experts, hidden, inter // 32))):
        if t.dtype != torch.uint8 or tuple(t.shape) != shape or t.stride(2) != 1:
            raise ValueError(f"{name} must be MXFP4 uint8 {shape} with a contiguous last dim, got {t.dtype} "
                             f"{tuple(t.shape)}")


def fused_moe_with_config(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, config: MoeConfig, *, expert_start: int = 0,
                          w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                          activation: str = "silu", w13_scale: torch.Tensor | None = None,
                          w2_scale: torch.Tensor | None = None, weight_block: tuple[int, int] | None = None,
                          w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """fused_moe with the tile sizes given (scripts/tune_fused_moe.py times candidates through it)."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation, w13_scale, w2_scale,
                   weight_block, w13_zeros, w2_zeros)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    num_experts = w13.shape[0]
    align = moe_align_block_size(topk_ids, num_experts, config.block_m, expert_start)
    h = moe_gate_up(x, w13, w13_bias, align, topk_ids.shape[1], activation, config.gate_up, w13_scale, weight_block,
                    w13_zeros)
    y = moe_down(h, w2, w2_bias, topk_weights, align, config.down, w2_scale, weight_block, w2_zeros)
    return moe_sum(y, topk_ids, expert_start, num_experts)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, expert_start: int = 0, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: str = "silu", w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, weight_block: tuple[int, int] | None = None,
              w13_zeros: torch.Tensor | None = None, w2_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for each token t: x [T, H] -> [T, H], as
    moe_reference.fused_moe_ref, in Triton (fp32 accumulation; the intermediate rounded to x's dtype).

    w13_scale, w2_scale: the weights are MXFP4, w13 and w2 their packed bytes (kernels/mxfp4_unpack.py's layout),
    computing what fused_moe_ref computes on quantization/mxfp4.py's dequantize_mxfp4 of them in x's dtype. With
    float8_e4m3fn w13 and w2, FP8 weights (kernels/fp8_experts.py's layout; scales per weight_block = (rows, columns)
    or, without one, per row), weight-only: what fused_moe_ref computes on fp8_experts.dequantize_fp8_experts of
    them in fp32, x not quantized. With int32 w13 and w2, W4 weights (kernels/w4_experts.py's layout: eight 4-bit
    values an int32 along K, scales per weight_block = (1, group_size) or per row, w13_zeros and w2_zeros their
    zero points if asymmetric), weight-only: what fused_moe_ref computes on w4_experts.dequantize_w4_experts of them.

    Tile sizes: the measured table fused_moe_configs/E=..,H=..,I=..,device=<name>.json (scripts/tune_fused_moe.py)
    for this shape and GPU at the tuned token count nearest T, for 16-bit dtypes; otherwise default_config's rule.
    Kernels launch with PDL where the device supports it (kernels/pdl.py).
    """
    config = get_config(x.shape[0], w13, topk_ids.shape[-1], x.element_size())
    return fused_moe_with_config(x, w13, w2, topk_weights, topk_ids, config, expert_start=expert_start,
                                 w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, w13_scale=w13_scale,
                                 w2_scale=w2_scale, weight_block=weight_block, w13_zeros=w13_zeros, w2_zeros=w2_zeros)
