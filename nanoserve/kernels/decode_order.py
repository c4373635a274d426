"""The order in which decode attention dispatches its sequences: longest first, ties in batch order.

Each sequence's rank is the number of sequences that go before it (longer, or as long and earlier in the batch),
counted by comparing every pair: at decode batch sizes (hundreds) that is a few thousand comparisons a program
in one launch, where torch.sort took a radix sort of ~18 us a step inside the decode graph (H200, batch 256).
"""

import torch
import triton
import triton.language as tl

from nanoserve.kernels.pdl import use_pdl, wait_for_prior_grids

_BLOCK_I = 64
_BLOCK_J = 64


@triton.jit
def _longest_first_kernel(seq_lens_ptr, order_ptr, n, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                          USE_PDL: tl.constexpr):
    wait_for_prior_grids(USE_PDL)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_valid = i < n
    len_i = tl.load(seq_lens_ptr + i, mask=i_valid, other=0)
    rank = tl.zeros([BLOCK_I], tl.int32)
    for j0 in range(0, n, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        # Past n, -1 is shorter than any length (>= 0), so it never goes before a sequence.
        len_j = tl.load(seq_lens_ptr + j, mask=j < n, other=-1)
        before = (len_j[None, :] > len_i[:, None]) | ((len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i.to(order_ptr.dtype.element_ty), mask=i_valid)


def longest_first_order(seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write into out [n] (int32 or int64) the permutation of 0..n-1 that sorts seq_lens [n] (int32, >= 0)
    longest first, stably (as torch.sort(descending=True, stable=True) orders it); returns out. Allocates
    nothing and reads nothing on the host, so a CUDA graph can capture it."""
    n = seq_lens.shape[0]
    assert seq_lens.dim() == 1 and seq_lens.is_contiguous() and out.shape == (n,) and out.is_contiguous()
    assert out.dtype in (torch.int32, torch.int64), "out must be int32 or int64"
    if n:
        pdl = use_pdl(seq_lens)
        _longest_first_kernel[(triton.cdiv(n, _BLOCK_I),)](seq_lens, out, n, BLOCK_I=_BLOCK_I, BLOCK_J=_BLOCK_J,
                                                          USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
    return out


def longest_first_order_ref(seq_lens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(torch.sort(seq_lens, descending=True, stable=True).indices)
    return out
