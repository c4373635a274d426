"""Planning a flash-decoding launch, shared by decode_attention.py and decode_rope_attention.py: how many splits,
the grid, the partials' scratch, the tile sizes and options of the split kernel; and the reduce kernel's launch
where the split kernel leaves the merge to a second one."""

from typing import NamedTuple

import torch
import triton

from nanoserve.kernels.decode_merge import MERGE_TILE, decode_reduce_kernel
from nanoserve.kernels.pdl import use_pdl

_BLOCK_N = 64
_LARGE_BATCH = 64


def default_num_splits(batch_size: int, num_kv_heads: int, max_context_len: int) -> int:
    """About 1024 programs, but 2 to 16 splits, and never a split under 64 keys; one split past 1024 programs.

    Measured on an H200 (bf16, 8 kv heads, graph-captured; probe at 275aa23): at batch 256
    two splits beat one by 4% (3.9 TB/s: long and short sequences balance better); at batch 1 with 128-640
    keys, 4-16 splits took 6.3-6.6 us where 128 took 11.8 us (empty splits and a long reduce are not free),
    and at 4,000 keys 16-32 splits were fastest. A captured graph sizes max_context_len to max_model_len,
    so the count must suit short and long contexts alike."""
    # Past 1,024 programs the GPU is full without splits, and the reduce launch is saved: on an H100 with
    # 128-key tiles, one split at batches over 128 (8 kv heads) cut the throughput recipe's GPU time 1.2-1.5 %
    # (probe at 275aa23).
    if batch_size * num_kv_heads > 1024:
        return 1
    wanted = min(16, max(2, triton.cdiv(1024, batch_size * num_kv_heads)))
    return max(1, min(wanted, triton.cdiv(max_context_len, _BLOCK_N)))


class SplitLaunch(NamedTuple):
    """A split kernel's launch: its grid (sequences, kv heads, splits), the partials' fp32 scratch, the counters
    pointer (seq_lens stands in when there are none), and the constexprs and options every split kernel takes."""

    grid: tuple[int, int, int]
    mid_o: torch.Tensor
    mid_lse: torch.Tensor
    counters: torch.Tensor
    options: dict


def plan_split_launch(dtype: torch.dtype, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, num_splits: int | None,
                      counters: torch.Tensor | None, window: int | None = None) -> SplitLaunch | None:
    """Check the arguments (as decode_attention takes them) against out [B, num_q_heads, head_dim] and plan the
    launch; dtype is the queries' (fp32 gets an exact dot). None when there is nothing to launch (B == 0).
    window: a sliding window, which bounds the keys the splits share out."""
    batch, num_q_heads, head_dim = out.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim in (64, 128, 256), "head_dim must be 64, 128 or 256"
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of 2 >= 8"
    assert num_q_heads % num_kv_heads == 0 and out.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert seq_lens.shape == (batch,) and block_tables.shape[0] == batch
    if counters is not None:
        assert counters.dtype == torch.int32 and counters.is_contiguous(), "counters must be contiguous int32"
        assert counters.numel() >= batch * num_kv_heads, "counters needs one slot per (sequence, kv head)"
        assert counters.device == out.device
    if batch == 0:
        return None
    if num_splits is None:
        longest = block_tables.shape[1] * block_size
        num_splits = default_num_splits(batch, num_kv_heads, longest if window is None else min(window, longest))
    group = num_q_heads // num_kv_heads
    split = num_splits > 1
    fused = split and counters is not None
    if split:
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=out.device)
    else:
        mid_o = mid_lse = out  # never read or written: the kernel writes the output directly
    block_g = triton.next_power_of_2(group)
    pdl = use_pdl(out)
    # Memory bound: two stages of 64-key tiles keep the next tile's gather in flight. Large 16-bit batches stream
    # more bytes per program with 128-key tiles in three stages (192 KB of shared memory at head_dim 128, too
    # much in fp32): on an H100, 3 % faster at batch 128 and 256, and the throughput recipe's run 2.7 % shorter
    # (probes at 275aa23).
    block_n, num_stages = (128, 3) if batch >= _LARGE_BATCH and k_cache.element_size() == 2 else (_BLOCK_N, 2)
    if head_dim == 256:
        # Gemma 2's and Gemma 3 1B-12B's heads: two stages of 64-key 16-bit K/V tiles take 128 KB of shared memory
        # (32-key ones in fp32), where 128-key tiles in three would need 384 KB. Not measured on a GPU yet.
        block_n, num_stages = (_BLOCK_N if k_cache.element_size() <= 2 else 32), 2
    options = dict(
        SPLIT=split, FUSED=fused,
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,  # scales apply (decode_split.py); else the cache is q's dtype
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",  # tf32 would lose fp32 inputs' bits
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        # tl.dot needs M >= 16: small groups are padded with zero queries, free since decode is memory bound.
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        # The fused merge needs no tl.dot, so its head tile is just the group (4 for Llama-3.1-8B).
        BLOCK_G=block_g,
        BLOCK_S=min(triton.next_power_of_2(num_splits), max(1, MERGE_TILE // (block_g * head_dim))),
        USE_PDL=pdl, launch_pdl=pdl,
        num_warps=4, num_stages=num_stages,
    )
    return SplitLaunch((batch, num_kv_heads, num_splits), mid_o, mid_lse, counters if fused else seq_lens, options)


def launch_reduce(launch: SplitLaunch, out: torch.Tensor) -> None:
    """The second launch, merging the partials, where the split kernel stored some and did not merge them."""
    if not launch.options["SPLIT"] or launch.options["FUSED"]:
        return
    num_splits, pdl = launch.grid[2], launch.options["USE_PDL"]
    decode_reduce_kernel[(out.shape[0], out.shape[1])](
        launch.mid_o, launch.mid_lse, out, out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=out.shape[2],
        BLOCK_S=min(16, triton.next_power_of_2(num_splits)),  # bounds registers at 16 x head_dim fp32
        USE_PDL=pdl, launch_pdl=pdl, num_warps=4)
