"""CUDA graphs for whole steps, captured once at start.

A step of a small model is hundreds of short kernels; launching them from Python costs more than
running them (a Triton launch alone is tens of microseconds of host time). A captured graph replays
them all in one launch. Two kinds:
- decode graphs, one per batch size on a ladder, for steps where every sequence brings one token
  (flash-decoding attention). Padded rows get slot -1 (nothing stored) and seq_len 0.
- prefill graphs, one per token-count bucket, for every other step: attention goes through the
  prefill kernel's split map for all sequences (a decode is a one-token tile), so the launches depend
  only on the bucket; which long tiles have their keys split, and how, is chosen per step on the host
  and copied in with the map. Padded tokens belong to no tile and store nothing; padded sequences are empty.
  Each attention program serves all the query heads of one kv head (kernels/prefill/tile_map.py, GQA packing).
Each graph runs the kernel plan of its shape (layers/step_plan.py), decided once, when it is captured.
"""

import contextlib
import gc

import torch
from torch import nn
from tqdm import tqdm

from nanoserve.kernels.prefill import PrefillPlanner
from nanoserve.kernels.prefill.tile_map import SPLIT_MAP_COLUMNS
from nanoserve.layers.attention import Attention, AttentionMetadata
from nanoserve.layers.step_plan import FUSED_DECODE_MERGE_MAX_BATCH, KernelPlanner
from nanoserve.utils import pinned, to_device


def batch_size_ladder(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch_size + 1, 16))
    return sorted({s for s in sizes if s <= max_batch_size} | {max_batch_size})


def token_ladder(max_num_tokens: int) -> list[int]:
    # Powers of two up to 512, then steps of 512: a step pays for its bucket's padding in every GEMM, and
    # pure powers of two would pad a 2,100-token prefill to 4,096.
    sizes = [16, 32, 64, 128, 256] + list(range(512, max_num_tokens + 1, 512))
    return sorted({s for s in sizes if s <= max_num_tokens} | {max_num_tokens})


@contextlib.contextmanager
def no_garbage_collection():
    """Collect garbage now and keep the cyclic collector off until the block ends.

    A collection inside a capture runs arbitrary destructors in the middle of it. Freeing pinned host memory
    that a copy used on the capturing stream fails the capture with CUDA "invalid argument" (the GPU test
    test_graph_capture_survives_garbage_collection, without this guard). In the GPU tests, after the benchmarks
    had run on a cold Triton cache, a later engine's capture failed with "operation failed due to a previous
    error during capture" in 2 of 2 runs, and passed with this guard; which object the collector freed there is
    not known (a probe at 275aa23 found the simpler cases harmless)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Graphs:
    """Captures the model once per size over static input buffers; sizes largest first, so the smaller
    graphs fit in the memory pool the largest one made."""

    def __init__(self, model: nn.Module, sizes: list[int], desc: str) -> None:
        self.model, self.sizes, self.desc = model, sizes, desc
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _args(self, size: int) -> tuple:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, pool=None):
        with no_garbage_collection():
            for size in tqdm(reversed(self.sizes), total=len(self.sizes), desc=self.desc):
                args = self._args(size)
                self._forward(*args)  # warm-up: compiles kernels and settles allocations outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    out = self._forward(*args)
                pool = graph.pool()
                self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        return pool

    def release(self) -> None:
        """Destroy the graphs now, not whenever Python collects them: a graph that captured an NCCL collective holds
        a reference on its communicator, and NCCL's destroy of the group waits until every such graph is gone
        (pytorch/pytorch#115388)."""
        torch.cuda.synchronize()
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def _forward(self, *args) -> torch.Tensor:
        """What a graph holds: the model's forward pass over the static inputs."""
        return self.model(*args)

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)


class _LocalInputs:
    """The static slots and block tables of the sliding-window layers' own KV pool (AttentionMetadata's local_*)."""

    def __init__(self, num_tokens: int, num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        # Zero: padded rows point at the null block, which is zeroed and never written.
        self.block_tables = torch.zeros(num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)

    def attach(self, meta: AttentionMetadata, num_tokens: int, num_seqs: int) -> None:
        meta.local_slot_mapping = self.slot_mapping[:num_tokens]
        meta.local_block_tables = self.block_tables[:num_seqs]

    def copy(self, meta: AttentionMetadata, n: int, padded: int, num_seqs: int) -> None:
        """A step's n tokens (padded to `padded`) and num_seqs sequences into the static buffers."""
        self.slot_mapping[:n].copy_(meta.local_slot_mapping)
        self.slot_mapping[n:padded].fill_(-1)
        self.block_tables[:num_seqs, :meta.local_block_tables.shape[1]].copy_(meta.local_block_tables)


class CUDAGraphRunner(_Graphs):
    """Decode graphs on a batch-size ladder."""

    def __init__(self, model: nn.Module, max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                 planner: KernelPlanner, local: bool = False):
        """local: the sliding-window layers have a KV pool of their own, whose slots and tables are inputs too."""
        super().__init__(model, batch_size_ladder(max_batch_size), "capturing decode graphs")
        self.planner = planner
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.local = _LocalInputs(n, n, max_blocks_per_seq, device) if local else None
        num_kv_heads = next(m for m in model.modules() if isinstance(m, Attention)).num_kv_heads
        self.decode_counters = torch.zeros(FUSED_DECODE_MERGE_MAX_BATCH * num_kv_heads, dtype=torch.int32,
                                           device=device)
        self.decode_order = torch.zeros(n, dtype=torch.int64, device=device)

    def _args(self, bs: int) -> tuple:
        plan = self.planner.plan(bs, bs, bs, graph=True)
        meta = AttentionMetadata(self.slot_mapping[:bs], self.cu_seqlens_q[:bs + 1], self.seq_lens[:bs],
                                 self.block_tables[:bs], max_seqlen_q=1, num_decodes=bs,
                                 decode_counters=self.decode_counters if plan.fused_decode_merge else None,
                                 decode_order=self.decode_order[:bs] if plan.decode_order else None, plan=plan)
        if self.local is not None:
            self.local.attach(meta, bs, bs)
        return self.input_ids[:bs], self.positions[:bs], meta

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.plan.decode_order:
            from nanoserve.kernels.decode_order import longest_first_order

            longest_first_order(meta.seq_lens, meta.decode_order)
        return self.model(input_ids, positions, meta)

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and num_seqs <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].zero_()
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.local is not None:
            self.local.copy(meta, n, bs, n)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:n]


