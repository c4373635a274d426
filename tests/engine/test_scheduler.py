"""The Scheduler and BlockManager driven directly, with no model: a small stand-in engine launches each
step (every sample gets a pending token) and reads it back (the token is appended, the step's full blocks
are offered to the prefix cache), as LLMEngine.step does."""

import itertools
import random

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.request import Request, SeqStatus, Sequence
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.sampling_params import SamplingParams

BS = 4
_arrivals = itertools.count()


def make_request(prompt: list[int], *, n: int = 1, max_tokens: int = 8, priority: int = 0,
                 request_id: str = "r") -> Request:
    """A request built as LLMEngine.add_request builds one: sample 0 in seqs, samples 1..n-1 unforked."""
    params = SamplingParams(n=n, max_tokens=max_tokens)
    request = Request(request_id, None, list(prompt), params, max_tokens=max_tokens, priority=priority,
                      arrival_time=float(next(_arrivals)))  # strictly increasing: a test's add order
    first, *request.unforked = [
        Sequence(request, i, list(prompt), len(prompt), IncrementalDetokenizer(None, prompt, True, []))
        for i in range(n)]
    request.seqs.append(first)
    return request


def generated(seq: Sequence, position: int) -> int:
    """The token a sample 'samples' for a position: fixed, so that a test knows it before it arrives."""
    return 500 + 37 * seq.index + position


