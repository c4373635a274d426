"""The prefill attention kernel's work list, built on the host. Plain Python and numpy, so CPU-only installs (no
Triton) and the CUDA-graph runner can import it without the kernel.

Query rows. A program of the kernel serves `pack` query heads that share a kv head (GQA packing: their rows go
through one load of each K/V tile), so a sequence of q_len new tokens has q_len x pack query rows, row r being
token r // pack and query head (program's first head) + r % pack. pack = 1 gives one row per token and head;
the default packs the whole group, num_q_heads // num_kv_heads. Tiles are block_m consecutive rows of one
sequence, so a tile spans about block_m / pack tokens.

A map: int32 rows of SPLIT_MAP_COLUMNS, one per program row of the launch grid (each row runs once per group of
`pack` query heads), longest key range first, then padding rows (sequence -1) that the kernel skips:
  0 sequence, 1 first query row of the tile, 2 first key, 3 end key (the keys this row attends to, never past
  what the tile's last row sees), 4 first scratch slot (-1 unsplit), 5 split, 6 splits, 7 the sequence's first
  token in q, 8 its query rows (q_len x pack), 9 the position of its first new token (seq_len - q_len).
A tile whose keys are cut into `splits` ranges has one row per range; each writes a partial result into scratch
slot first slot + split, and the last of them to finish merges them. An unsplit tile has one row covering keys
[0, its end) with first slot -1 and splits 1. The kernel reads lengths only from the map, never cu_seqlens_q or
seq_lens, so the map must be built from the same lengths as the step's tensors.
"""

import numpy as np

