"""Scratch memory for prefill attention's key splits (prefill/attention.py): the programs of a split query
tile leave their partial results here until the last of them merges them into the output.

Allocated once by the caller (the CUDA-graph runner keeps one for all its buckets and layers, which run one at a
time), never inside a captured call. Triton-free, so it can be allocated on any install. Its heads are the
kernel's program heads: num_q_heads // pack, one per group of query heads that a program serves.
"""

from dataclasses import dataclass

import torch


@dataclass
class SplitScratch:
    # [max_partials, num_heads, block_m, head_dim]: each split's softmax-normalized output, fp32 by default; in
    # the inputs' 16-bit dtype it halves what a merge reads, for one more rounding of the output.
    out: torch.Tensor
    lse: torch.Tensor  # [max_partials, num_heads, block_m] fp32: log2 of its softmax sum (scores in log2 units)
    count: torch.Tensor  # [max_partials, num_heads] int32: splits of a tile finished; all zero between calls

    @property
    def max_partials(self) -> int:
        return self.count.shape[0]

    def check(self, num_heads: int, block_m: int, head_dim: int) -> None:
        """Assert the layout the kernel writes for this many program heads, query rows per tile and head_dim."""
        assert self.out.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert self.lse.dtype == torch.float32 and self.count.dtype == torch.int32
        assert self.out.is_contiguous() and self.lse.is_contiguous() and self.count.is_contiguous()
        assert self.out.shape[1:] == (num_heads, block_m, head_dim) and self.lse.shape[1:] == (num_heads, block_m)
        assert self.count.shape == (self.out.shape[0], num_heads) == self.lse.shape[:2]

    @staticmethod
    def allocate(
        max_partials: int,
        num_heads: int,
        block_m: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> "SplitScratch":
        return split_scratch_views([(max_partials, block_m)], num_heads, head_dim, device, dtype)[0]


def split_scratch_views(
    shapes: list[tuple[int, int]],
    num_heads: int,
    head_dim: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> list[SplitScratch]:
    """One SplitScratch per (max_partials, block_m) in shapes, all views of the same memory (sized for the
    largest), for callers that use one shape at a time. dtype: the partial outputs'."""
    rows = max(p * b for p, b in shapes)
    slots = max(p for p, _ in shapes)
    out = torch.empty(rows * num_heads * head_dim, dtype=dtype, device=device)
    lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
    # Zeroed once: the kernel leaves every counter it uses back at zero.
    count = torch.zeros(slots * num_heads, dtype=torch.int32, device=device)
    return [
        SplitScratch(
            out[: p * num_heads * b * head_dim].view(p, num_heads, b, head_dim),
            lse[: p * num_heads * b].view(p, num_heads, b),
            count[: p * num_heads].view(p, num_heads),
        )
        for p, b in shapes
    ]
