"""The prefix cache's look-up: hits by hash chain, checked token by token."""

import random

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
    assert bm.match_prefix(new_seq(shared + [7, 8])) == cached
    assert bm.match_prefix(new_seq(shared[:3 * BS] + [9] + shared[3 * BS + 1:])) == cached[:3]
    assert bm.match_prefix(new_seq(shared)) == cached[:4]  # the last token is always computed
    assert bm.match_prefix(new_seq([5] + shared[1:])) == []


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
    assert bm.match_prefix(new_seq([1, 2, 3, 5, 9])) == []
    # The cache holds one block per hash: a second block of hash 42 with other tokens is no hit either.
    assert len(bm.match_prefix(new_seq([1, 2, 3, 4, 5, 6, 7, 8, 0]))) == 1
