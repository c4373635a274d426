"""The (token, expert) pairs of a mixture-of-experts layer sorted by expert into blocks of BLOCK_M rows, on the device.

Pair p = t * top_k + j is token t's j-th choice, topk_ids[t, j]. Each local expert's pairs take consecutive rows,
its run padded up to a multiple of BLOCK_M, so that every block of the grouped GEMMs (kernels/fused_moe.py) is one
expert's weight times up to BLOCK_M gathered rows. Pairs routed to experts outside [expert_start, expert_start + E)
(other ranks' under expert parallelism) go in no block.

No host sync and fixed-size outputs (sized from T, top_k, E and BLOCK_M alone), so a decode step captured in a CUDA
graph replays correctly for any routing. The order of pairs within an expert's run is not fixed (atomics hand out
the rows); each row's GEMM result does not depend on its neighbours, so the layer's output does not either.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

# Up to this many pairs (decode, small prefills) one program does everything in one launch, where three launches
# would cost more than the work; above it the counting and scattering are spread over programs of CHUNK pairs.
ONE_PROGRAM_MAX_PAIRS = 4096
CHUNK = 1024
# Blocks whose expert the layout kernel resolves at a time ([BLOCKS_AT_ONCE, E] comparisons).
BLOCKS_AT_ONCE = 128


@dataclass
class MoeAlignment:
    """sorted_ids [max_rows]: the pair in each row, num_pairs (T * top_k) marking padding and unused rows.
    block_expert [max_blocks]: each block's local expert, -1 past the used rows.
    rows_used [1]: the rows that blocks cover (a multiple of block_m), on the device."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    rows_used: torch.Tensor
    block_m: int
    num_pairs: int


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows any routing can need: every pair, plus up to block_m - 1 padding rows for each expert that
    has a pair (at most min(E, num_pairs) of them)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@triton.jit
def _local_experts(ids_ptr, offs, num_pairs, expert_start, num_experts):
    """Local expert ids of pairs offs, and which of them are this rank's pairs."""
    valid = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int32) - expert_start
    return e, valid & (e >= 0) & (e < num_experts)


@triton.jit
def _write_layout(counts, cursor_ptr, block_expert_ptr, rows_used_ptr, max_blocks, BLOCK_M: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr):
    """From the pairs per expert: each expert's first row (into cursor, where the scatter's atomics hand out rows
    from), the rows used, and each block's expert."""
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    # Written by atomics, as the scatter's atomics then read it: in one program, no store may linger unseen by them.
    tl.atomic_xchg(cursor_ptr + tl.arange(0, E_PAD), ends - padded)
    tl.store(rows_used_ptr, total)
    for b0 in range(0, max_blocks, BLOCKS_AT_ONCE):
        blocks = b0 + tl.arange(0, BLOCKS_AT_ONCE)
        first_row = blocks * BLOCK_M
        # A block's expert is the number of experts whose run ends at or before its first row.
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first_row < total, expert, -1), mask=blocks < max_blocks)


@triton.jit
def _scatter(sorted_ptr, cursor_ptr, offs, e, local):
    row = tl.atomic_add(cursor_ptr + e, 1, mask=local)
    tl.store(sorted_ptr + row, offs, mask=local)


