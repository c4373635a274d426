"""Long-context attention: a sequence's older keys stream back from the CPU pool through a ring of device slots.

A sequence longer than the device's KV pool keeps only its window there (the blocks from the one its next tokens
start in); its older blocks sit in the CPU pool (worker/kv_offload.py), one contiguous run per layer when they were
moved there together. At each layer, after the batch's attention, the sequence's rows are computed again in pieces:
over the window (causal), then over its older blocks a chunk at a time, each chunk copied into a ring slot on the
offloader's copy-in stream while the slot before is attended to on the compute stream; the pieces are merged by
log-sum-exp (kernels/chunk_attention.py) and replace the rows the batch's attention wrote from the window alone.

With two slots, the copy of chunk j + 1 waits only for the attention over chunk j - 1 (the slot's last reader, by
an event) and for the copy to the CPU of blocks the step has just moved (the offloader's events). By arithmetic, a
prefill chunk's attention over a slot takes longer than copying the slot (8,192 Llama-3.1-8B queries against 8,192
keys are ~1.1 TFLOP a layer; the slot is 32 MiB, under a millisecond at the ~42 GB/s measured for the copies), so
prefill need not wait for PCIe; a decode's single query cannot hide it: all older KV crosses PCIe at every token
(16 GiB at 128k tokens, ~0.4 s). Measured on an H100: BENCHMARKS.md table 5.

On the CPU (tests) the same pieces are read straight from the CPU pool.
"""

from collections.abc import Callable

import torch

from nanoserve.utils import to_device
from nanoserve.worker.kv_offload import KVOffloader, block_runs
from nanoserve.worker.step_inputs import LongContextRow

# Keys per ring slot: 8,192 tokens is 32 MiB a slot for Llama-3.1-8B (8 kv heads of 128, bf16), and each chunk is
# one copy per run of consecutive CPU blocks, large enough to run at the link's bandwidth.
RING_SLOT_TOKENS = 8192


class RingChunk:
    """Some of a sequence's older blocks, loaded into one slot together: the same for every layer of a step."""

    def __init__(self, cpu_ids: list[int]) -> None:
        self.cpu_ids = cpu_ids
        self.ids = set(cpu_ids)
        self.runs = block_runs(cpu_ids)


class KVRing:
    """The device slots and the events that order their copies and readers."""

    def __init__(self, offloader: KVOffloader, block_size: int, num_slots: int = 2) -> None:
        self.offloader = offloader
        self.slot_blocks = max(1, RING_SLOT_TOKENS // block_size)
        cpu = offloader.cpu
        self.cuda = offloader.in_stream is not None
        self.slots = torch.empty((num_slots, self.slot_blocks, *cpu.shape[2:]), dtype=cpu.dtype,
                                 device=offloader.device) if self.cuda else None
        self.readers: list[torch.cuda.Event | None] = [None] * num_slots  # the last attention over each slot
        self.next_slot = 0
        self.slot_ids = torch.arange(self.slot_blocks, dtype=torch.int32, device=offloader.device)
        self.last_layer = offloader.cpu.shape[0] - 1

    def load(self, layer: int, chunk: RingChunk) -> tuple[int, torch.Tensor]:
        """Queue the copy of one layer's blocks of `chunk` into the next slot; the compute stream waits for it.
        Returns the slot and its blocks ([n, 2, block_size, kv heads, head_dim]); call done(slot) after the reads
        are queued."""
        if not self.cuda:
            return -1, self.offloader.cpu[layer, chunk.cpu_ids]
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.readers)
        off = self.offloader
        off.wait_for(off.in_stream, off.writing, chunk.ids)
        if self.readers[slot] is not None:
            off.in_stream.wait_event(self.readers[slot])
        with torch.cuda.stream(off.in_stream):
            for at, first, n in chunk.runs:
                self.slots[slot, at:at + n].copy_(off.cpu[layer, first:first + n], non_blocking=True)
            loaded = torch.cuda.Event()
            loaded.record()
        if layer == self.last_layer:  # the copy stream runs in order: the last layer's copy ends the chunk's reads
            off.reading.append((loaded, chunk.ids))
        torch.cuda.current_stream().wait_event(loaded)
        return slot, self.slots[slot, :len(chunk.cpu_ids)]

    def skip(self, layer: int, chunk: RingChunk) -> None:
        """`chunk` is not loaded at `layer` (out of a sliding window): at the last layer, its earlier layers' copies
        still have to be waited for before its CPU blocks are reused, so their end is recorded as load's is."""
        if self.cuda and layer == self.last_layer:
            off = self.offloader
            with torch.cuda.stream(off.in_stream):
                copied = torch.cuda.Event()
                copied.record()
            off.reading.append((copied, chunk.ids))

    def done(self, slot: int) -> None:
        if slot >= 0:
            self.readers[slot] = torch.cuda.Event()
            self.readers[slot].record()