SPLIT_MAP_COLUMNS = 10
PADDING_ROW = (-1, 0, 0, 0, -1, 0, 1, 0, 0, 0)
_PADDING = np.array(PADDING_ROW, dtype=np.int32)
# Split boundaries are multiples of this many keys, so every key tile of the kernel (64 or 128 keys) but the
# last of a range is full and needs no mask.
KV_SPLIT_GRANULE = 128
# Fewest keys a split gets: below two 128-key tiles, its fixed costs (loading the queries, writing and merging a
# partial result) would weigh about as much as its keys.
MIN_SPLIT_KEYS = 256
# Aim for pieces a quarter of a balanced program's share: scheduled longest first over about four waves,
# the last piece to start ends soon after the rest.
_SPLIT_WAVES = 4
# Scratch bound, in (query row, program head) pairs: 32K x head_dim 128 x fp32 is 16 MiB, shared by all layers.
_SPLIT_SCRATCH_ROWS = 1 << 15


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def prefill_block_m(num_tokens: int, pack: int = 1) -> int:
    """Query rows per tile for a step of num_tokens new tokens (any bound on the longest query run will do)
    whose programs each serve `pack` query heads."""
    # A quarter of the step's rows, between 16 (tl.dot's least) and 64: decode-sized entries don't pay for large
    # tiles, and a short chunk over a long cached prefix is several tiles per kv head whose long key ranges the
    # split map then cuts (100 tokens x 2 heads: four 64-row tiles). 128-row tiles (8 warps, one program per SM)
    # were slower than 64-row ones (4 warps, two per SM) on an H100 for 14 prompts of 100-1,024 tokens (133 vs
    # 113 us a layer) and for 600 tokens over 30,000 cached (610 vs 573 us; benchmark at 275aa23).
    return min(64, max(16, _next_power_of_2(num_tokens * pack) // 4))


def max_prefill_tiles(num_tokens: int, max_num_seqs: int, block_m: int, pack: int = 1) -> int:
    """Most query tiles any batch of at most num_tokens tokens in at most max_num_seqs sequences can need."""
    # Sequence b needs ceil(q_b pack / block_m) <= q_b pack // block_m + 1 tiles, and only a non-empty one needs
    # any; summed, the floors are at most num_tokens pack // block_m and the +1s at most min(num_tokens, seqs).
    return num_tokens * pack // block_m + min(num_tokens, max_num_seqs)


def prefill_block_n(head_dim: int, element_size: int, block_m: int) -> int:
    """Keys per inner tile of the prefill kernel for tiles of block_m query rows."""
    # Measured once on an H200 (bf16, 128-row tiles, no autotuning): 128-key tiles were 5% faster than 64 at
    # head_dim 128 and 20% slower at head_dim 64. Smaller tiles keep 64: two stages of 128-key K/V tiles take
    # 128 KB of shared memory, one program per SM, where 64-key ones let two or three share one (as
    # prefill_programs_per_sm assumes). fp32 128x128 tiles overflow shared memory.
    # head_dim 256 (Gemma 2, Gemma 3 1B-12B): 32-key tiles keep two stages of K/V at 64 KB in 16 bits (128 KB in
    # fp32); not measured on a GPU yet.
    if head_dim == 256:
        return 32
    return 128 if head_dim == 128 and element_size == 2 and block_m == 128 else 64


def prefill_programs_per_sm(block_m: int) -> int:
    """How many prefill attention programs of block_m query rows one SM runs at once (bf16, head_dim 128, the
    key tiles of prefill_block_n)."""
    # Registers x threads and shared memory per program (4 warps and 64-key tiles below 128 rows, 8 warps and
    # 128-key tiles at 128) against an SM's 64K registers and 228 KB, as ptxas reports them for sm_90 (Triton 3.9,
    # two query heads per program): 16 rows 118 registers and 38 KB, 32 rows 148 and 44 KB, 64 rows 255 and
    # 80 KB, 128 rows 255 and 160 KB.
    return {16: 4, 32: 3, 64: 2}.get(block_m, 1)


def max_kv_partials(block_m: int, num_heads: int) -> int:
    """Scratch slots (one split of one query tile, all num_heads program heads) that split maps may use: a fixed
    memory bound."""
    return max(2, _SPLIT_SCRATCH_ROWS // (block_m * num_heads))


def _tiles(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int, pack: int) -> dict[str, np.ndarray]:
    """Every query tile, in sequence order, as int64 arrays (numpy, not a Python loop: a step's host time is on
    its critical path): seq, first row, the position of its first token, the end of the keys it sees, and its
    sequence's first token, query rows and first new token's position."""
    # Few elements, so each numpy call's fixed cost is what counts: array methods over np.* wrappers, gathers by
    # seq over repeats.
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    q_lens = cu[1:] - cu[:-1]
    q_rows = q_lens * pack
    pos0 = np.asarray(seq_lens, dtype=np.int64) - q_lens
    per_seq = (q_rows + (block_m - 1)) // block_m
    seq = np.arange(len(q_lens)).repeat(per_seq)
    start_r = (np.arange(len(seq)) - (per_seq.cumsum() - per_seq)[seq]) * block_m
    pos0, q_rows = pos0[seq], q_rows[seq]
    return {
        "seq": seq,
        "start_r": start_r,
        "first_pos": pos0 + start_r // pack,
        "kv_end": pos0 + (np.minimum(start_r + block_m, q_rows) - 1) // pack + 1,
        "q_start": cu[seq],
        "q_rows": q_rows,
        "pos0": pos0,
    }


def _check_fits(num_tiles: int, num_rows: int, block_m: int) -> None:
    if num_tiles > num_rows:
        raise ValueError(f"batch needs {num_tiles} query tiles of {block_m} rows, num_tiles is {num_rows}")


def _layout(tiles: dict[str, np.ndarray], n: np.ndarray, num_rows: int) -> np.ndarray:
    """The map for tiles cut into n[t] key ranges each (1: unsplit), padded to num_rows rows."""
    # One row per piece: tile t's piece i covers [start_i, start_i+1) of [0, kv_end_t), starts rounded down to
    # granules (start_0 = 0, the last piece ends at kv_end_t).
    first_piece = n.cumsum() - n
    tile = np.arange(len(n)).repeat(n)
    piece = np.arange(len(tile)) - first_piece[tile]
    nt, end = n[tile], tiles["kv_end"][tile]
    lo = piece * end // nt // KV_SPLIT_GRANULE * KV_SPLIT_GRANULE
    hi = (piece + 1) * end // nt // KV_SPLIT_GRANULE * KV_SPLIT_GRANULE
    last = piece + 1 == nt
    hi[last] = end[last]
    # Pieces are at least a granule long, so every row of the tile sees each range's first key (lo <= first_pos):
    # no row's running max stays -inf, which would give NaN from -inf - -inf.
    assert (lo < hi).all() and (lo <= tiles["first_pos"][tile]).all()
    # Split tiles own consecutive scratch slots, one per piece; pieces of earlier unsplit tiles take none.
    unsplit = n == 1
    first_slot = first_piece - unsplit.cumsum() + unsplit
    first_slot[unsplit] = -1
    # Longest first: blocks launch in grid order, so the long ranges start in the first wave and the short ones
    # fill in behind them instead of one long range running alone at the end.
    order = (lo - hi).argsort(kind="stable")
    tile = tile[order]
    columns = (tiles["seq"][tile], tiles["start_r"][tile], lo[order], hi[order], first_slot[tile], piece[order],
               n[tile], tiles["q_start"][tile], tiles["q_rows"][tile], tiles["pos0"][tile])  # fmt: skip
    tile_map = np.empty((num_rows, SPLIT_MAP_COLUMNS), dtype=np.int32)
    for col, values in enumerate(columns):
        tile_map[: len(tile), col] = values
    tile_map[len(tile):] = _PADDING
    return tile_map


def prefill_tile_map(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int, num_tiles: int, pack: int = 1
                     ) -> np.ndarray:  # fmt: skip
    """A map (module docstring) that splits nothing: one row per tile of block_m query rows, then padding rows up
    to num_tiles. Raises ValueError if the batch needs more than num_tiles tiles."""
    tiles = _tiles(cu_seqlens_q, seq_lens, block_m, pack)
    _check_fits(len(tiles["seq"]), num_tiles, block_m)
    return _layout(tiles, np.ones_like(tiles["seq"]), num_tiles)


def kv_split_keys(
    tile_keys: np.ndarray | list[int], num_heads: int, concurrency: int, min_keys: int = MIN_SPLIT_KEYS
) -> int | None:
    """Keys per split for a step whose query tiles visit tile_keys keys each, or None to split nothing.

    Every (tile, program head) is a program and concurrency of them run at once. Perfectly balanced, each would
    visit share = sum(tile_keys) x num_heads / concurrency keys, so the step takes about max(longest tile, share);
    cut into pieces of `chunk` keys, about share + chunk. Tiles are split only when that is shorter.
    """
    assert min_keys >= KV_SPLIT_GRANULE, "pieces must span whole granules"
    if len(tile_keys) == 0:
        return None
    if isinstance(tile_keys, np.ndarray):
        total, longest = int(tile_keys.sum()), int(tile_keys.max())
    else:  # a few tiles' list (_few_tiles_map): numpy's fixed cost would be most of the call
        total, longest = sum(tile_keys), max(tile_keys)
    share = total * num_heads / concurrency
    granules = -(-int(share / _SPLIT_WAVES) // KV_SPLIT_GRANULE)
    chunk = max(min_keys, granules * KV_SPLIT_GRANULE)
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
    pack: int = 1,
) -> np.ndarray:
    """A map (module docstring) of num_rows rows for tiles of block_m query rows, each row run by num_heads
    programs (num_q_heads // pack), for a split_scratch of max_partials slots.

    Long tiles are split when kv_split_keys(..., num_heads, concurrency, min_keys) says so, into as many pieces as
    the rows the tiles leave free and the scratch slots allow: a CUDA graph sized for unsplit tiles (num_rows from
    max_prefill_tiles) launches no more programs for it. Raises ValueError if the batch has more than num_rows
    query tiles.
    """
    few = _few_tiles_map(cu_seqlens_q, seq_lens, block_m, num_rows, num_heads, concurrency, max_partials, min_keys,
                         pack)  # fmt: skip
    if few is not None:
        return few
    return _split_map(cu_seqlens_q, seq_lens, block_m, num_rows, num_heads, concurrency, max_partials, min_keys,
                      pack)  # fmt: skip


# Tiles up to which _few_tiles_map's Python loops cost less than numpy's fixed cost per call.
_FEW_TILES = 16


def _few_tiles_map(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int, num_rows: int, num_heads: int,
                   concurrency: int, max_partials: int, min_keys: int, pack: int) -> np.ndarray | None:
    """_split_map's map in plain Python, for a batch of at most _FEW_TILES query tiles (a speculative verify step,
    a draft's catch-up: a few tokens a sequence); None for a larger one.

    Every such step builds a map, and numpy's fixed cost per call made _split_map's ~40 array operations ~110 us of
    host time (a 2-core CPU) for one sequence of 4 tokens, where a decode step of the bundled model takes ~0.6 ms in
    all (issue #43). The same arithmetic as _tiles, prefill_split_map's choice of pieces and _layout, tile by tile."""
    tiles = []  # (seq, start_r, kv_end, q_start, q_rows, pos0)
    for seq, (q_start, q_end, seq_len) in enumerate(zip(cu_seqlens_q, cu_seqlens_q[1:], seq_lens, strict=False)):
        q_rows = (q_end - q_start) * pack
        pos0 = seq_len - (q_end - q_start)
        tiles += [(seq, r, pos0 + (min(r + block_m, q_rows) - 1) // pack + 1, q_start, q_rows, pos0)
                  for r in range(0, q_rows, block_m)]  # fmt: skip
        if len(tiles) > _FEW_TILES:
            return None
    _check_fits(len(tiles), num_rows, block_m)
    kv_end = [tile[2] for tile in tiles]
    n = [1] * len(tiles)
    chunk = kv_split_keys(kv_end, num_heads, concurrency, min_keys)
    if chunk is not None:
        while True:
            n = [max(end // chunk, 1) for end in kv_end]
            extra = sum(n) - len(tiles)
            if extra + sum(p > 1 for p in n) <= max_partials and extra <= num_rows - len(tiles):
                break
            chunk *= 2
    rows, slot = [], 0
    for (seq, start_r, end, q_start, q_rows, pos0), pieces in zip(tiles, n, strict=True):
        first_slot = -1 if pieces == 1 else slot
        slot += pieces if pieces > 1 else 0
        for piece in range(pieces):
            lo = piece * end // pieces // KV_SPLIT_GRANULE * KV_SPLIT_GRANULE
            hi = end if piece + 1 == pieces else (piece + 1) * end // pieces // KV_SPLIT_GRANULE * KV_SPLIT_GRANULE
            rows.append((seq, start_r, lo, hi, first_slot, piece, pieces, q_start, q_rows, pos0))
    rows.sort(key=lambda row: row[2] - row[3])  # longest first, ties in tile order (as _layout's stable argsort)
    tile_map = np.empty((num_rows, SPLIT_MAP_COLUMNS), dtype=np.int32)
    if rows:
        tile_map[: len(rows)] = rows
    tile_map[len(rows):] = _PADDING
    return tile_map


def _split_map(cu_seqlens_q: list[int], seq_lens: list[int], block_m: int, num_rows: int, num_heads: int,
               concurrency: int, max_partials: int, min_keys: int, pack: int) -> np.ndarray:
    """prefill_split_map's map, for any batch (numpy)."""
    tiles = _tiles(cu_seqlens_q, seq_lens, block_m, pack)
    kv_end = tiles["kv_end"]
    num_tiles = len(kv_end)
    _check_fits(num_tiles, num_rows, block_m)
    chunk = kv_split_keys(kv_end, num_heads, concurrency, min_keys)

    def pieces(chunk: int | None) -> np.ndarray:
        """Pieces of each tile: kv_end // chunk near-equal ranges, or 1 (unsplit)."""
        return np.ones_like(kv_end) if chunk is None else np.maximum(kv_end // chunk, 1)

    def fits(n: np.ndarray) -> bool:
        """Whether the split tiles' pieces fit the scratch slots, and their extra rows the rows left free."""
        extra = int(n.sum()) - num_tiles  # each split tile's pieces but its first
        return extra + int((n > 1).sum()) <= max_partials and extra <= num_rows - num_tiles

    # Coarser pieces until they fit; past the longest tile nothing is split.
    n = pieces(chunk)
    while not fits(n):
        chunk *= 2
        n = pieces(chunk)
    return _layout(tiles, n, num_rows)


def split_slots_used(split_map: np.ndarray) -> int:
    """Scratch slots a split map writes (first slot + splits past its last split tile)."""
    return int((split_map[:, 4] + split_map[:, 6]).max(initial=0))
