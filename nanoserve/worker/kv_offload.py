"""KVOffloader: the CPU pool's KV (--kv-offload-gb) and the copies between it and the device's pool.

The CPU pool is laid out layer by layer, a block's keys and values side by side ([layers, cpu blocks, 2, block_size,
kv heads, head_dim], pinned on CUDA): long-context attention streams one layer's run of consecutive blocks back in
one contiguous copy (worker/kv_ring.py), and a whole block moved between the pools is one copy per layer and run
of consecutive blocks. A step's copies (engine/cpu_tier.py and the block manager decide them) are made before its
forward pass, in two batches:
- to the CPU: the blocks are gathered from every layer into one staging tensor on the compute stream (they are
  about to be reused by this step), then copied to the host on a stream of their own that waits for that gather
  only; the forward pass runs meanwhile;
- back: the CPU blocks are copied into a staging tensor on a second stream (PCIe copies each way at once), and
  the compute stream waits for that copy, then scatters the staging into every layer's cache.
A copy that reads or writes a CPU block waits for a copy still in flight that writes or reads that block (an
event per batch, with its block ids; the ring's loads count as reads); within one step the block manager never
has both (CpuTier.reading).
On the CPU (tests, CPU serving) the same copies run in order, synchronously.
"""

import torch

from nanoserve.utils import to_device

Pairs = list[tuple[int, int]]


def block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids."""
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            runs.append((start, ids[start], i - start))
            start = i
    return runs


def by_cpu_block(pairs: Pairs, cpu: int) -> tuple[Pairs, list[tuple[int, int, int]]]:
    """`pairs` in the order of their CPU block (element `cpu` of each pair), and the runs of consecutive CPU blocks
    in that order. A sequence's blocks leave the GPU tail first, so the CPU tier gives them descending ids: unsorted,
    every block was a run of its own, one 64 KiB copy a layer (the multi-turn benchmark's Llama-3.1-8B requests
    loaded ~72 blocks in ~2,300 copies, ~112 once sorted: a CPU replay of its H100 run at 8459f98)."""
    pairs = sorted(pairs, key=lambda pair: pair[cpu])
    return pairs, block_runs([pair[cpu] for pair in pairs])


class KVOffloader:
    def __init__(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]], num_cpu_blocks: int) -> None:
        k = kv_cache[0][0]
        self.kv_cache = kv_cache
        self.device = k.device
        cuda = self.device.type == "cuda"
        self.cpu = torch.empty((len(kv_cache), num_cpu_blocks, 2, *k.shape[1:]), dtype=k.dtype, pin_memory=cuda)
        self.out_stream = torch.cuda.Stream(self.device) if cuda else None
        self.in_stream = torch.cuda.Stream(self.device) if cuda else None
        # Copies in flight: (done event, CPU block ids), to the CPU and back.
        self.writing: list[tuple[torch.cuda.Event, set[int]]] = []
        self.reading: list[tuple[torch.cuda.Event, set[int]]] = []

    def swap(self, swap_out: Pairs, swap_in: Pairs) -> None:
        """Queue this step's copies: (device block, CPU block) to the CPU, then (CPU block, device block) back."""
        if swap_out:
            self._to_cpu(swap_out)
        if swap_in:
            self._to_device(swap_in)

    def wait_for(self, stream: torch.cuda.Stream, in_flight: list, ids: set[int]) -> None:
        """Make `stream` wait for the copies in flight that touch `ids`; forget the finished ones."""
        in_flight[:] = [(done, touched) for done, touched in in_flight if not done.query()]
        for done, touched in in_flight:
            if touched & ids:
                stream.wait_event(done)

    def _to_cpu(self, pairs: Pairs) -> None:
        pairs, runs = by_cpu_block(pairs, 1)
        device_ids = to_device([d for d, _ in pairs], torch.int64, self.device)
        staging = torch.stack([torch.stack([k[device_ids], v[device_ids]], dim=1) for k, v in self.kv_cache])
        cpu_ids = [c for _, c in pairs]
        if self.out_stream is None:
            self.cpu[:, cpu_ids] = staging
            return
        gathered = torch.cuda.Event()
        gathered.record()
        self.wait_for(self.out_stream, self.reading, set(cpu_ids))
        with torch.cuda.stream(self.out_stream):
            self.out_stream.wait_event(gathered)
            for at, first, n in runs:
                for layer in range(len(self.kv_cache)):
                    self.cpu[layer, first:first + n].copy_(staging[layer, at:at + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        staging.record_stream(self.out_stream)  # not reused by the allocator before the copy is done
        self.writing.append((done, set(cpu_ids)))

    def _to_device(self, pairs: Pairs) -> None:
        pairs, runs = by_cpu_block(pairs, 0)
        cpu_ids = [c for c, _ in pairs]
        if self.in_stream is None:
            staging = self.cpu[:, cpu_ids]
        else:
            self.wait_for(self.in_stream, self.writing, set(cpu_ids))
            with torch.cuda.stream(self.in_stream):
                # Allocated on this stream: memory the compute stream freed may still be in use by its queued work.
                staging = torch.empty((len(self.kv_cache), len(pairs), *self.cpu.shape[2:]), dtype=self.cpu.dtype,
                                      device=self.device)
                for at, first, n in runs:
                    for layer in range(len(self.kv_cache)):
                        staging[layer, at:at + n].copy_(self.cpu[layer, first:first + n], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            torch.cuda.current_stream().wait_event(done)
            staging.record_stream(torch.cuda.current_stream())
            self.reading.append((done, set(cpu_ids)))
        device_ids = to_device([d for _, d in pairs], torch.int64, self.device)
        for layer, (k, v) in enumerate(self.kv_cache):
            k[device_ids] = staging[layer, :, 0]
            v[device_ids] = staging[layer, :, 1]
