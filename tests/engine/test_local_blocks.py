"""The sliding-window layers' KV pool (engine/local_blocks.py) under BlockManager: blocks out of the window go back as
a sequence grows, admission needs room in both pools, a prefix hit is cut to what the window pool still holds, and
freeing a sequence gives back both pools' blocks."""

import random

import pytest

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.local_blocks import NULL_BLOCK, LocalBlocks
from nanoserve.engine.request import Request, Sequence
from nanoserve.sampling_params import SamplingParams

BS, W = 4, 10
WINDOW_BLOCKS = -(-(W - 1) // BS) + 2  # the window's blocks, cut by block boundaries, and the next token's


def new_seq(tokens: list[int]) -> Sequence:
    request = Request("r", None, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    return Sequence(request, 0, list(tokens), len(tokens), detokenizer=None)


def pools(num_global: int = 64, num_local: int = 64) -> tuple[BlockManager, LocalBlocks]:
    local = LocalBlocks(num_local, BS, W, enable_prefix_caching=True)
    return BlockManager(num_global, BS, enable_prefix_caching=True, local=local), local


def test_window_blocks_stay_bounded_while_a_sequence_decodes():
    bm, local = pools()
    seq = new_seq(list(range(7)))
    bm.allocate(seq, 7, bm.match_prefix(seq))
    seq.num_computed_tokens = 7
    for token in range(100):
        seq.token_ids.append(token)
        assert bm.append_slot(seq)
        seq.num_computed_tokens += 1
        assert local.blocks_in_use(seq) <= WINDOW_BLOCKS
        assert len(seq.local_table) == len(seq.block_table)
    first = local.first_visible(seq.num_computed_tokens)
    assert seq.local_table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in seq.local_table[first:]
    assert len(seq.block_table) == -(-107 // BS)  # the global layers keep every block
    bm.free_seq(seq)
    assert local.num_free_blocks == 63 and bm.num_free_blocks == 64


def test_a_chunk_needs_room_in_both_pools():
    bm, local = pools(num_local=5)  # 4 blocks besides the null one
    seq = new_seq(list(range(40)))
    assert not bm.can_allocate(seq, 17)  # 5 window blocks: the global pool alone would take it
    bm.allocate(seq, 16)
    seq.num_computed_tokens = 16
    assert local.num_free_blocks == 0
    # The next query (position 16) sees positions 7-16: block 0 (positions 0-3) goes back and holds position 16.
    assert bm.can_allocate(seq, 1)
    bm.allocate(seq, 1)
    assert seq.local_table[0] == NULL_BLOCK and len(seq.local_table) == 5 and local.num_free_blocks == 0
    assert bm.usage == 1.0  # the window pool is full: kv usage is the fuller pool's


def test_prefix_hits_are_cut_to_the_window_blocks_still_cached():
    bm, local = pools()
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(40)]
    first = new_seq(prompt)
    bm.allocate(first, 40)
    first.num_computed_tokens = 40
    bm.cache_full_blocks(first)
    bm.free_seq(first)

    hit = bm.match_prefix(new_seq(prompt + [1, 2, 3, 4]))
    # 10 blocks hit; the next query (position 40) sees blocks 7-9, all cached in the window pool.
    assert len(hit.gpu) == 10
    assert hit.local == [NULL_BLOCK] * 7 + [local.cached[h] for h in first.block_hashes[7:10]]

    del local.cached[first.block_hashes[8]]  # evicted from the window pool
    second = new_seq(prompt + [1, 2, 3, 4])
    hit = bm.match_prefix(second)
    # Block 8 is gone: a hit may reach block 7 at most, whose next query (position 32) sees blocks 5-7.
    assert len(hit.gpu) == 8 and hit.local[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in hit.local[5:]
    bm.allocate(second, 44 - 32, hit)
    assert second.num_computed_tokens == 32 and second.local_table[:8] == hit.local
    assert all(local.ref_count[b] == 1 for b in hit.local[5:])


def test_blocks_out_of_the_window_are_named_for_later_hits():
    """A prompt prefilled in chunks gives back its early blocks part way; named as they go, a later prompt with the
    same prefix still hits them."""
    bm, local = pools()
    prompt = list(range(100, 140))
    seq = new_seq(prompt)
    bm.match_prefix(seq)  # hashes the prompt's blocks, as the scheduler's admission does
    for start in range(0, 40, 8):
        bm.allocate(seq, 8)
        seq.num_computed_tokens = start + 8
    bm.allocate(seq, 0)  # releases what position 40 cannot see
    assert seq.local_table[:7] == [NULL_BLOCK] * 7
    assert all(h in local.cached for h in seq.block_hashes[:7])


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_both_pools_consistent(seed):
    """The real Scheduler over both pools, small enough to preempt often, with shared prefixes and n > 1: after every
    step each window block's reference count is the number of tables holding it, the free queue holds exactly the
    unreferenced ones, the blocks a sequence's next queries see are all there, and each holds a window's worth."""
    from nanoserve.engine.detokenizer import IncrementalDetokenizer
    from nanoserve.engine.scheduler import Scheduler

    rng = random.Random(seed)
    local = LocalBlocks(14, BS, W, enable_prefix_caching=True)
    bm = BlockManager(40, BS, enable_prefix_caching=True, local=local)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=16)
    heads = [[rng.randrange(2, 1000) for _ in range(24)] for _ in range(3)]
    live: list[Sequence] = []
    for i in range(40):
        prompt = rng.choice(heads)[: rng.randrange(0, 25)] + [
            rng.randrange(2, 1000) for _ in range(rng.randrange(1, 30))
        ]
        n, max_tokens = rng.choice([1, 1, 2, 3]), rng.randrange(1, 25)
        request = Request(
            f"r{i}",
            None,
            prompt,
            SamplingParams(n=n, max_tokens=max_tokens),
            max_tokens=max_tokens,
            arrival_time=float(i),
        )
        first, *request.unforked = [
            Sequence(request, j, list(prompt), len(prompt), IncrementalDetokenizer(None, prompt, True, []))
            for j in range(n)
        ]
        request.seqs.append(first)
        sched.add(first)
    for _ in range(2000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        for entry in out.scheduled:
            seq = entry.seq
            seq.request.metrics.first_scheduled_time = 0.0
            assert len(seq.local_table) == len(seq.block_table)
            assert local.blocks_in_use(seq) <= -(-(W - 1 + entry.num_new_tokens) // BS) + 1
        live = [s for s in sched.running + sched.waiting if s.local_table]
        for s in live:
            first = local.first_visible(s.num_computed_tokens)
            assert NULL_BLOCK not in s.local_table[first:]
        refs = [0] * local.num_blocks
        for s in live:
            for b in s.local_table:
                refs[b] += b != NULL_BLOCK
        assert refs[1:] == local.ref_count[1:]
        assert set(local.free) == {b for b in range(1, local.num_blocks) if refs[b] == 0}
        for entry in out.scheduled:
            bm.cache_full_blocks(entry.seq)
            for s in entry.sample_seqs:
                s.token_ids.append(rng.randrange(2, 1000))
                if s.num_output_tokens >= s.request.max_tokens:
                    sched.finish(s)
    assert not sched.has_unfinished and sched.num_preemptions > 0 and bm.prefix_hits > 0
    assert local.num_free_blocks == local.num_blocks - 1 and bm.num_free_blocks == bm.num_blocks