class PrefillGraphRunner(_Graphs):
    """Graphs for steps with prefill chunks, one per token-count bucket up to max_num_batched_tokens."""

    def __init__(self, model: nn.Module, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, planner: KernelPlanner, local: bool = False):
        """planner: the engine's, with its prefill attention planner (which eager steps use too); local: as
        CUDAGraphRunner's."""
        super().__init__(model, token_ladder(max_num_tokens), "capturing prefill graphs")
        self.max_num_seqs, self.planner = max_num_seqs, planner
        attn = next(m for m in model.modules() if isinstance(m, Attention))
        # Programs per map row: one per kv head, serving its `pack` query heads.
        self.prefill = planner.prefill
        assert self.prefill.program_heads == attn.num_kv_heads, "the prefill planner is for another model's heads"
        self.pack = self.prefill.pack
        t = self.sizes[-1]
        s = self._num_seqs(t)
        self.launches = {n: self.prefill.for_bucket(n, self._num_seqs(n)) for n in self.sizes}
        # Key splits: a bounded number of scratch slots per bucket, in one allocation that every bucket and layer
        # shares (one runs at a time); pieces of split tiles take the map rows that a step's tiles leave free.
        scratch = self.prefill.shared_scratch([self.launches[n] for n in self.sizes], attn.head_dim, device)
        self.split_scratch = dict(zip(self.sizes, scratch, strict=True))
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.local = _LocalInputs(t, s, max_blocks_per_seq, device) if local else None
        self.tile_map = torch.full((max(launch.num_rows for launch in self.launches.values()), SPLIT_MAP_COLUMNS),
                                   -1, dtype=torch.int32, device=device)

    def _num_seqs(self, num_tokens: int) -> int:
        return min(num_tokens, self.max_num_seqs)  # every sequence in a step brings at least one token

    def _args(self, n: int) -> tuple:
        s, launch = self._num_seqs(n), self.launches[n]
        meta = AttentionMetadata(self.slot_mapping[:n], self.cu_seqlens_q[:s + 1], self.seq_lens[:s],
                                 self.block_tables[:s], max_seqlen_q=n, num_decodes=0,
                                 tile_map=self.tile_map[:launch.num_rows], block_m=launch.block_m,
                                 split_scratch=self.split_scratch[n], pack=self.pack,
                                 plan=self.planner.plan(s, 0, n, graph=True))
        if self.local is not None:
            self.local.attach(meta, n, s)
        return self.input_ids[:n], self.positions[:n], meta

    def can_run(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_seqs <= self.max_num_seqs

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a step into the static buffers (padded to its bucket) with its split map; returns the bucket."""
        n, b = input_ids.shape[0], meta.seq_lens.shape[0]
        t = self.bucket(n)
        s = self._num_seqs(t)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:t].fill_(-1)
        self.cu_seqlens_q[:b + 1].copy_(meta.cu_seqlens_q)
        self.cu_seqlens_q[b + 1:s + 1].fill_(n)  # padded sequences bring no tokens
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:s].zero_()
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if self.local is not None:
            self.local.copy(meta, n, t, b)
        tiles = self.prefill.split_map(self.launches[t], meta.cu_seqlens_q_cpu, meta.seq_lens_cpu)
        tiles = pinned(torch.from_numpy(tiles), self.tile_map.device)
        self.tile_map[:self.launches[t].num_rows].copy_(tiles, non_blocking=True)
        return t

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        graph, out = self.graphs[self.prepare(input_ids, positions, meta)]
        graph.replay()
        return out[:input_ids.shape[0]]


def eager_tile_map(meta: AttentionMetadata, device: torch.device, head_dim: int, planner: PrefillPlanner) -> None:
    """Give an eager step's prefill part its split map and scratch (planner: the model's heads on this device), so
    the kernel never reads lengths back."""
    nd = meta.num_decodes
    if nd == meta.seq_lens.shape[0]:  # decodes only (a draft's passes built on the device have no host lengths)
        return
    cu = [c - nd for c in meta.cu_seqlens_q_cpu[nd:]]
    lens = meta.seq_lens_cpu[nd:]
    launch, split_map = planner.for_batch(cu, lens)
    meta.tile_map = to_device(split_map, torch.int32, device)
    meta.block_m, meta.pack = launch.block_m, planner.pack
    # Eager steps may allocate: just the slots this map uses.
    meta.split_scratch = planner.scratch_for(split_map, launch.block_m, head_dim, device)
