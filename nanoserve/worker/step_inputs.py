"""StepInputs: one step's inputs packed into one int64 array, built by rank 0 from the scheduled batch.

The array is what the device gets in one host-to-device copy (ModelRunner.execute), and under tensor parallelism
what rank 0 sends to the other ranks each step (send/recv below, through TensorParallelGroup.send_host: shared
memory on its node, gloo to other nodes): one message of a header of sizes and the array, never the requests
themselves.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.utils import to_device
from nanoserve.worker.batch import ScheduledBatch, ScheduledEntry

# Header fields, in this order; STOP in the first one ends a worker.
_HEADER = ("num_tokens", "num_seqs", "width", "num_pending", "num_logit_rows", "max_seqlen_q",
           "num_decodes", "sample", "num_copies", "num_swap_out", "num_swap_in", "num_prompt_logprobs",
           "num_long_context_ints", "replica_call", "num_temperatures", "local", "num_local_copies")
_STOP = -1
# replica_call of a step whose samples no rank but 0 needs: a speculative step's (verify), whose count per sequence
# varies; speculative steps are synchronous, so no later step takes pending tokens from them on the device.
NO_SAMPLES = -2
# Up to this many positions chunk_slots maps one by one in Python: 4 of them took 0.7 us so, 6 us through numpy; at
# 64 the two were about even (this 2-core CPU).
_SMALL_CHUNK = 32


@dataclass
class LongContextRow:
    """A long-context sequence's entry (worker/kv_ring.py): its rows of the step, the position of the first, the CPU
    blocks holding its older keys, and its blocks on the device (the window) holding the rest from
    len(cpu_blocks) * block_size on. The step's attention metadata shows the entry the window only."""

    first_row: int
    num_rows: int
    start: int
    cpu_blocks: list[int]
    window: list[int]

    def pack(self) -> list[int]:
        return [self.first_row, self.num_rows, self.start, len(self.cpu_blocks), len(self.window), *self.cpu_blocks,
                *self.window]

    @classmethod
    def unpack_all(cls, ints: list[int]) -> list["LongContextRow"]:
        rows, at = [], 0
        while at < len(ints):
            first, n, start, num_cpu, num_window = ints[at:at + 5]
            cpu_end = at + 5 + num_cpu
            rows.append(cls(first, n, start, ints[at + 5:cpu_end], ints[cpu_end:cpu_end + num_window]))
            at = cpu_end + num_window
        return rows


