"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget (max_num_batched_tokens): running sequences first (one token each
when decoding, a chunk when still prefilling), then waiting requests in (priority, arrival) order.
When the KV pool runs out, the lowest-priority running sequence is preempted: its blocks are freed
and it goes back to the front of the queue to be recomputed later (cheaply, if its blocks are still
in the prefix cache; with a CPU tier, blocks evicted meanwhile are loaded back from CPU memory: that is
swapping, by way of the prefix cache).

A request that can never fit the GPU pool runs in long-context mode (with a CPU pool, --kv-offload-gb): its older
blocks live in CPU memory and each chunk it is given is as long as the GPU blocks it can hold allow
(BlockManager.long_context_room). Preempted, it is swapped rather than recomputed: its GPU blocks join the others in
CPU memory, and it resumes where it was.

A sequence's num_computed_tokens moves forward when it is scheduled, not when the step's results come
back: with async scheduling the next step is planned while this one still runs on the GPU, and its
last sampled token (Sequence.num_pending) is read there on the device.
"""

from dataclasses import dataclass, field

from nanoserve.engine.block_manager import NO_PREFIX, BlockManager
from nanoserve.engine.request import Request, SeqStatus, Sequence


# The model runner reads a step's batch through worker/batch.py's Protocols (ScheduledBatch, ScheduledEntry,
# BatchSeq), which these types and request.Sequence satisfy: a field renamed here is renamed there.
@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # the first position computed in this step
    num_new_tokens: int
    # The sequences that get a token sampled from this row's logits: empty while a prompt is only
    # partly prefilled, [seq] normally, [seq, *forks] when the first prefill of an n > 1 request ends.
    sample_seqs: list[Sequence] = field(default_factory=list)
    # Speculative decoding: the last len() of the new tokens are drafts (not in seq.token_ids) to verify, each
    # given a KV slot (a lookahead slot) like a known token.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decodes first, then prefill chunks
    block_copies: list[tuple[int, int]]
    # KV copies to the CPU tier (GPU block, CPU block), made before block_copies, and back (CPU block, GPU block),
    # after them (worker/kv_offload.py).
    kv_swap_out: list[tuple[int, int]] = field(default_factory=list)
    kv_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Copy-on-write in the sliding-window layers' pool (engine/local_blocks.py), beside block_copies.
    local_block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_decodes(self) -> int:
        # A one-token entry attends like a decode whether or not it ends a prompt.
        return sum(1 for s in self.scheduled if s.num_new_tokens == 1)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped = 0  # of which long-context sequences swapped to the CPU pool, not to be recomputed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether a running sample has penalties, which read every earlier token on the host: the next step may
        then have none pending."""
        return any(s.params.has_penalties for s in self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        preempted = 0
        self.running.sort(key=lambda s: s.request.sort_key)
        for seq in list(self.running):  # a copy: forks made in this step wait for the next one
            if budget == 0 or seq.status != SeqStatus.RUNNING:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new == 0:
                continue  # forked this step, its token not sampled yet
            if seq.num_pending and seq.num_output_tokens >= seq.request.max_tokens:
                continue  # its pending token is its last: the step that sampled it will finish it
            if seq.spec_token_ids:
                drafts, seq.spec_token_ids = seq.spec_token_ids[:budget - 1], []
                if drafts and num_new == 1 and seq.cpu_blocks is None and \
                        self.block_manager.can_allocate(seq, 1 + len(drafts)):
                    copies += self.block_manager.allocate(seq, 1 + len(drafts))
                    scheduled.append(self._entry(seq, 1 + len(drafts), drafts))
                    budget -= 1 + len(drafts)
                    continue
                # No room for the drafts' slots: it decodes without them rather than preempt another for them.
            if seq.cpu_blocks is not None:
                num_new = min(num_new, max(1, self.block_manager.long_context_room(seq)))
            elif self.block_manager.needs_long_context(seq):
                # It outgrew the GPU pool: preempting the others would not make room. It comes back in long-context
                # mode (recomputed).
                self._preempt(seq)
                preempted += 1
                continue
            elif num_new == 1 and seq.block_table and self.block_manager.append_slot(seq):
                scheduled.append(self._entry(seq, 1))
                budget -= 1
                continue
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                copies += self.block_manager.allocate(seq, num_new)
                scheduled.append(self._entry(seq, num_new))
                budget -= num_new
        # New work is admitted only when nothing had to be preempted, or the preempted would thrash.
        self.waiting.sort(key=lambda s: s.request.sort_key)
        while self.waiting and budget > 0 and not preempted:
            seq = self.waiting[0]
            if len(self.running) + len(seq.request.unforked) + 1 > self.max_num_seqs:
                break
            if seq.cpu_blocks is None and self.block_manager.needs_long_context(seq):
                seq.cpu_blocks = []
            long_context = seq.cpu_blocks is not None
            prefix = self.block_manager.match_prefix(seq) if seq.num_computed_tokens == 0 and not long_context \
                else NO_PREFIX
            # A long-context sequence swapped out by preemption resumes where it was.
            computed = seq.num_computed_tokens if long_context else len(prefix) * self.block_manager.block_size
            num_new = min(seq.num_tokens - computed, budget)
            if long_context:
                # Not before the CPU pool can hold its prompt's older blocks: taken in by chunks, it would run out
                # of room part way, preempt itself and start over.
                bm = self.block_manager
                if bm.cpu.num_available < bm.blocks_needed(seq.num_tokens) - bm.num_blocks - len(seq.cpu_blocks):
                    break
                num_new = min(num_new, max(1, bm.long_context_room(seq)))
            if not self.block_manager.can_allocate(seq, num_new, prefix):
                break
            if seq.num_output_tokens == 0 and seq.request.metrics.first_scheduled_time is None:
                seq.num_cached_tokens = computed
            copies += self.block_manager.allocate(seq, num_new, prefix)
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(self._entry(seq, num_new))
            budget -= num_new
        scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # stable: decodes first, order kept within
        return SchedulerOutput(scheduled, copies, *self.block_manager.take_swaps(),
                               local_block_copies=self.block_manager.take_local_copies())

    def _entry(self, seq: Sequence, num_new: int, drafts: list[int] | None = None) -> ScheduledSeq:
        entry = ScheduledSeq(seq, seq.num_computed_tokens, num_new)
        if drafts:
            entry.draft_token_ids = drafts
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens < seq.num_tokens:
            return entry  # a prompt chunk with more to come: nothing to sample yet
        entry.sample_seqs = [seq]
        request = seq.request
        while request.needs_fork:
            child = request.start_fork()
            self.block_manager.fork(seq, child)
            child.num_computed_tokens = seq.num_computed_tokens
            child.status = SeqStatus.RUNNING
            entry.sample_seqs.append(child)
        if len(entry.sample_seqs) > 1:
            # Beside their parent, so that running stays in priority order: preemption takes running[-1], and a
            # fork there would go first while freeing nothing (its blocks are all shared with the parent).
            at = self.running.index(seq) + 1
            self.running[at:at] = entry.sample_seqs[1:]
        return entry

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids = []
        if self.block_manager.swap_out_long_context(seq):
            self.num_swapped += 1
        else:
            self.block_manager.free_seq(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        seq.num_pending = 0  # a token still in flight for it is dropped when it arrives
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free_seq(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            if seq.cpu_blocks:  # a long-context sequence swapped out by preemption
                self.block_manager.free_seq(seq)
        seq.status = SeqStatus.FINISHED

    def abort_request(self, request: Request) -> list[Sequence]:
        aborted = [s for s in request.seqs if not s.is_finished]
        for seq in aborted:
            self.finish(seq)
        return aborted
