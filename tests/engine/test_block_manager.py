"""The BlockManager: the prefix cache's look-up (hits by hash chain, checked token by token), what enters
the cache, LRU eviction, allocation accounting and forks."""

import random

import pytest

from nanoserve.engine import block_manager
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.request import Request, Sequence
from nanoserve.sampling_params import SamplingParams

BS = 4


def new_seq(tokens: list[int]) -> Sequence:
    request = Request("r", None, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    return Sequence(request, 0, list(tokens), len(tokens), detokenizer=None)


def fill(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A request that computed its whole prompt, named its blocks in the cache and finished."""
    seq = new_seq(tokens)
    bm.allocate(seq, len(tokens), bm.match_prefix(seq))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    bm.free_seq(seq)
    return seq


def test_hits_are_the_longest_shared_prefix_less_the_last_token():
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    rng = random.Random(0)
    shared = [rng.randrange(1000) for _ in range(5 * BS)]
    first = fill(bm, shared + [1, 2, 3])
    cached = [bm.cached[h] for h in first.block_hashes[:5]]
    assert bm.match_prefix(new_seq(shared + [7, 8])).gpu == cached
    assert bm.match_prefix(new_seq(shared[:3 * BS] + [9] + shared[3 * BS + 1:])).gpu == cached[:3]
    assert bm.match_prefix(new_seq(shared)).gpu == cached[:4]  # the last token is always computed
    assert bm.match_prefix(new_seq([5] + shared[1:])).gpu == []


def test_hashes_do_not_depend_on_how_the_blocks_were_hashed():
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    tokens = list(range(100, 100 + 9 * BS + 2))
    at_once = new_seq(tokens)
    bm.match_prefix(at_once)
    piecewise = new_seq(tokens)
    for num_full in (1, 4, 9):
        bm._extend_hashes(piecewise, num_full)
    assert piecewise.block_hashes == at_once.block_hashes
    assert len(set(at_once.block_hashes)) == 9


def test_hash_collision_is_not_a_hit(monkeypatch):
    # Every block hashes alike: only the token check tells them apart.
    monkeypatch.setattr(block_manager, "chain_hash", lambda prev, data: 42)
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    fill(bm, [1, 2, 3, 4, 5])
    assert len(bm.match_prefix(new_seq([1, 2, 3, 4, 9]))) == 1
    assert bm.match_prefix(new_seq([1, 2, 3, 5, 9])).gpu == []
    # The cache holds one block per hash: a second block of hash 42 with other tokens is no hit either.
    assert len(bm.match_prefix(new_seq([1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 1


# -- allocation, eviction, forks ------------------------------------------------------------------------
def span(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Admit seq (with its prefix hits), compute num_tokens of it and name its full blocks."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    prefix = bm.match_prefix(seq)
    bm.allocate(seq, num_tokens - len(prefix) * BS, prefix)
    seq.num_computed_tokens = num_tokens
    bm.cache_full_blocks(seq)


def test_only_computed_full_blocks_enter_the_cache():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    seq = new_seq(span(14))
    compute(bm, seq, 6)  # one full block computed
    assert len(bm.cached) == 1 and bm.blocks[seq.block_table[0]].block_hash is not None
    assert bm.blocks[seq.block_table[1]].block_hash is None
    bm.allocate(seq, 8)
    seq.num_computed_tokens = 14
    bm.cache_full_blocks(seq)
    assert len(bm.cached) == 3 and seq.num_cached_blocks == 3  # the partial fourth block is not named
    blocks = list(seq.block_table)
    assert set(bm.cached.values()) == set(blocks[:3])
    bm.free_seq(seq)
    assert bm.match_prefix(new_seq(span(14))).gpu == blocks[:3]


def test_no_prefix_caching_means_no_hits_and_no_names():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = new_seq(span(9))
    compute(bm, seq)
    bm.free_seq(seq)
    assert bm.cached == {} and bm.match_prefix(new_seq(span(9))).gpu == []
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


def test_prompt_logprobs_requests_skip_the_cache():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    compute(bm, new_seq(span(9)))
    request = Request("lp", None, span(9), SamplingParams(prompt_logprobs=1, max_tokens=1), max_tokens=1)
    assert bm.match_prefix(Sequence(request, 0, span(9), 9, None)).gpu == []


def test_a_hit_shares_the_blocks_and_is_counted():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    first = new_seq(span(10))
    compute(bm, first)
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    second = new_seq(span(8) + [77, 78, 79])
    prefix = bm.match_prefix(second)
    assert prefix.gpu == first.block_table[:2]
    free = bm.num_free_blocks
    bm.allocate(second, 3, prefix)
    assert (bm.prefix_queries, bm.prefix_hits) == (21, 8)
    assert second.num_computed_tokens == 8 and second.num_cached_blocks == 2
    assert second.block_table[:2] == prefix.gpu and bm.num_free_blocks == free - 1  # one new block, none for the hits
    assert [bm.blocks[b].ref_count for b in prefix.gpu] == [2, 2]
    bm.free_seq(first)
    assert [bm.blocks[b].ref_count for b in prefix.gpu] == [1, 1] and prefix.gpu[0] not in bm.free
    bm.free_seq(second)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_hit_on_a_freed_block_takes_it_out_of_the_free_queue():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    first = new_seq(span(9))
    compute(bm, first)
    bm.free_seq(first)
    assert bm.num_free_blocks == 4
    # The same 8 tokens then 9 more: 3 new blocks fit in 4 free ones, but the 2 parked hits come from
    # the free queue too.
    longer = new_seq(span(17))
    prefix = bm.match_prefix(longer)
    assert len(prefix) == 2 and not bm.can_allocate(longer, 9, prefix)
    fits = new_seq(span(9))
    prefix = bm.match_prefix(fits)
    assert len(prefix) == 2 and bm.can_allocate(fits, 1, prefix)
    bm.allocate(fits, 1, prefix)
    assert bm.num_free_blocks == 1 and all(b not in bm.free for b in prefix.gpu)


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b = new_seq(span(9, 100)), new_seq(span(9, 200))  # 3 blocks each: 2 full (cached), 1 partial
    compute(bm, a)
    compute(bm, b)
    bm.free_seq(a)
    bm.free_seq(b)
    again = new_seq(span(9, 100))  # a's prompt once more: its blocks become the most recently freed
    compute(bm, again)
    bm.free_seq(again)

    def hits(start: int) -> int:
        return len(bm.match_prefix(new_seq(span(9, start))))

    assert (hits(100), hits(200)) == (2, 2) and bm.num_free_blocks == 6
    taker = new_seq(span(6 * BS, 900))

    def take(num_blocks: int) -> None:
        bm.allocate(taker, num_blocks * BS)
        taker.num_computed_tokens += num_blocks * BS

    take(2)  # b's partial block, then b's tail block: b keeps its head
    assert (hits(100), hits(200)) == (2, 1)
    take(1)
    assert (hits(100), hits(200)) == (2, 0) and len(bm.cached) == 2  # evicted hashes leave the map
    take(2)  # a's partial block, then a's tail
    assert hits(100) == 1 and bm.num_free_blocks == 1


def test_allocation_accounting_returns_every_block():
    bm = BlockManager(5, BS, enable_prefix_caching=False)
    seq = new_seq(span(12))
    assert bm.can_allocate(seq, 20) and not bm.can_allocate(seq, 21)
    assert bm.allocate(seq, 12) == []
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 2
    assert bm.usage == pytest.approx(0.6)
    seq.num_computed_tokens = 12
    assert bm.append_slot(seq) and len(seq.block_table) == 4  # position 12 starts a block
    seq.num_computed_tokens = 13
    assert bm.append_slot(seq) and len(seq.block_table) == 4  # position 13 is in it
    other = new_seq(span(4, 50))
    bm.allocate(other, 4)
    assert bm.num_free_blocks == 0
    other.num_computed_tokens = 4
    assert not bm.append_slot(other) and other.block_table == [other.block_table[0]]
    assert not bm.can_allocate(other, 1)
    bm.free_seq(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 4 and bm.can_allocate(other, 1)
    bm.free_seq(other)
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_fork_shares_every_block_until_the_last_holder_frees_it():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    parent = new_seq(span(6))
    compute(bm, parent)
    children = [new_seq(span(6)) for _ in range(2)]
    for child in children:
        bm.fork(parent, child)
    assert all(c.block_table == parent.block_table for c in children)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [3, 3]
    assert bm.num_free_blocks == 6
    # A write at position 6 of a shared block copies it first (copy-on-write).
    child = children[0]
    child.num_computed_tokens = 6
    assert not bm.append_slot(child) and bm.can_allocate(child, 1)
    [(src, dst)] = bm.allocate(child, 1)
    assert src == parent.block_table[1] and child.block_table == [parent.block_table[0], dst]
    assert bm.blocks[src].ref_count == 2 and bm.blocks[dst].ref_count == 1
    bm.free_seq(parent)
    assert bm.num_free_blocks == 5  # every block still held by a child
    for c in children:
        bm.free_seq(c)
    assert bm.num_free_blocks == bm.num_blocks
