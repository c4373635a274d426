"""The prefill attention kernel's work list, built on the host. Plain Python and numpy, so CPU-only installs (no
Triton) and the CUDA-graph runner can import it without the kernel.

Two forms, both ordered so that the programs with the most keys to visit launch first:
- a tile map: int32 rows (sequence, first query row), one per query tile of block_m rows;
- a split map: int32 rows (sequence, first query row, first key, end key, first slot, split, splits). A tile whose
  keys are cut into `splits` ranges has one row per range; each writes a partial result into scratch slot
  first slot + split, and the last of them to finish merges them. An unsplit tile has one row covering keys
  [0, its end) with first slot -1 and splits 1.
"""

import numpy as np

SPLIT_MAP_COLUMNS = 7
# Split boundaries are multiples of this many keys, so every key tile of the kernel (64 or 128 keys) but the
# last of a range is full and needs no mask.
KV_SPLIT_GRANULE = 128
# Fewest keys a split gets: below two 128-key tiles, its fixed costs (loading the queries, writing and merging a
# partial result) would weigh about as much as its keys.
MIN_SPLIT_KEYS = 256
# Aim for pieces a quarter of a balanced program's share: scheduled longest first over about four waves,
# the last piece to start ends soon after the rest.
_SPLIT_WAVES = 4
# Scratch bound, in (query row, head) pairs: 32K x head_dim 128 x fp32 is 16 MiB, shared by all layers.
_SPLIT_SCRATCH_ROWS = 1 << 15


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def prefill_block_m(num_tokens: int) -> int:
    """Query tile height for a step of num_tokens new tokens (any bound on the longest query run will do)."""
    # Sized to the tokens at hand so decode-sized entries don't pay for 128-row tiles, and an eighth of them
    # so a short chunk over a long cached prefix (a prefix-cache hit) still spreads over several tiles per
    # head: one 128-row tile x 16 heads would leave most of the GPU idle while it walks 2,000 keys (measured
    # on an H200: 52 us per layer for 100 new tokens over 2,000 cached ones with 32-row tiles).
    return min(128, max(16, _next_power_of_2(num_tokens) // 8))


def max_prefill_tiles(num_tokens: int, max_num_seqs: int, block_m: int) -> int:
    """Most query tiles any batch of at most num_tokens tokens in at most max_num_seqs sequences can need."""
    # Sequence b needs ceil(q_b / block_m) <= q_b // block_m + 1 tiles, and only a non-empty one needs any;
    # summed, the floors are at most num_tokens // block_m and the +1s at most min(num_tokens, max_num_seqs).
    return num_tokens // block_m + min(num_tokens, max_num_seqs)


def prefill_programs_per_sm(block_m: int) -> int:
    """How many prefill attention programs of block_m query rows one SM runs at once."""
    # From the kernel compiled for sm_90 (bf16, head_dim 128), registers x threads and shared memory per program
    # against an SM's 64K registers and 228 KB: 16-row tiles fit 3 (shared memory), 32-row 2, larger ones 1.
    return {16: 3, 32: 2}.get(block_m, 1)


def max_kv_partials(block_m: int, num_heads: int) -> int:
    """Scratch slots (one split of one query tile, all heads) that split maps may use: a fixed memory bound."""
    return max(2, _SPLIT_SCRATCH_ROWS // (block_m * num_heads))


def _tiles(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int) -> tuple[np.ndarray, ...]:
    """(sequence, first query row, its position, end of the keys it sees) of every query tile, in sequence order,
    as four int64 arrays (numpy, not a Python loop: a step's host time is on its critical path)."""
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    lens = np.asarray(seq_lens, dtype=np.int64)
    q_lens = cu[1:] - cu[:-1]
    per_seq = -(-q_lens // block_m)
    seq = np.repeat(np.arange(len(lens)), per_seq)
    start_m = (np.arange(len(seq)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * block_m
    first_pos = lens[seq] - q_lens[seq] + start_m
    return seq, start_m, first_pos, np.minimum(lens[seq], first_pos + block_m)


def _check_fits(num_tiles: int, num_rows: int, block_m: int) -> None:
    if num_tiles > num_rows:
        raise ValueError(f"batch needs {num_tiles} query tiles of {block_m} rows, num_tiles is {num_rows}")


def prefill_tile_map(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int, num_tiles: int) -> np.ndarray:
    """int32 [num_tiles, 2] rows (sequence, first query row in it) for prefill_attention's tile_map.

    One row per block_m-row query tile, the tiles visiting the most keys first, then (-1, 0) rows (which the
    kernel skips) up to num_tiles. Raises ValueError if the batch needs more than num_tiles tiles.
    """
    seq, start_m, _, kv_end = _tiles(cu_seqlens_q, seq_lens, block_m)
    _check_fits(len(seq), num_tiles, block_m)
    # Longest first: blocks launch in grid order, so the long causal tiles start in the first wave and the
    # short ones fill in behind them instead of one long tile running alone at the end. Measured once on an
    # H200 (bf16) against sequence order: 2% faster on one 8k prompt and on decode-heavy batches, 3% slower
    # on 14 prompts of 100-1024 tokens.
    order = np.argsort(-kv_end, kind="stable")
    tile_map = np.zeros((num_tiles, 2), dtype=np.int32)
    tile_map[:, 0] = -1
    tile_map[: len(seq), 0] = seq[order]
    tile_map[: len(seq), 1] = start_m[order]
    return tile_map


def kv_split_keys(
    tile_keys: np.ndarray | list[int], num_heads: int, concurrency: int, min_keys: int = MIN_SPLIT_KEYS
) -> int | None:
    """Keys per split for a step whose query tiles visit tile_keys keys each, or None to split nothing.

    Every (tile, head) is a program and concurrency of them run at once. Perfectly balanced, each would visit
    share = sum(tile_keys) x num_heads / concurrency keys, so the step takes about max(longest tile, share);
    cut into pieces of `chunk` keys, about share + chunk. Tiles are split only when that is shorter.
    """
    assert min_keys >= KV_SPLIT_GRANULE, "pieces must span whole granules"
    if len(tile_keys) == 0:
        return None
    share = int(np.sum(tile_keys)) * num_heads / concurrency
    granules = -(-int(share / _SPLIT_WAVES) // KV_SPLIT_GRANULE)
    chunk = max(min_keys, granules * KV_SPLIT_GRANULE)
    longest = int(np.max(tile_keys))
    return chunk if longest > share + chunk and longest >= 2 * chunk else None


def prefill_split_map(
    cu_seqlens_q: list[int],
    seq_lens: list[int],
    block_m: int,
    num_rows: int,
    num_heads: int,
    concurrency: int,
    max_partials: int,
    min_keys: int = MIN_SPLIT_KEYS,
) -> np.ndarray:
    """int32 [num_rows, SPLIT_MAP_COLUMNS] rows for prefill_attention's tile_map (see the module docstring), for
    a split_scratch of max_partials slots, then padding rows (sequence -1) that the kernel skips.

    Long tiles are split when kv_split_keys(..., num_heads, concurrency, min_keys) says so, into as many pieces as
    the rows the tiles leave free and the scratch slots allow: a CUDA graph sized for unsplit tiles (num_rows from
    max_prefill_tiles) launches no more programs for it. Raises ValueError if the batch has more than num_rows
    query tiles.
    """
    seq, start_m, first_pos, kv_end = _tiles(cu_seqlens_q, seq_lens, block_m)
    num_tiles = len(seq)
    _check_fits(num_tiles, num_rows, block_m)
    assert KV_SPLIT_GRANULE >= block_m, "a split's first key must be visible to every row of its tile"
    chunk = kv_split_keys(kv_end, num_heads, concurrency, min_keys)

    def pieces(chunk: int | None) -> np.ndarray:
        """Pieces of each tile: kv_end // chunk near-equal ranges, or 1 (unsplit)."""
        n = np.ones_like(kv_end) if chunk is None else kv_end // chunk
        return np.where(n > 1, n, 1)

    def fits(n: np.ndarray) -> bool:
        """Whether the split tiles' pieces fit the scratch slots, and their extra rows the rows left free."""
        split = n > 1
        return int(n[split].sum()) <= max_partials and int((n[split] - 1).sum()) <= num_rows - num_tiles

    # Coarser pieces until they fit; past the longest tile nothing is split.
    n = pieces(chunk)
    while not fits(n):
        chunk *= 2
        n = pieces(chunk)
    # One row per piece: tile t's piece i covers [start_i, start_i+1) of [0, kv_end_t), starts rounded down to
    # granules (start_0 = 0, the last piece ends at kv_end_t).
    tile = np.repeat(np.arange(num_tiles), n)
    piece = np.arange(len(tile)) - np.repeat(np.cumsum(n) - n, n)
    nt, end = n[tile], kv_end[tile]
    lo = piece * end // nt // KV_SPLIT_GRANULE * KV_SPLIT_GRANULE
    hi = np.where(piece + 1 < nt, (piece + 1) * end // nt // KV_SPLIT_GRANULE * KV_SPLIT_GRANULE, end)
    # Pieces are at least a granule (>= block_m) long, so every row of the tile sees each range's first key.
    assert (lo < hi).all() and (lo <= first_pos[tile]).all()
    slots = np.where(n > 1, n, 0)
    first_slot = np.where(n > 1, np.cumsum(slots) - slots, -1)[tile]
    # Longest first, as in prefill_tile_map; a program's work is its key range.
    order = np.argsort(lo - hi, kind="stable")
    split_map = np.empty((num_rows, SPLIT_MAP_COLUMNS), dtype=np.int32)
    split_map[:] = (-1, 0, 0, 0, -1, 0, 1)
    for col, values in enumerate((seq[tile], start_m[tile], lo, hi, first_slot, piece, nt)):
        split_map[: len(tile), col] = values[order]
    return split_map


def split_slots_used(split_map: np.ndarray) -> int:
    """Scratch slots a split map writes (first slot + splits past its last split tile)."""
    return int((split_map[:, 4] + split_map[:, 6]).max(initial=0))


def eager_split_map(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int, num_heads: int, num_sms: int
                    ) -> np.ndarray:  # fmt: skip
    """A split map of just the rows this batch needs, for a launch outside a CUDA graph (no fixed grid): every
    split the scratch bound allows, on a device of num_sms SMs. Scratch: split_slots_used(map) slots."""
    max_partials = max_kv_partials(block_m, num_heads)
    num_rows = max_prefill_tiles(cu_seqlens_q[-1], len(seq_lens), block_m) + max_partials
    concurrency = num_sms * prefill_programs_per_sm(block_m)
    split_map = prefill_split_map(cu_seqlens_q, seq_lens, block_m, num_rows, num_heads, concurrency, max_partials)
    return split_map[split_map[:, 0] >= 0]  # real rows come first
