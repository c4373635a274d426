"""The slots of a chunk, against the per-position definition: short chunks (a verify entry, a draft's catch-up) are
mapped one by one, longer ones page by page."""

import random

import pytest

from nanoserve.worker.step_inputs import chunk_slots


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("max_len", [32, None])  # up to 32 positions: the short chunks' path
def test_chunk_slots_match_per_position_lookup(block_size, max_len):
    rng = random.Random(0)
    table = rng.sample(range(1000), 40)  # pages in no order, as after eviction and reuse
    for _ in range(200):
        start = rng.randrange(0, 35 * block_size)
        n = rng.randrange(1, min(max_len or 40 * block_size, 40 * block_size - start) + 1)
        want = [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        assert chunk_slots(table, start, n, block_size) == want