class LongContextAttention:
    """One step's long-context rows, read by every attention layer (AttentionMetadata.long_context)."""

    def __init__(self, ring: KVRing, rows: list[LongContextRow], block_size: int) -> None:
        self.ring = ring
        self.rows = rows
        self.block_size = block_size
        device = ring.offloader.device
        self.windows = [to_device(row.window, torch.int32, device) for row in rows]
        step = ring.slot_blocks
        # Every older key comes before every query, so their order does not matter to attention: sorted, the blocks
        # form the longest runs of consecutive ids, each one copy per layer.
        self.chunks = []
        for row in rows:
            ids = sorted(row.cpu_blocks)
            self.chunks.append([RingChunk(ids[i:i + step]) for i in range(0, len(ids), step)])

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               scale: float, attention: Callable, window: int | None = None,
               sinks: torch.Tensor | None = None, softcap: float | None = None, k_scale: float = 1.0,
               v_scale: float = 1.0) -> None:
        """Replace each long-context sequence's rows of `out` with attention over all of its keys, each piece by
        `attention` (the layer's backend's: kernels/chunk_attention.py's kernel, or its PyTorch reference). A
        sliding window leaves out older chunks that no row sees; sinks join the merged result once, at the end; softcap
        (Gemma 2's) caps every piece's scores; k_scale, v_scale: an fp8 cache's (the ring holds its bytes as they
        are)."""
        scales = {"k_scale": k_scale, "v_scale": v_scale}
        bs = self.block_size
        for row, window_ids, chunks in zip(self.rows, self.windows, self.chunks, strict=True):
            rows = slice(row.first_row, row.first_row + row.num_rows)
            qs = q[rows]
            acc = torch.empty(qs.shape, dtype=torch.float32, device=q.device)
            lse = torch.empty(qs.shape[:2], dtype=torch.float32, device=q.device)
            window_start = len(row.cpu_blocks) * bs
            attention(qs, k_cache, v_cache, window_ids, row.start + row.num_rows - window_start, window_start,
                      row.start, scale, acc, lse, accumulate=False, window=window, softcap=softcap, **scales)
            if window is None:
                for chunk in chunks:
                    slot, blocks = self.ring.load(layer, chunk)
                    n = len(chunk.cpu_ids)
                    ids = self.ring.slot_ids[:n] if slot >= 0 else torch.arange(n, dtype=torch.int32)
                    # Key positions 0 .. n * bs - 1 stand for any older ones: every query sees every one of them.
                    attention(qs, blocks[:, 0], blocks[:, 1], ids, n * bs, 0, row.start, scale, acc, lse,
                              accumulate=True, softcap=softcap, **scales)
                    self.ring.done(slot)
            else:
                self._attend_windowed(layer, row, chunks, qs, acc, lse, scale, attention, window, softcap, scales)
            if sinks is not None:
                # The sink's weight exp(s) beside the keys' exp(lse): the keys keep exp(lse) / (exp(lse) + exp(s)).
                acc.mul_(torch.sigmoid(lse - sinks[None, :])[..., None])
            out[rows] = acc.to(out.dtype)

    def _attend_windowed(self, layer: int, row: LongContextRow, chunks: list[RingChunk], qs: torch.Tensor,
                         acc: torch.Tensor, lse: torch.Tensor, scale: float, attention: Callable, window: int,
                         softcap: float | None, scales: dict) -> None:
        """The older keys that a sliding window still shows some row: a tail of the sequence's CPU blocks (listed in
        position order), loaded in position order so that each key keeps its position for the window's mask."""
        bs = self.block_size
        first = max(0, row.start - window + 1) // bs  # the first block holding a key the first row sees
        seen = row.cpu_blocks[first:]
        step = self.ring.slot_blocks
        for i in range(0, len(seen), step):
            chunk = RingChunk(seen[i:i + step])
            slot, blocks = self.ring.load(layer, chunk)
            n = len(chunk.cpu_ids)
            ids = self.ring.slot_ids[:n] if slot >= 0 else torch.arange(n, dtype=torch.int32)
            attention(qs, blocks[:, 0], blocks[:, 1], ids, n * bs, (first + i) * bs, row.start, scale, acc, lse,
                      accumulate=True, window=window, softcap=softcap, **scales)
            self.ring.done(slot)
        if layer == self.ring.last_layer:
            for chunk in chunks:
                self.ring.skip(layer, chunk)
