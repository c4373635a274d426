"""The slots of a prefill chunk, computed page by page, against the per-position definition."""

import random

import pytest

from nanoserve.worker.step_inputs import chunk_slots


@pytest.mark.parametrize("block_size", [8, 16])
def test_chunk_slots_match_per_position_lookup(block_size):
    rng = random.Random(0)
    table = rng.sample(range(1000), 40)  # pages in no order, as after eviction and reuse
    for _ in range(200):
        start = rng.randrange(0, 35 * block_size)
        n = rng.randrange(1, 40 * block_size - start)
        want = [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        assert chunk_slots(table, start, n, block_size) == want
