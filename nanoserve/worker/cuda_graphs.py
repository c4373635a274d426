"""CUDA graphs for decode steps: one graph per batch size on a ladder, captured once at start.

A decode step of a small model is dozens of short kernels; launching them from Python costs more than
running them. A captured graph replays them all in one launch. Batches are padded up to the next
captured size: padded rows get slot -1 (nothing stored) and seq_len 0 (the kernel writes zeros).
"""

import torch
from torch import nn
from tqdm import tqdm

from nanoserve.layers.attention import AttentionMetadata


def batch_size_ladder(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.sizes = batch_size_ladder(max_batch_size)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.cu_seqlens_q[:bs + 1], self.seq_lens[:bs],
                                 self.block_tables[:bs], max_seqlen_q=1, num_decodes=bs)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the largest one made.
        for bs in tqdm(reversed(self.sizes), total=len(self.sizes), desc="capturing CUDA graphs"):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            self.model(*args)  # warm-up: compiles kernels and settles allocations outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                out = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].zero_()
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]