class Harness:
    """A synchronous engine without a model: step() schedules, launches and reads back one step."""

    def __init__(self, num_blocks: int = 64, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 prefix_caching: bool = True) -> None:
        self.bm = BlockManager(num_blocks, BS, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)

    def add(self, prompt: list[int], **kwargs) -> Request:
        request = make_request(prompt, **kwargs)
        self.sched.add(request.seqs[0])
        return request

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for entry in out.scheduled:
            metrics = entry.seq.request.metrics
            if metrics.first_scheduled_time is None:  # as LLMEngine._launch records it
                metrics.first_scheduled_time = 0.0
            for s in entry.sample_seqs:
                s.num_pending += 1
        for entry in out.scheduled:
            self.bm.cache_full_blocks(entry.seq)
            for s in entry.sample_seqs:
                if s.is_finished:
                    continue
                s.num_pending -= 1
                s.token_ids.append(generated(s, len(s.token_ids)))
                if s.num_output_tokens >= s.request.max_tokens:
                    self.sched.finish(s)
        return out

    def run_to_end(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished:
                return
            self.step()
        raise AssertionError("the scheduler made no progress")


def tokens(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, num_new_tokens) of each scheduled entry, in order."""
    return [(e.seq.request.request_id, e.start, e.num_new_tokens) for e in out.scheduled]


# -- the token budget ---------------------------------------------------------------------------------
def test_decodes_come_first_then_prefill_chunks_within_the_budget():
    h = Harness(max_num_batched_tokens=10)
    h.add(tokens(3), request_id="a", priority=1)
    h.add(tokens(4, 10), request_id="b", priority=1)
    h.step()  # both prompts prefilled: a and b decode from now on
    h.add(tokens(12, 100), request_id="p", priority=0)  # runs before them once admitted
    out = h.step()
    assert plan(out) == [("a", 3, 1), ("b", 4, 1), ("p", 0, 8)]  # decodes first, the rest of the budget
    out = h.step()
    # p now sorts first in running and is given its chunk first, yet the decodes lead the step's list.
    assert plan(out) == [("a", 4, 1), ("b", 5, 1), ("p", 8, 4)]
    assert out.num_decodes == 2 and sum(e.num_new_tokens for e in out.scheduled) == 6


def test_running_sequences_spend_the_budget_in_priority_order():
    h = Harness(max_num_batched_tokens=10)
    h.add(tokens(3), request_id="a", priority=1)
    h.step()
    h.add(tokens(30, 100), request_id="p", priority=0)
    h.step()  # a decodes, p gets the other 9 tokens
    out = h.step()
    # A higher-priority prompt's chunk comes before a lower-priority decode, which waits for its turn.
    assert plan(out) == [("p", 9, 10)]
    assert sum(e.num_new_tokens for e in out.scheduled) == 10


def test_a_long_prompt_is_chunked_and_computed_tokens_advance_by_each_chunk():
    h = Harness(max_num_batched_tokens=8)
    request = h.add(tokens(23), max_tokens=2)
    seq = request.seqs[0]
    for start, chunk in [(0, 8), (8, 8), (16, 7)]:
        out = h.step()
        [entry] = out.scheduled
        assert (entry.start, entry.num_new_tokens) == (start, chunk)
        assert seq.num_computed_tokens == start + chunk
        assert len(seq.block_table) == h.bm.blocks_needed(start + chunk)
        # Nothing is sampled until the prompt's last chunk.
        assert entry.sample_seqs == ([seq] if start + chunk == 23 else [])
        assert seq.num_output_tokens == (1 if start + chunk == 23 else 0)
    [entry] = h.step().scheduled
    assert (entry.start, entry.num_new_tokens) == (23, 1)
    assert seq.is_finished and not h.sched.has_unfinished


def test_the_budget_is_never_exceeded_when_it_runs_out_among_decodes():
    h = Harness(max_num_batched_tokens=3)
    for i in range(5):
        h.add([i + 1], request_id=f"r{i}", max_tokens=4)  # one-token prompts: every entry is one token
    counts = []
    while h.sched.has_unfinished:
        counts.append(len(h.step().scheduled))
    assert max(counts) == 3 and sum(counts) == 5 * 4


def test_max_num_seqs_counts_every_sample_of_a_request_forked_or_not():
    h = Harness(max_num_seqs=4)
    a = h.add(tokens(5), request_id="a", n=3, max_tokens=2)
    b = h.add(tokens(5, 50), request_id="b", n=2, max_tokens=2)
    c = h.add(tokens(5, 90), request_id="c", n=2, max_tokens=2)
    out = h.step()
    # a forks to 3 samples within the step; b is one sequence now but two once its prompt is prefilled
    # (3 + 2 > 4), so it waits, and c, behind it in the queue, with it.
    assert plan(out) == [("a", 0, 5)] and h.sched.running == a.seqs and len(a.seqs) == 3
    assert h.sched.waiting == [b.seqs[0], c.seqs[0]]
    h.step()  # a's samples take their last token and finish
    out = h.step()
    # b forks in this step; then c, 2 + 2 samples, just fits.
    assert plan(out) == [("b", 0, 5), ("c", 0, 5)]
    assert h.sched.running == b.seqs + c.seqs and len(h.sched.running) == 4
    h.run_to_end()
    assert h.bm.num_free_blocks == h.bm.num_blocks


# -- admission --------------------------------------------------------------------------------------
def test_waiting_requests_are_admitted_in_priority_then_arrival_order():
    h = Harness(max_num_batched_tokens=64)
    for rid, priority in [("late-low", 2), ("first-mid", 1), ("second-mid", 1), ("high", 0)]:
        h.add(tokens(3), request_id=rid, priority=priority)
    out = h.step()
    assert [e.seq.request.request_id for e in out.scheduled] == ["high", "first-mid", "second-mid", "late-low"]
    assert [s.request.request_id for s in h.sched.running] == ["high", "first-mid", "second-mid", "late-low"]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    h.add(tokens(9), request_id="big", max_tokens=3)  # 3 blocks: 1 left
    h.step()
    h.add(tokens(8, 30), request_id="next", max_tokens=1)  # 2 blocks: not there
    h.add(tokens(2, 60), request_id="small", max_tokens=1)  # 1 block would be, but it is behind `next`
    out = h.step()
    assert plan(out) == [("big", 9, 1)]
    assert [s.request.request_id for s in h.sched.waiting] == ["next", "small"]


def test_nothing_is_admitted_in_a_step_that_preempted():
    h = Harness(num_blocks=3, max_num_batched_tokens=64)
    a = h.add(tokens(4), request_id="a", priority=0, max_tokens=8)
    b = h.add(tokens(4, 20), request_id="b", priority=1, max_tokens=8)
    h.step()  # both prompts, one block each
    h.add([99], request_id="tiny", priority=0, max_tokens=1)
    out = h.step()
    # a and b each need a second block and one is free: a takes it, b is preempted, and `tiny` (which
    # would fit in b's freed block) is not admitted in this step.
    assert plan(out) == [("a", 4, 1)]
    assert b.seqs[0].status == SeqStatus.WAITING and h.sched.num_preemptions == 1
    assert [s.request.request_id for s in h.sched.waiting] == ["tiny", "b"]
    assert a.seqs[0].status == SeqStatus.RUNNING
    out = h.step()
    assert ("tiny", 0, 1) in plan(out)


def test_a_prompt_starts_after_its_cached_full_blocks():
    h = Harness()
    first = h.add(tokens(10), request_id="first", max_tokens=1)
    h.run_to_end()  # its two full blocks stay in the cache, parked in the free queue
    cached = [h.bm.cached[x] for x in first.seqs[0].block_hashes[:2]]
    shared = h.add(tokens(9) + [77, 78], request_id="shared")  # 2 full blocks + 1 token
    exact = h.add(tokens(8), request_id="exact")  # its last token is computed all the same
    out = h.step()
    assert plan(out) == [("shared", 8, 3), ("exact", 4, 4)]
    assert shared.seqs[0].block_table[:2] == cached and exact.seqs[0].block_table[:1] == cached[:1]
    assert (shared.seqs[0].num_cached_tokens, exact.seqs[0].num_cached_tokens) == (8, 4)
    assert (h.bm.prefix_queries, h.bm.prefix_hits) == (10 + 11 + 8, 8 + 4)


# -- preemption ---------------------------------------------------------------------------------------
def test_the_lowest_priority_running_sequence_is_preempted():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    high = h.add(tokens(4), request_id="high", priority=0)
    mid = h.add(tokens(3, 20), request_id="mid", priority=1)  # its next token still fits in its block
    low = h.add(tokens(4, 40), request_id="low", priority=2)
    h.step()
    assert h.bm.num_free_blocks == 1
    filler = make_request([7]).seqs[0]
    h.bm.allocate(filler, 1)  # the pool's last block, held elsewhere
    low_blocks = list(low.seqs[0].block_table)
    h.add(tokens(2, 80), request_id="newcomer", priority=2)  # same priority as low, arrived after it
    out = h.step()
    assert plan(out) == [("high", 4, 1), ("mid", 3, 1)]
    seq = low.seqs[0]
    assert seq.status == SeqStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
    assert seq.token_ids == tokens(4, 40) + [generated(seq, 4)]  # what it generated is kept
    assert high.seqs[0].block_table[1] == low_blocks[0]  # high got the freed block
    assert h.bm.blocks[low_blocks[0]].ref_count == 1
    assert h.sched.num_preemptions == 1
    assert h.sched.waiting[0] is seq  # ahead of a later arrival of its priority
    assert mid.seqs[0].status == SeqStatus.RUNNING
    h.bm.free_seq(filler)
    h.run_to_end()
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_a_sequence_preempts_itself_when_it_is_the_lowest_priority():
    h = Harness(num_blocks=2, max_num_batched_tokens=64)
    high = h.add(tokens(3), request_id="high", priority=0)
    low = h.add(tokens(4, 20), request_id="low", priority=1)
    h.step()
    out = h.step()  # high writes position 3 in its block; low needs a second block and none is free
    assert plan(out) == [("high", 3, 1)]
    assert low.seqs[0].status == SeqStatus.WAITING and h.sched.num_preemptions == 1
    assert h.bm.num_free_blocks == 1
    out = h.step()  # high's position 4 takes the block low gave up; low waits for room
    assert plan(out) == [("high", 4, 1)] and high.seqs[0].block_table[1] not in h.bm.free
    assert h.sched.waiting == [low.seqs[0]]


def test_a_preempted_sequence_is_recomputed_from_its_cached_blocks():
    h = Harness(num_blocks=5, max_num_batched_tokens=64)
    high = h.add(tokens(8), request_id="high", priority=0, max_tokens=4)
    low = h.add(tokens(6, 50), request_id="low", priority=1, max_tokens=8)
    seq = low.seqs[0]
    for _ in range(3):
        h.step()  # high takes the last free block; low computes its 8th token: 2 full blocks, cached
    old_blocks = list(seq.block_table)
    assert h.bm.num_free_blocks == 0 and seq.num_cached_blocks == 2
    out = h.step()  # low's position 8 needs a block: it gives its own up; high then finishes
    assert plan(out) == [("high", 10, 1)] and high.seqs[0].is_finished
    assert h.sched.num_preemptions == 1 and seq.status == SeqStatus.WAITING
    queries, hits = h.bm.prefix_queries, h.bm.prefix_hits
    out = h.step()
    # Its 9 tokens' KV is rebuilt from the two full blocks it left in the cache: only the last is computed.
    assert plan(out) == [("low", 8, 1)]
    assert seq.block_table[:2] == old_blocks[:2] and seq.num_computed_tokens == 9
    # Hit statistics count a prompt at its first admission only.
    assert (h.bm.prefix_queries, h.bm.prefix_hits) == (queries, hits)
    h.run_to_end()
    assert seq.output_token_ids == [generated(seq, p) for p in range(6, 14)]
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_a_preempted_sequence_whose_tail_block_was_evicted_recomputes_from_its_head_block():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    high = h.add(tokens(4), request_id="high", priority=0, max_tokens=9)
    low = h.add(tokens(8, 50), request_id="low", priority=1, max_tokens=4)
    seq = low.seqs[0]
    h.step()  # high: 1 block, low: 2 full blocks (cached); 1 left
    head, tail = seq.block_table
    h.step()  # high takes the last block; low needs one for position 8 and gives its own up
    assert seq.status == SeqStatus.WAITING and list(h.bm.free) == [tail, head]  # tail freed first
    while len(high.seqs[0].block_table) < 3:
        h.step()  # low's 2 parked hits + 1 block do not fit in 2 free blocks: it waits
    # high's third block was the least recently freed one: low's tail, evicted from the cache.
    assert high.seqs[0].block_table[2] == tail and len(h.bm.match_prefix(seq)) == 1
    while seq.status == SeqStatus.WAITING:
        out = h.step()
    assert high.seqs[0].is_finished
    assert plan(out) == [("low", 4, 5)] and seq.block_table[0] == head


# -- n > 1 ----------------------------------------------------------------------------------------------
def test_samples_fork_when_the_prompt_prefill_ends_and_share_its_blocks():
    h = Harness(max_num_batched_tokens=4)
    request = h.add(tokens(10), n=3, max_tokens=4)
    parent = request.seqs[0]
    for _ in range(2):  # chunks of 4 and 4: no fork yet
        out = h.step()
        assert h.sched.running == [parent] and len(request.unforked) == 2
        assert out.scheduled[0].sample_seqs == []
    free_before = h.bm.num_free_blocks
    out = h.step()  # the last 2 prompt tokens
    [entry] = out.scheduled
    assert entry.num_new_tokens == 2 and not request.unforked
    assert entry.sample_seqs == request.seqs and len(request.seqs) == 3
    assert h.sched.running == request.seqs
    for child in request.seqs[1:]:
        assert child.status == SeqStatus.RUNNING and child.num_computed_tokens == 10
        assert child.block_table == parent.block_table
    assert [h.bm.blocks[b].ref_count for b in parent.block_table] == [3, 3, 3]
    assert h.bm.num_free_blocks == free_before - 1  # the third block only: forking takes none
    assert out.block_copies == []
    # The next step writes position 10, in the shared partial block: two samples copy it, the last one
    # (then its only holder) writes it in place.
    shared = parent.block_table[2]
    out = h.step()
    assert [e.num_new_tokens for e in out.scheduled] == [1, 1, 1]
    assert len(out.block_copies) == 2 and {src for src, _ in out.block_copies} == {shared}
    last_blocks = [s.block_table[2] for s in request.seqs]
    assert len(set(last_blocks)) == 3 and shared in last_blocks
    assert {dst for _, dst in out.block_copies} == set(last_blocks) - {shared}
    assert [h.bm.blocks[b].ref_count for b in parent.block_table[:2]] == [3, 3]
    assert all(h.bm.blocks[b].ref_count == 1 for b in last_blocks)
    h.run_to_end()
    assert [s.output_token_ids for s in request.seqs] == [
        [generated(s, p) for p in range(10, 14)] for s in request.seqs]
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_forks_of_a_block_aligned_prompt_need_no_copy():
    h = Harness()
    request = h.add(tokens(8), n=2, max_tokens=3)
    h.step()
    out = h.step()  # position 8 starts a new block for each sample
    assert out.block_copies == []
    first, second = request.seqs
    assert first.block_table[:2] == second.block_table[:2] and first.block_table[2] != second.block_table[2]
    assert [h.bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]


def test_a_request_preempted_before_its_prefill_ends_still_forks_all_its_samples():
    h = Harness(num_blocks=4, max_num_batched_tokens=4)
    h.add(tokens(4, 50), request_id="high", priority=0, max_tokens=9)
    wide = h.add(tokens(12), request_id="wide", priority=1, n=2, max_tokens=2)
    while not h.sched.num_preemptions:
        h.step()  # wide's prompt comes in chunks of 3 until its third block is not there
    assert wide.seqs[0].status == SeqStatus.WAITING and len(wide.unforked) == 1
    h.run_to_end()
    assert len(wide.seqs) == 2 and all(len(s.output_token_ids) == 2 for s in wide.seqs)
    assert h.bm.num_free_blocks == h.bm.num_blocks


def test_prefix_stats_count_a_prompt_preempted_in_its_prefill_once():
    h = Harness(num_blocks=4, max_num_batched_tokens=4)
    h.add(tokens(4, 50), request_id="high", priority=0, max_tokens=9)
    long = h.add(tokens(12), request_id="long", priority=1, max_tokens=1)
    h.run_to_end()
    assert h.sched.num_preemptions >= 1 and long.seqs[0].is_finished
    # Its own blocks, found in the cache when it came back, are neither hits nor cached tokens.
    assert (h.bm.prefix_queries, h.bm.prefix_hits) == (4 + 12, 0)
    assert long.seqs[0].num_cached_tokens == 0


def test_samples_forked_in_a_step_are_not_preempted_before_lower_priority_sequences():
    h = Harness(num_blocks=3, max_num_batched_tokens=5)
    low = h.add(tokens(3, 50), request_id="low", priority=1)
    h.step()  # low's prompt: block 0; it decodes position 3 next, in that block
    wide = h.add(tokens(6), request_id="wide", priority=0, n=3)
    h.step()  # low decodes; wide's first chunk (4 tokens): one block, one left
    out = h.step()  # wide's prompt ends (takes the last block) and forks; low needs a block at position 4
    assert plan(out) == [("wide", 4, 2)]
    assert [s.status for s in wide.seqs] == [SeqStatus.RUNNING] * 3
    assert low.seqs[0].status == SeqStatus.WAITING
    assert h.sched.num_preemptions == 1


# -- finish and abort -------------------------------------------------------------------------------------
def test_finish_and_abort_free_every_block():
    h = Harness(num_blocks=16)
    request = h.add(tokens(6), request_id="a", n=3, max_tokens=10)
    waiting = h.add(tokens(60, 100), request_id="w", max_tokens=1)  # 15 blocks: stays waiting
    h.step()
    h.step()
    first, second, third = request.seqs
    shared = first.block_table[0]
    assert h.bm.blocks[shared].ref_count == 3
    h.sched.finish(second)
    assert second.is_finished and second.block_table == [] and second not in h.sched.running
    assert h.bm.blocks[shared].ref_count == 2
    third.num_pending = 1  # a token in flight for it is dropped
    aborted = h.sched.abort_request(request)
    assert aborted == [first, third] and all(s.is_finished for s in request.seqs)
    assert third.num_pending == 0
    assert h.sched.running == [] and h.bm.num_free_blocks == h.bm.num_blocks
    assert h.sched.abort_request(waiting) == waiting.seqs and h.sched.waiting == []
    assert not h.sched.has_unfinished


def test_a_sequence_whose_last_token_is_in_flight_is_not_scheduled_again():
    h = Harness()
    request = h.add(tokens(5), max_tokens=2)
    h.step()
    seq = request.seqs[0]
    seq.num_pending = 1  # its second (last) token sampled by a launched step, not read back yet
    assert h.sched.schedule().scheduled == []
    seq.num_pending = 0
    assert plan(h.sched.schedule()) == [("r", 5, 1)]


# -- a random workload -------------------------------------------------------------------------------------
class Simulation:
    """Random requests (shared prefixes, priorities, n > 1, aborts, stop tokens) under a tight KV pool,
    with async scheduling or without. It keeps a model of the KV pool's contents: every scheduled
    position writes its token into its block (after the step's block copies), and each running sample
    must read back exactly its own tokens for every position it has computed."""

    STOP = 0

    def __init__(self, seed: int, async_scheduling: bool) -> None:
        self.rng = random.Random(seed)
        self.async_scheduling = async_scheduling
        self.budget = self.rng.choice([6, 16, 64])
        self.bm = BlockManager(self.rng.choice([12, 16, 40]), BS, enable_prefix_caching=True)
        self.sched = Scheduler(self.bm, max_num_seqs=self.rng.choice([3, 6]), max_num_batched_tokens=self.budget)
        self.kv: dict[int, list[int | None]] = {}
        self.requests: list[Request] = []
        self.system = [self.rng.randrange(1, 20) for _ in range(9)]

    def token_at(self, seq: Sequence, position: int) -> int:
        if position < len(seq.token_ids):
            return seq.token_ids[position]
        # Sampled, not read back yet: known here (the runner reads it on the device).
        key = (int(seq.request.request_id[1:]) * 1000003 + seq.index * 7919 + position * 131) * 2654435761
        return (key >> 11) % 30

    def add_random_request(self, i: int) -> None:
        n = self.rng.choice([1, 1, 1, 2, 3])
        n = min(n, self.sched.max_num_seqs)
        prompt = self.system[:self.rng.randrange(10)] + [self.rng.randrange(1, 30) for _ in
                                                         range(self.rng.randrange(1, 14))]
        request = make_request(prompt, n=n, max_tokens=self.rng.randrange(1, 10), request_id=f"q{i}",
                               priority=self.rng.randrange(3))
        self.requests.append(request)
        self.sched.add(request.seqs[0])

    def schedule_and_launch(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check_step(out)
        for src, dst in out.block_copies:
            self.kv[dst] = list(self.kv[src])
        for e in out.scheduled:
            for p in range(e.start, e.start + e.num_new_tokens):
                self.kv.setdefault(e.seq.block_table[p // BS], [None] * BS)[p % BS] = self.token_at(e.seq, p)
            for s in e.sample_seqs:
                s.num_pending += 1
        self.check_pool()
        return out

    def read_back(self, out: SchedulerOutput) -> None:
        for e in out.scheduled:
            if e.seq.request.aborted:
                continue
            self.bm.cache_full_blocks(e.seq)
            for s in e.sample_seqs:
                if s.is_finished:
                    continue
                token = self.token_at(s, len(s.token_ids))
                s.num_pending -= 1
                s.token_ids.append(token)
                if token == self.STOP or s.num_output_tokens - s.num_pending >= s.request.max_tokens:
                    self.sched.finish(s)

    def abort(self, request: Request) -> None:
        self.sched.abort_request(request)
        request.aborted = True

    def check_step(self, out: SchedulerOutput) -> None:
        sizes = [e.num_new_tokens for e in out.scheduled]
        assert sum(sizes) <= self.budget
        assert sizes == sorted(sizes, key=lambda k: k > 1)  # decodes first
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for e in out.scheduled:
            assert e.seq.status == SeqStatus.RUNNING
            assert e.start + e.num_new_tokens == e.seq.num_computed_tokens <= e.seq.num_tokens
            # No block is written while another sequence reads it, but for the samples forked from
            # this very entry (they read it after this step).
            written = {e.seq.block_table[p // BS] for p in range(e.start, e.start + e.num_new_tokens)}
            readers = [s for s in self.sched.running if written & set(s.block_table)]
            assert set(readers) <= {e.seq, *e.sample_seqs}
            assert all(self.bm.blocks[b].ref_count == len(readers) for b in written)

    def check_pool(self) -> None:
        refs = [0] * self.bm.num_blocks
        for seq in self.sched.running:
            assert len(seq.block_table) == self.bm.blocks_needed(seq.num_computed_tokens)
            for b in seq.block_table:
                refs[b] += 1
            for p in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[p // BS]][p % BS] == self.token_at(seq, p)
        for seq in self.sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert refs == [b.ref_count for b in self.bm.blocks]
        assert set(self.bm.free) == {i for i, r in enumerate(refs) if r == 0}
        for h, b in self.bm.cached.items():
            assert self.bm.blocks[b].block_hash == h

    def run(self, num_requests: int = 14) -> None:
        pending = list(range(num_requests))
        in_flight = None
        for _ in range(2000):
            if pending and self.rng.random() < 0.4:
                self.add_random_request(pending.pop(0))
            live = [r for r in self.requests if not r.aborted and not r.finished]
            if live and self.rng.random() < 0.03:
                self.abort(self.rng.choice(live))
            out = self.schedule_and_launch()
            if in_flight is not None:
                self.read_back(in_flight)
                in_flight = None
            if self.async_scheduling:
                in_flight = out if out.scheduled else None
            else:
                self.read_back(out)
            if not pending and in_flight is None and not self.sched.has_unfinished:
                break
        else:
            raise AssertionError("the workload did not finish")
        assert self.bm.num_free_blocks == self.bm.num_blocks
        for request in self.requests:
            assert request.aborted or request.finished
            if not request.aborted:
                assert len(request.seqs) == request.params.n
                for s in request.seqs:
                    out = s.output_token_ids
                    assert 1 <= len(out) <= request.max_tokens
                    assert len(out) == request.max_tokens or out[-1] == self.STOP


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_the_pool_consistent(seed, async_scheduling):
    sim = Simulation(seed, async_scheduling)
    sim.run()