def chunk_slots(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The KV cache slots of positions start .. start + n - 1 through the sequence's block table."""
    if n <= _SMALL_CHUNK:  # a verify entry, a draft's catch-up: numpy's fixed cost per call would be most of it
        assert (start + n - 1) // block_size < len(block_table), "the block table must cover the chunk"
        return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    # Whole pages at once: a per-position Python loop cost ~0.6 ms of host time for an 8,192-token chunk.
    pages = np.asarray(block_table[start // block_size:(start + n - 1) // block_size + 1], dtype=np.int64)
    first = start % block_size
    assert len(pages) * block_size >= first + n, "the block table must cover the chunk"
    return (pages[:, None] * block_size + np.arange(block_size)).ravel()[first:first + n].tolist()


@dataclass
class StepInputs:
    """The int64 array holds input_ids, positions, slot_mapping (num_tokens each), with `local` the sliding-window
    layers' slot_mapping too, where the pending tokens go and their rows in the previous step's samples (num_pending
    each), the hidden rows to sample from (num_logit_rows; -1: every row samples once, no gather), then cu_seqlens_q,
    seq_lens and the block tables (and with `local` the window pool's) as int32, two to a slot."""

    host: np.ndarray
    num_tokens: int
    num_seqs: int
    width: int
    num_pending: int
    num_logit_rows: int
    max_seqlen_q: int
    num_decodes: int
    sample: bool  # whether any sequence takes a token from this step
    local: bool = False  # the sliding-window layers have a pool of their own (engine/local_blocks.py)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks to copy first
    kv_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, CPU) blocks, before block_copies
    kv_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU, device) blocks, after them
    local_block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) in the window pool
    prompt_logprob_rows: list[tuple[int, int]] = field(default_factory=list)  # (first hidden row, rows)
    long_context: list[LongContextRow] = field(default_factory=list)
    # Host copies rank 0 has at hand anyway; the other ranks read them out of `host`.
    cu_seqlens_q_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # How the other ranks get this step's samples (tensor parallelism): -1, rank 0 broadcasts them; otherwise each
    # rank draws them itself from the same logits (Sampler.sample_replica), as the sampler's call number `replica_call`
    # with these temperatures; NO_SAMPLES: the other ranks need none.
    replica_call: int = -1
    temperatures: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, batch: ScheduledBatch, prev_rows: dict[int, int], block_size: int,
              prompt_logprob_rows: list[tuple[int, int]], local: bool = False,
              unread_chunks: bool = False) -> "StepInputs":
        """The step of `batch`. A token that the previous step sampled and the host has not read yet is taken on
        the device from that step's samples, at its row in prev_rows (seq_id -> row). local: the sequences'
        local_table and the batch's local_block_copies go in too. unread_chunks: a chunk of several tokens may end
        in tokens not read yet (a draft proposer's early catch-up over a verify step's rows); otherwise only a
        decode's one token may be, as async scheduling leaves it."""
        input_ids, positions, slots, cu, lens, tables, logit_rows = [], [], [], [0], [], [], []
        local_slots, local_tables = [], []
        pending_at, pending_rows, long_context = [], [], []
        bs = block_size
        for entry in batch.scheduled:
            seq, start, n = entry.seq, entry.start, entry.num_new_tokens
            table = seq.block_table
            if seq.cpu_blocks:  # long-context mode: the table (and what attention sees here) starts after them
                offset = len(seq.cpu_blocks) * bs
                long_context.append(LongContextRow(len(input_ids), n, start, list(seq.cpu_blocks), list(table)))
                table = [-1] * len(seq.cpu_blocks) + table  # slots by position; the attention lengths are cut below
            if n == 1:  # a decode: the common case, without slices and ranges
                if start < len(seq.token_ids):
                    input_ids.append(seq.token_ids[start])
                else:  # sampled by the previous step, not read yet: it is taken on the device
                    pending_at.append(len(input_ids))
                    pending_rows.append(prev_rows[seq.seq_id])
                    input_ids.append(0)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                if local:
                    local_slots.append(seq.local_table[start // bs] * bs + start % bs)
            else:
                # Speculative decoding: the last tokens are drafts to verify, which follow the known ones.
                drafts = entry.draft_token_ids
                known = min(n - len(drafts), len(seq.token_ids) - start)
                assert unread_chunks or known == n - len(drafts), "only a decode's token can be unread"
                input_ids += seq.token_ids[start:start + known]
                if known < n - len(drafts):
                    # A draft proposer's early catch-up (worker/draft_model.py): its last tokens are a verify step's
                    # rows, not read yet, from row prev_rows[seq_id] of the tokens passed to to_device.
                    unread = n - len(drafts) - known
                    pending_at += range(len(input_ids), len(input_ids) + unread)
                    pending_rows += range(prev_rows[seq.seq_id], prev_rows[seq.seq_id] + unread)
                    input_ids += [0] * unread
                if drafts:
                    input_ids += drafts
                positions += range(start, start + n)
                slots += chunk_slots(table, start, n, bs)
                if local:
                    local_slots += chunk_slots(seq.local_table, start, n, bs)
            cu.append(cu[-1] + n)
            if seq.cpu_blocks:
                lens.append(start + n - offset)
                tables.append(table[len(seq.cpu_blocks):])
            else:
                lens.append(start + n)
                tables.append(table)
                if local:
                    local_tables.append(seq.local_table)
            if entry.sample_seqs:
                if n > 1 and entry.draft_token_ids:  # verify: every drafted position gives a distribution
                    logit_rows += range(cu[-1] - 1 - len(entry.draft_token_ids), cu[-1])
                else:
                    logit_rows += [cu[-1] - 1] * len(entry.sample_seqs)
        width = max(len(t) for t in tables + local_tables)
        num_seqs, num_tokens = len(tables), len(input_ids)
        sample_all = logit_rows == list(range(num_tokens))  # every row samples once: no gather needed
        longs = input_ids + positions + slots + local_slots + pending_at + pending_rows + \
            ([] if sample_all else logit_rows)
        # One host-to-device copy for the whole step: the int64 values, then the int32 ones two to a slot, sliced
        # (and viewed as int32) into its tensors on the device. At batch 1 a step is ~1 ms of GPU work, and each
        # separate small copy (its pinned staging buffer, its copy call, the kernels that consumed it) sat on
        # the host's path and the stream's.
        # Through numpy: it converts a long list of Python ints ~3x faster than torch.as_tensor (1.3 vs 0.4 ms for
        # an 8,192-token step's 24,576 values on this 2-core CPU).
        num_ints = 2 * num_seqs + 1 + (1 + local) * num_seqs * width  # cu_seqlens_q, seq_lens, block tables
        host = np.zeros(len(longs) + (num_ints + 1) // 2, dtype=np.int64)
        host[:len(longs)] = longs
        ints = host[len(longs):].view(np.int32)
        ints[:num_seqs + 1] = cu
        ints[num_seqs + 1:2 * num_seqs + 1] = lens
        block_tables = ints[2 * num_seqs + 1:num_ints].reshape(1 + local, num_seqs, width)
        for group, group_tables in zip(block_tables, (tables, local_tables)[:1 + local], strict=True):
            for row, table in zip(group, group_tables, strict=True):
                row[:len(table)] = table
        return cls(host, num_tokens, num_seqs, width, len(pending_at), -1 if sample_all else len(logit_rows),
                   max(e.num_new_tokens for e in batch.scheduled), batch.num_decodes, bool(logit_rows), local,
                   list(batch.block_copies), list(batch.kv_swap_out), list(batch.kv_swap_in),
                   list(batch.local_block_copies) if local else [], prompt_logprob_rows, long_context, cu, lens)

    @property
    def num_longs(self) -> int:
        return (3 + self.local) * self.num_tokens + 2 * self.num_pending + max(self.num_logit_rows, 0)

    def to_device(self, device: torch.device, prev_tokens: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """input_ids, positions, attention metadata, and the hidden rows to sample from (None: every row, once);
        pending tokens are read from prev_tokens, the previous step's samples on the device."""
        nt, ns, n_pending = self.num_tokens, self.num_seqs, self.num_pending
        at = (3 + self.local) * nt
        num_ints = 2 * ns + 1 + (1 + self.local) * ns * self.width
        if self.cu_seqlens_q_cpu is None:
            ints = self.host[self.num_longs:].view(np.int32)
            self.cu_seqlens_q_cpu, self.seq_lens_cpu = ints[:ns + 1].tolist(), ints[ns + 1:2 * ns + 1].tolist()
        dev = to_device(self.host, torch.int64, device)
        ids, pos, slot_mapping = dev[:nt], dev[nt:2 * nt], dev[2 * nt:3 * nt]
        rows = dev[at + 2 * n_pending:self.num_longs] if self.num_logit_rows >= 0 else None
        ints = dev[self.num_longs:].view(torch.int32)[:num_ints]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=ints[:ns + 1],
            seq_lens=ints[ns + 1:2 * ns + 1],
            block_tables=ints[2 * ns + 1:2 * ns + 1 + ns * self.width].view(ns, self.width),
            max_seqlen_q=self.max_seqlen_q,
            num_decodes=self.num_decodes,
            seq_lens_cpu=self.seq_lens_cpu,
            cu_seqlens_q_cpu=self.cu_seqlens_q_cpu,
        )
        if self.local:
            meta.local_slot_mapping = dev[3 * nt:4 * nt]
            meta.local_block_tables = ints[2 * ns + 1 + ns * self.width:].view(ns, self.width)
        if n_pending:
            ids[dev[at:at + n_pending]] = prev_tokens[dev[at + n_pending:at + 2 * n_pending]]
        return ids, pos, meta, rows

    # -- between ranks -----------------------------------------------------------------------------------------
    def send(self, tp: TensorParallelGroup) -> None:
        """Rank 0: this step to every other rank (recv there), as one int64 message: the header, the array, then
        the block copies, KV swaps, prompt-logprob rows and long-context rows."""
        header = [self.num_tokens, self.num_seqs, self.width, self.num_pending, self.num_logit_rows,
                  self.max_seqlen_q, self.num_decodes, int(self.sample), len(self.block_copies),
                  len(self.kv_swap_out), len(self.kv_swap_in), len(self.prompt_logprob_rows)]
        pairs = self.block_copies + self.kv_swap_out + self.kv_swap_in + self.prompt_logprob_rows + \
            self.local_block_copies
        long_context = [v for row in self.long_context for v in row.pack()]
        header += [len(long_context), self.replica_call, len(self.temperatures), int(self.local),
                   len(self.local_block_copies)]
        temperatures = np.asarray(self.temperatures, np.float64).view(np.int64).tolist()  # exact: their bits
        tail = np.asarray(header + [v for pair in pairs for v in pair] + long_context + temperatures, np.int64)
        tp.send_host(np.concatenate([tail[:len(_HEADER)], self.host, tail[len(_HEADER):]]))

    @staticmethod
    def send_stop(tp: TensorParallelGroup) -> None:
        tp.send_host(np.asarray([_STOP] + [0] * (len(_HEADER) - 1), np.int64))

    @classmethod
    def recv(cls, tp: TensorParallelGroup) -> "StepInputs | None":
        """A rank other than 0: the next step rank 0 sends, or None when it stops the workers."""
        message = tp.recv_host()
        header, payload = message[:len(_HEADER)].tolist(), message[len(_HEADER):]
        if header[0] == _STOP:
            return None
        h = dict(zip(_HEADER, header, strict=True))
        step = cls(np.empty(0, np.int64), h["num_tokens"], h["num_seqs"], h["width"], h["num_pending"],
                   h["num_logit_rows"], h["max_seqlen_q"], h["num_decodes"], bool(h["sample"]), bool(h["local"]))
        counts = [h["num_copies"], h["num_swap_out"], h["num_swap_in"], h["num_prompt_logprobs"],
                  h["num_local_copies"]]
        step.replica_call, num_temps = h["replica_call"], h["num_temperatures"]
        step.temperatures = payload[len(payload) - num_temps:].view(np.float64).tolist()
        payload = payload[:len(payload) - num_temps]
        num_long = h["num_long_context_ints"]
        step.long_context = LongContextRow.unpack_all(payload[len(payload) - num_long:].tolist())
        payload = payload[:len(payload) - num_long]
        tail = [tuple(p) for p in payload[len(payload) - 2 * sum(counts):].reshape(-1, 2).tolist()]
        step.host = payload[:len(payload) - 2 * sum(counts)]
        ends = np.cumsum(counts).tolist()
        step.block_copies, step.kv_swap_out = tail[:ends[0]], tail[ends[0]:ends[1]]
        step.kv_swap_in, step.prompt_logprob_rows = tail[ends[1]:ends[2]], tail[ends[2]:ends[3]]
        step.local_block_copies = tail[ends[3]:]
        return step


def prompt_logprob_rows(entry: ScheduledEntry) -> int:
    """How many of the entry's rows give prompt logprobs: row j predicts prompt token
    start + j + 1, and the prompt's last row predicts the first output, which is not a prompt logprob."""
    seq = entry.seq
    if seq.params.prompt_logprobs is None or seq.num_output_tokens or seq.index:
        return 0
    return max(0, min(entry.num_new_tokens, seq.num_prompt_tokens - 1 - entry.start))