@triton.jit
def _align_one_program_kernel(ids_ptr, sorted_ptr, block_expert_ptr, rows_used_ptr, cursor_ptr, num_pairs,
                              expert_start, num_experts, max_rows, max_blocks, BLOCK_M: tl.constexpr,
                              E_PAD: tl.constexpr, PAIRS: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr,
                              USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    offs = tl.arange(0, PAIRS)
    e, local = _local_experts(ids_ptr, offs, num_pairs, expert_start, num_experts)
    counts = tl.histogram(tl.where(local, e, 0), E_PAD, mask=local)
    _write_layout(counts, cursor_ptr, block_expert_ptr, rows_used_ptr, max_blocks, BLOCK_M, E_PAD, BLOCKS_AT_ONCE)
    for r0 in range(0, max_rows, PAIRS):
        tl.store(sorted_ptr + r0 + offs, num_pairs, mask=r0 + offs < max_rows)
    # The cursor and the padding are written by other threads of this program: both before any scatter.
    tl.debug_barrier()
    _scatter(sorted_ptr, cursor_ptr, offs, e, local)


@triton.jit
def _count_kernel(ids_ptr, sorted_ptr, counts_ptr, num_pairs, expert_start, num_experts, max_rows,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program i adds chunk i's pairs to counts (zeroed before) and marks rows of chunk i as padding (the grid
    covers max_rows; the scatter, a later launch, overwrites the rows that get a pair)."""
    wait_for_prior_grids(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(sorted_ptr + offs, num_pairs, mask=offs < max_rows)
    e, local = _local_experts(ids_ptr, offs, num_pairs, expert_start, num_experts)
    counts = tl.histogram(tl.where(local, e, 0), E_PAD, mask=local)
    tl.atomic_add(counts_ptr + tl.arange(0, E_PAD), counts, mask=counts > 0)


@triton.jit
def _layout_kernel(counts_ptr, block_expert_ptr, rows_used_ptr, cursor_ptr, max_blocks, BLOCK_M: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCKS_AT_ONCE: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    counts = tl.load(counts_ptr + tl.arange(0, E_PAD))
    _write_layout(counts, cursor_ptr, block_expert_ptr, rows_used_ptr, max_blocks, BLOCK_M, E_PAD, BLOCKS_AT_ONCE)


@triton.jit
def _scatter_kernel(ids_ptr, sorted_ptr, cursor_ptr, num_pairs, expert_start, num_experts, CHUNK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e, local = _local_experts(ids_ptr, offs, num_pairs, expert_start, num_experts)
    _scatter(sorted_ptr, cursor_ptr, offs, e, local)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         expert_start: int = 0) -> MoeAlignment:
    """Sorts the pairs of topk_ids [T, top_k] (int32 or int64, global expert ids) by local expert into blocks of
    block_m rows, for this rank's experts [expert_start, expert_start + num_experts)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    rows = max_rows(num_pairs, num_experts, block_m)
    blocks = triton.cdiv(rows, block_m)
    device = ids.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    rows_used = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    cursor = torch.empty(e_pad, dtype=torch.int32, device=device)
    pdl = use_pdl(ids)
    if num_pairs <= ONE_PROGRAM_MAX_PAIRS:
        pairs = max(16, triton.next_power_of_2(num_pairs))
        _align_one_program_kernel[(1,)](ids, sorted_ids, block_expert, rows_used, cursor, num_pairs, expert_start,
                                        num_experts, rows, blocks, BLOCK_M=block_m, E_PAD=e_pad, PAIRS=pairs,
                                        BLOCKS_AT_ONCE=BLOCKS_AT_ONCE, USE_PDL=pdl,
                                        num_warps=4 if pairs <= 1024 else 8, launch_pdl=pdl)
    else:
        counts = torch.zeros(e_pad, dtype=torch.int32, device=device)
        _count_kernel[(triton.cdiv(rows, CHUNK),)](ids, sorted_ids, counts, num_pairs, expert_start, num_experts,
                                                   rows, E_PAD=e_pad, CHUNK=CHUNK, USE_PDL=pdl, num_warps=4,
                                                   launch_pdl=pdl)
        _layout_kernel[(1,)](counts, block_expert, rows_used, cursor, blocks, BLOCK_M=block_m, E_PAD=e_pad,
                             BLOCKS_AT_ONCE=BLOCKS_AT_ONCE, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
        _scatter_kernel[(triton.cdiv(num_pairs, CHUNK),)](ids, sorted_ids, cursor, num_pairs, expert_start,
                                                          num_experts, CHUNK=CHUNK, USE_PDL=pdl, num_warps=4,
                                                          launch_pdl=pdl)
    return MoeAlignment(sorted_ids, block_expert, rows_used, block_m, num_pairs)


def moe_align_block_size_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                             expert_start: int = 0) -> tuple[list[list[int]], int]:
    """Plain PyTorch (host) statement of the layout: each local expert's pairs in id order, and the rows used."""
    local = topk_ids.reshape(-1).long().cpu() - expert_start
    runs = [(local == e).nonzero().flatten().tolist() for e in range(num_experts)]
    return runs, sum(-(-len(r) // block_m) * block_m for r in runs)
