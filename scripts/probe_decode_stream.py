"""Stream-K decode attention for large decode batches, measured and not put in the engine: every program reads
the same number of key tiles.

Flash-decoding (nanoserve/kernels/decode_attention.py) gives each (sequence, kv head) its own program, so a batch of
contexts from 100 to 2,000 keys is a launch of programs from 2 to 32 tiles long, each filling its load pipeline
afresh, that ends with a tail of long ones. Here the tiles of all sequences form one list, in batch order
(plan_stream_tiles builds it on the device, once per step for every layer), and each of P programs per kv head
walks an equal slice of it. Reading the throughput recipe's K/V that way (no math) ran 4.40 TB/s on an H200
against 4.26 for one program per sequence; this kernel, with the math, did not beat decode_attention
(scripts/probe_read_bandwidth.py prints both; BENCHMARKS.md has the figures).

A sequence whose tiles fall in one program's slice is written out directly. One cut by a slice boundary is
finished by each program holding part of it as a partial (its output and log-sum-exp) in the program's scratch
slot (2p for the slice's first run of tiles, 2p + 1 for its last: a slice has at most two cut runs); each adds
its run's tile count to the (sequence, kv head) counter, and the one that completes the sequence's count merges
the partials. Empty sequences (CUDA-graph padding) get zeros.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoserve.kernels.decode_attention import LOG2E, attend_tile, load_kv_tile
from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

_PROGRAMS_PER_SM = 2  # 64-key K and V tiles in three stages: 96 KB of shared memory a program at head_dim 128
_TILE_BITS = 16  # a tile entry packs (sequence << 16) | tile index within the sequence


@dataclass
class StreamPlan:
    """One step's tile list (plan_stream_tiles) and the scratch every layer's launch shares."""

    tile_info: torch.Tensor  # [capacity] int32
    total: torch.Tensor  # [1] int32: tiles in the list
    counters: torch.Tensor  # [batch * kv heads] int32, zero between launches
    mid_o: torch.Tensor  # [2 * programs, kv heads, group, head_dim] fp32
    mid_lse: torch.Tensor  # [2 * programs, kv heads, group] fp32
    programs: int  # P, per kv head
    block_n: int  # keys a tile


def num_stream_programs(device: torch.device, num_kv_heads: int) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, sms * _PROGRAMS_PER_SM // num_kv_heads)


def make_stream_plan(batch: int, max_context: int, num_kv_heads: int, group: int, head_dim: int,
                     device: torch.device, programs: int | None = None, block_n: int = 64) -> StreamPlan:
    """Buffers for steps of up to `batch` decodes with contexts of up to max_context keys, in tiles of block_n."""
    assert batch < (1 << (31 - _TILE_BITS)) and triton.cdiv(max_context, block_n) <= (1 << _TILE_BITS)
    programs = programs or num_stream_programs(device, num_kv_heads)
    return StreamPlan(
        tile_info=torch.zeros(batch * triton.cdiv(max_context, block_n), dtype=torch.int32, device=device),
        total=torch.zeros(1, dtype=torch.int32, device=device),
        counters=torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device),
        mid_o=torch.empty(2 * programs, num_kv_heads, group, head_dim, dtype=torch.float32, device=device),
        mid_lse=torch.empty(2 * programs, num_kv_heads, group, dtype=torch.float32, device=device),
        programs=programs, block_n=block_n)


@triton.jit
def _plan_kernel(seq_lens_ptr, tile_info_ptr, total_ptr, batch, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                 TILE_BITS: tl.constexpr, CHUNK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    tiles = tl.cdiv(tl.load(seq_lens_ptr + offs, mask=offs < batch, other=0), BLOCK_N)
    first = tl.sum(tl.where(offs < b, tiles, 0))
    n = tl.sum(tl.where(offs == b, tiles, 0))
    for j0 in range(0, n, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        tl.store(tile_info_ptr + first + j, (b << TILE_BITS) | j, mask=j < n)
    if b == batch - 1:
        tl.store(total_ptr, first + n)


def plan_stream_tiles(seq_lens: torch.Tensor, plan: StreamPlan) -> None:
    """Fill plan.tile_info with every tile of every sequence, in batch order, and plan.total with their count."""
    batch = seq_lens.shape[0]
    assert 0 < batch and batch * plan.mid_o.shape[1] <= plan.counters.numel()
    _plan_kernel[(batch,)](seq_lens, plan.tile_info, plan.total, batch, BLOCK_B=triton.next_power_of_2(batch),
                           BLOCK_N=plan.block_n, TILE_BITS=_TILE_BITS, CHUNK=256)


@triton.jit
def _owner(t, num_tiles, P):
    """The program whose slice [p * T // P, (p + 1) * T // P) holds tile t."""
    return ((t + 1) * P - 1) // num_tiles


@triton.jit
def _merge(mid_o_ptr, mid_lse_ptr, out_ptr, seq, first_tile, seq_len, num_tiles, P, kv_head, num_kv_heads,
           group, stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """Merge the partials of a sequence cut across programs: each holder p's slot is 2p if the sequence is the
    first run of p's slice, else 2p + 1. Read through L2 (.cg): other SMs wrote them."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < group
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    last_tile = first_tile + tl.cdiv(seq_len, BLOCK_N) - 1
    for p in range(_owner(first_tile, num_tiles, P), _owner(last_tile, num_tiles, P) + 1):
        # Programs with an empty slice (more programs than tiles) in between hold nothing.
        start = (p * num_tiles) // P
        # (A head-count bound, not g_valid & scalar: the interpreter mis-types a splatted scalar bool.)
        held = offs_g < tl.where(start < ((p + 1) * num_tiles) // P, group, 0)
        slot = 2 * p + (start < first_tile).to(tl.int32)
        row = (slot * num_kv_heads + kv_head) * group + offs_g
        lse = tl.load(mid_lse_ptr + row, mask=held, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=held[:, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        l_i = l_i * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m_i = m_new
    heads = kv_head * group + offs_g
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=g_valid[:, None])


@triton.jit
def _stream_kernel(q_ptr, k_cache_ptr, v_cache_ptr, seq_lens_ptr, block_tables_ptr, tile_info_ptr, total_ptr,
                   counters_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, qk_scale, batch, stride_qb, stride_qh, stride_cb,
                   stride_ct, stride_ch, stride_bt, stride_ob, stride_oh, group,
                   DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, TILE_BITS: tl.constexpr,
                   STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    p = tl.program_id(0)
    P = tl.num_programs(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * group + offs_h
    h_valid = (offs_h < group)[:, None]
    num_tiles = tl.load(total_ptr)  # the plan kernel ran before the step's first layer
    first = (p * num_tiles) // P
    last = ((p + 1) * num_tiles) // P
    wait_for_prior_grids(USE_PDL)
    # Empty sequences have no tile: program p zeroes rows p, p + P, ...
    for b in range(p, batch, P):
        if tl.load(seq_lens_ptr + b) == 0:
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     tl.zeros([BLOCK_H, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty), mask=h_valid)

    # The slice is a few runs of one sequence's tiles each; a run's keys go through one pipelined loop.
    t = first
    while t < last:
        seq = tl.load(tile_info_ptr + t) >> TILE_BITS
        j = tl.load(tile_info_ptr + t) & ((1 << TILE_BITS) - 1)
        seq_len = tl.load(seq_lens_ptr + seq)
        seq_first_tile = t - j
        seq_tiles = tl.cdiv(seq_len, BLOCK_N)
        run_end = tl.minimum(last, seq_first_tile + seq_tiles)
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=h_valid,
                    other=0.0)
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for start_n in tl.range(j * BLOCK_N, (run_end - seq_first_tile) * BLOCK_N, BLOCK_N, num_stages=STAGES):
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start_n, seq_len, -1, stride_cb,
                                stride_ct, stride_ch, False, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
            m_i, l_i, acc = attend_tile(q, k, v, start_n, seq_len, m_i, l_i, acc, qk_scale, -1, None, None, False,
                                        DOT_PRECISION, BLOCK_N)
        o = acc / l_i[:, None]
        if (j == 0) & (run_end == seq_first_tile + seq_tiles):  # the whole sequence is in this slice
            tl.store(out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=h_valid)
        else:
            slot = 2 * p + (t != first).to(tl.int32)
            row = (slot * num_kv_heads + kv_head) * group + offs_h
            tl.store(mid_lse_ptr + row, m_i + tl.log2(l_i), mask=offs_h < group)
            tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=h_valid)
            # Release the partial before the counter and acquire the others' after it, as write_split in
            # decode_attention.py argues. Each holder adds its run's tiles: the one that completes the sequence's
            # count merges.
            tl.debug_barrier()
            run_tiles = run_end - t
            counter = counters_ptr + seq * num_kv_heads + kv_head
            done = tl.atomic_add(counter, run_tiles, sem="acq_rel", scope="gpu")
            if done + run_tiles == seq_tiles:
                tl.debug_barrier()
                tl.store(counter, 0)
                _merge(mid_o_ptr, mid_lse_ptr, out_ptr, seq, seq_first_tile, seq_len, num_tiles, P, kv_head,
                       num_kv_heads, group, stride_ob, stride_oh, HEAD_DIM, BLOCK_G, BLOCK_N)
        t = run_end


def decode_attention_stream(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float, plan: StreamPlan,
                            out: torch.Tensor | None = None, stages: int = 3, warps: int = 4) -> torch.Tensor:
    """decode_attention's result (q [B, Hq, D], one token per sequence at position seq_lens[b] - 1) through the
    tile list plan_stream_tiles(seq_lens, plan) built for this step; stages and warps: the launch's pipeline depth
    and warps a program."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert plan.counters.numel() >= batch * num_kv_heads and plan.mid_o.shape[1:] == (num_kv_heads, group, head_dim)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    pdl = use_pdl(out)
    _stream_kernel[(plan.programs, num_kv_heads)](
        q, k_cache, v_cache, seq_lens, block_tables, plan.tile_info, plan.total, plan.counters, plan.mid_o,
        plan.mid_lse, out, scale * LOG2E, batch, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), group,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_G=triton.next_power_of_2(group),
        BLOCK_N=plan.block_n, TILE_BITS=_TILE_BITS, STAGES=stages, USE_PDL=pdl, launch_pdl=pdl, num_warps=warps)
    return out
