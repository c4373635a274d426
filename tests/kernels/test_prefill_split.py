"""Prefill attention with long tiles' keys split across programs (flash-decoding for prefill): the host helpers
that choose and lay out the splits, the kernel against the PyTorch reference, and the callers that build maps
(the CUDA-graph runner's per-step map, the eager step's map, the kernel's own when given none)."""

import numpy as np
import pytest
import torch
from torch import nn

from nanoserve.kernels.prefill.split_scratch import SplitScratch, split_scratch_views
from nanoserve.kernels.prefill.tile_map import (
    KV_SPLIT_GRANULE,
    PADDING_ROW,
    SPLIT_MAP_COLUMNS,
    _few_tiles_map,
    _split_map,
    kv_split_keys,
    max_kv_partials,
    max_prefill_tiles,
    prefill_block_m,
    prefill_programs_per_sm,
    prefill_split_map,
    split_slots_used,
)

H200_SMS = 132


def _cu(q_lens: list[int]) -> list[int]:
    return np.cumsum([0] + q_lens).tolist()


def _tile_rows(split_map: np.ndarray) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """Real rows of a split map grouped by query tile (sequence, first query row)."""
    tiles: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for row in split_map.tolist():
        if row[0] >= 0:
            tiles.setdefault((row[0], row[1]), []).append(tuple(row))
    return tiles


def _check_split_map(split_map, cu, seq_lens, block_m, num_rows, max_partials, pack=1):
    """Every invariant the kernel relies on; returns the largest split count of any tile."""
    assert split_map.dtype == np.int32 and split_map.shape == (num_rows, SPLIT_MAP_COLUMNS)
    real = split_map[:, 0] >= 0
    assert real[: real.sum()].all(), "padding rows come last"
    assert (split_map[~real] == PADDING_ROW).all()
    lengths = (split_map[real, 3] - split_map[real, 2]).tolist()
    assert lengths == sorted(lengths, reverse=True), "the longest key ranges launch first"
    tiles = _tile_rows(split_map)
    want = {(b, s) for b in range(len(seq_lens)) for s in range(0, (cu[b + 1] - cu[b]) * pack, block_m)}
    assert set(tiles) == want
    slots = []
    for (b, start_r), rows in tiles.items():
        q_len = cu[b + 1] - cu[b]
        # The sequence's lengths, as the kernel reads them from the map alone.
        assert all(r[7:] == (cu[b], q_len * pack, seq_lens[b] - q_len) for r in rows)
        first_pos = seq_lens[b] - q_len + start_r // pack
        last_row = min(start_r + block_m, q_len * pack) - 1
        kv_end = seq_lens[b] - q_len + last_row // pack + 1
        rows.sort(key=lambda r: r[5])
        n = len(rows)
        assert [r[5] for r in rows] == list(range(n)) and all(r[6] == n for r in rows)
        # The ranges tile [0, kv_end) in order, each non-empty, starting on a granule no later than the tile's
        # first query position (so every row of the tile sees a key in every range).
        assert rows[0][2] == 0 and rows[-1][3] == kv_end
        assert all(a[3] == b[2] for a, b in zip(rows, rows[1:], strict=False))
        assert all(r[2] < r[3] and r[2] % KV_SPLIT_GRANULE == 0 and r[2] <= first_pos for r in rows)
        if n == 1:
            assert rows[0][4] == -1
        else:
            assert len({r[4] for r in rows}) == 1
            slots += range(rows[0][4], rows[0][4] + n)
    assert sorted(slots) == list(range(len(slots))), "split tiles own disjoint, consecutive scratch slots"
    assert split_slots_used(split_map) == len(slots) <= max_partials
    return max((len(r) for r in tiles.values()), default=0)


# --- host helpers ---------------------------------------------------------------------------------------------


def test_split_choice_for_benchmark_shapes():
    """The cached prefix step splits into about one wave of programs; the uncached prefills and mixed batches
    the benchmarks run split nothing."""
    heads, pack = 8, 2  # Qwen3-0.6B as the graph runner launches it: a program per kv head, 2 query heads each
    programs = {}

    def max_splits(q_lens, seq_lens, bucket):
        block_m = prefill_block_m(bucket, pack)
        num_tiles = max_prefill_tiles(bucket, 256, block_m, pack)
        max_partials = max_kv_partials(block_m, heads)
        concurrency = H200_SMS * prefill_programs_per_sm(block_m)
        split_map = prefill_split_map(_cu(q_lens), seq_lens, block_m, num_tiles, heads, concurrency, max_partials,
                                      pack=pack)  # fmt: skip
        programs[bucket] = (int((split_map[:, 0] >= 0).sum()) * heads, concurrency)
        return _check_split_map(split_map, _cu(q_lens), seq_lens, block_m, num_tiles, max_partials, pack)

    # 100 new tokens over a 2,000-token cached prefix: four 64-row tiles per kv head, each cut into 7-8 ranges
    # of 256-384 keys, 248 programs for 264 places.
    assert max_splits([100], [2100], 128) == 8
    assert programs[128][1] / 2 < programs[128][0] <= programs[128][1]
    assert max_splits([600], [30600], 1024) > 1  # a chunk over a long context
    assert max_splits([2100], [2100], 2560) == 1
    rng = np.random.default_rng(0)
    lens = rng.integers(100, 1025, 14).tolist()
    assert max_splits(lens, lens, 7680) == 1
    decode_ctx = rng.integers(100, 2048, 64).tolist()
    assert max_splits([1] * 64 + [512], decode_ctx + [512], 1024) == 1


def test_kv_split_keys():
    assert kv_split_keys([], 16, 396) is None
    # Balanced work splits nothing, however little there is.
    assert kv_split_keys([300] * 4, 16, 396) is None
    assert kv_split_keys([2000] * 200, 16, 132) is None
    # A straggler splits; pieces are whole granules and at least min_keys.
    chunk = kv_split_keys([100] * 50 + [20000], 16, 132)
    assert chunk is not None and chunk % KV_SPLIT_GRANULE == 0 and chunk >= 256
    assert kv_split_keys([2100], 16, 396, min_keys=1024) == 1024
    assert kv_split_keys([2100], 16, 396, min_keys=2048) is None  # one piece: nothing to gain


def test_split_map_bounds_random_batches():
    rng = np.random.default_rng(1)
    split_seen = 0
    for _ in range(300):
        num_tokens, max_num_seqs = int(rng.integers(1, 600)), int(rng.integers(1, 40))
        pack = int(rng.choice([1, 2, 7]))
        block_m = prefill_block_m(num_tokens, pack) if rng.random() < 0.5 else 16
        num_heads = int(rng.choice([1, 2, 8, 16]))
        max_partials = int(rng.integers(0, 40))
        concurrency = int(rng.integers(1, 600))
        batch = int(rng.integers(1, max_num_seqs + 1))
        total = int(rng.integers(0, num_tokens + 1))
        cu = [0, *np.sort(rng.integers(0, total + 1, batch - 1)).tolist(), total]
        seq_lens = (np.diff(cu) + rng.integers(0, 3000, batch)).tolist()
        num_tiles = max_prefill_tiles(num_tokens, max_num_seqs, block_m, pack)
        split_map = prefill_split_map(cu, seq_lens, block_m, num_tiles, num_heads, concurrency, max_partials, 128,
                                      pack)  # fmt: skip
        split_seen += _check_split_map(split_map, cu, seq_lens, block_m, num_tiles, max_partials, pack) > 1
    assert split_seen > 50


def test_few_tiles_map_equals_the_general_one():
    """A batch of few tiles (a verify step, a draft's catch-up) gets its map from a plain-Python path: the same map,
    splits included, as the numpy one."""
    rng = np.random.default_rng(2)
    taken = split_seen = 0
    for _ in range(400):
        pack = int(rng.choice([1, 2, 7]))
        batch = int(rng.integers(1, 9))
        q_lens = rng.integers(0, 6, batch) if rng.random() < 0.7 else rng.integers(0, 40, batch)
        cu = _cu(q_lens.tolist())
        seq_lens = (q_lens + rng.integers(0, 3000, batch)).tolist()
        block_m = prefill_block_m(max(cu[-1], 1), pack) if rng.random() < 0.5 else 16
        num_rows = max_prefill_tiles(max(cu[-1], 1) + int(rng.integers(0, 16)), batch, block_m, pack)
        num_heads, concurrency = int(rng.choice([1, 2, 8])), int(rng.integers(1, 600))
        max_partials = int(rng.integers(0, 40))
        args = (cu, seq_lens, block_m, num_rows, num_heads, concurrency, max_partials, 128, pack)
        few = _few_tiles_map(*args)
        if few is not None:
            taken += 1
            split_seen += int((few[:, 6] > 1).any())
            np.testing.assert_array_equal(few, _split_map(*args))
    assert taken > 200 and split_seen > 30, (taken, split_seen)


def test_split_map_rejects_overfull_batch():
    cu, seq_lens = [0, 33, 34], [33, 50]  # 3 + 1 tiles of 16 rows
    assert prefill_split_map(cu, seq_lens, 16, 4, 2, 100, 8).shape == (4, SPLIT_MAP_COLUMNS)
    with pytest.raises(ValueError, match="4 query tiles"):
        prefill_split_map(cu, seq_lens, 16, 3, 2, 100, 8)


def test_max_kv_partials_bounds_scratch():
    # At most 32K (query row, head) pairs of fp32 partial outputs: 16 MiB at head_dim 128, whatever the bucket.
    for block_m in (16, 32, 64, 128):
        for num_heads in (1, 8, 16, 32, 64):
            assert max_kv_partials(block_m, num_heads) * block_m * num_heads <= max(1 << 15, 2 * block_m * num_heads)
    assert max_kv_partials(16, 16) == 128 and max_kv_partials(128, 16) == 16


def test_split_scratch_views_share_memory():
    a, b = split_scratch_views([(8, 16), (2, 64)], num_heads=4, head_dim=64, device="cpu")
    assert a.out.shape == (8, 4, 16, 64) and b.out.shape == (2, 4, 64, 64) and b.lse.shape == (2, 4, 64)
    assert a.out.data_ptr() == b.out.data_ptr() and a.count.data_ptr() == b.count.data_ptr()
    assert a.max_partials == 8 and (a.count == 0).all()


# --- the kernel -------------------------------------------------------------------------------------------------

# (dtype, head_dim, num_q_heads, num_kv_heads, block_size, block_m, [(q_len, seq_len), ...]): GQA ratios 1/2/7/8,
# head_dim 64/128, short chunks over long cached prefixes (split), one-row decode entries with long contexts
# (split) and short ones, odd lengths off the page and key tile sizes, an empty entry, a fully new prompt; the
# last is the prefix benchmark's step in small (2 query heads per kv head, 64-row tiles, 50 tokens over 900).
SPLIT_CASES = [
    (torch.float32, 64, 2, 2, 16, 16, [(20, 450), (1, 301), (0, 9), (37, 37)]),
    (torch.float16, 128, 14, 2, 8, 16, [(5, 389), (1, 3), (12, 30)]),
    (torch.float32, 64, 8, 1, 32, 32, [(33, 300), (1, 260)]),
    (torch.float32, 128, 2, 1, 16, 16, [(1, 613), (1, 300), (3, 3), (17, 290)]),
    (torch.float16, 128, 4, 2, 16, 64, [(50, 950), (1, 390), (3, 3)]),
]


def _split_packs(case) -> list[int]:
    """One query head per program, and all of a kv head's, where they differ."""
    return sorted({1, case[2] // case[3]})


def _case_inputs(case, make_paged_kv, gen, device):
    dtype, head_dim, num_q_heads, num_kv_heads, block_size, block_m, lens = case
    q_lens, seq_lens = [q for q, _ in lens], [s for _, s in lens]
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    cu = torch.tensor(_cu(q_lens), dtype=torch.int32, device=device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return (q, k_cache, v_cache, cu, seq, block_tables, max(q_lens), head_dim**-0.5), block_m


@pytest.mark.parametrize("case", SPLIT_CASES, ids=range(len(SPLIT_CASES)))
@pytest.mark.parametrize("packed", [False, True], ids=["pack_1", "pack_group"])
def test_split_kernel_matches_ref(case, packed, make_paged_kv, gen, device, tol):
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    args, block_m = _case_inputs(case, make_paged_kv, gen, device)
    q, _, _, cu, seq = args[:5]
    pack = max(_split_packs(case)) if packed else 1
    num_heads, head_dim = q.shape[1] // pack, q.shape[2]
    max_partials = 24
    # Room for every split, and padding rows past them (which must write nothing).
    num_rows = max_prefill_tiles(q.shape[0], len(seq), block_m, pack) + max_partials + 3
    # A small GPU (64 programs at once) and 128-key pieces, so that these small inputs split.
    split_map = prefill_split_map(cu.tolist(), seq.tolist(), block_m, num_rows, num_heads, 64, max_partials, 128,
                                  pack)  # fmt: skip
    assert _check_split_map(split_map, cu.tolist(), seq.tolist(), block_m, num_rows, max_partials, pack) > 1
    scratch = SplitScratch.allocate(max_partials, num_heads, block_m, head_dim, device)
    tile_map = torch.from_numpy(split_map).to(device)
    want = prefill_attention_ref(*args)
    for _ in range(2):  # the second call reuses the scratch: its counters must be back at zero
        out = torch.full_like(q, float("nan"))
        got = prefill_attention(*args, out=out, tile_map=tile_map, block_m=block_m, split_scratch=scratch,
                                pack=pack)  # fmt: skip
        assert got is out
        assert torch.isfinite(got).all(), "every token row must be written exactly by its tile's merge or program"
        torch.testing.assert_close(got, want, **tol[q.dtype])
        assert (scratch.count == 0).all()


def test_split_kernel_16_bit_partials(make_paged_kv, gen, device, tol):
    """Partial outputs kept in the inputs' 16-bit dtype: one more rounding, within the dtype's tolerance."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    case = SPLIT_CASES[4]
    args, block_m = _case_inputs(case, make_paged_kv, gen, device)
    q, _, _, cu, seq = args[:5]
    pack = q.shape[1] // args[1].shape[2]
    num_rows = max_prefill_tiles(q.shape[0], len(seq), block_m, pack) + 12
    split_map = prefill_split_map(cu.tolist(), seq.tolist(), block_m, num_rows, q.shape[1] // pack, 64, 12, 128,
                                  pack)  # fmt: skip
    assert split_map[:, 6].max() > 1
    scratch = SplitScratch.allocate(12, q.shape[1] // pack, block_m, q.shape[2], device, q.dtype)
    out = torch.full_like(q, float("nan"))
    prefill_attention(*args, out=out, tile_map=torch.from_numpy(split_map).to(device), block_m=block_m,
                      split_scratch=scratch, pack=pack)  # fmt: skip
    torch.testing.assert_close(out, prefill_attention_ref(*args), **tol[q.dtype])
    assert (scratch.count == 0).all()


@pytest.mark.parametrize("case", [0, 4])
def test_split_kernel_leaves_uncovered_rows(case, make_paged_kv, gen, device, tol):
    """Padded token rows past the batch's last sequence keep their contents, split tiles or not."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    args, block_m = _case_inputs(SPLIT_CASES[case], make_paged_kv, gen, device)
    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = args
    pack = q.shape[1] // k_cache.shape[2]  # the default
    n, pad = q.shape[0], 5
    q_pad = torch.cat([q, torch.randn(pad, *q.shape[1:], generator=gen).to(q.device, q.dtype)])
    split_map = prefill_split_map(cu.tolist(), seq.tolist(), block_m, 20, q.shape[1] // pack, 64, 10, 128, pack)
    assert split_map[:, 6].max() > 1
    tile_map = torch.from_numpy(split_map).to(device)
    scratch = SplitScratch.allocate(10, q.shape[1] // pack, block_m, q.shape[2], device)
    out = torch.full_like(q_pad, 7.0)
    prefill_attention(q_pad, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out, tile_map=tile_map,
                      block_m=block_m, split_scratch=scratch)  # fmt: skip
    assert (out[n:] == 7.0).all()
    torch.testing.assert_close(out[:n], prefill_attention_ref(*args), **tol[q.dtype])


def test_eager_call_splits_long_cached_prefix(make_paged_kv, gen, device, tol):
    """Without a map the kernel builds one itself, with the default policy: a short chunk over a long cached
    prefix splits (checked on the same map built here), and the result matches."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    case = (torch.float32, 64, 2, 1, 16, 16, [(20, 1300), (1, 40)])
    args, _ = _case_inputs(case, make_paged_kv, gen, device)
    cu, seq = args[3].tolist(), args[4].tolist()
    # The default: one program per kv head serving both query heads, 40 query rows -> 16-row tiles.
    pack, block_m = 2, prefill_block_m(20, 2)
    concurrency = H200_SMS * prefill_programs_per_sm(block_m)
    num_rows, max_partials = 5 + max_kv_partials(block_m, 1), max_kv_partials(block_m, 1)
    split_map = prefill_split_map(cu, seq, block_m, num_rows, 1, concurrency, max_partials, pack=pack)
    assert _check_split_map(split_map, cu, seq, block_m, num_rows, max_partials, pack) > 1
    torch.testing.assert_close(prefill_attention(*args), prefill_attention_ref(*args), **tol[torch.float32])


# --- the callers that build maps ------------------------------------------------------------------------------


class _TinyModel(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        from nanoserve.layers.attention import Attention

        self.attn = Attention(num_heads, num_kv_heads, head_dim)


def _metadata(q_lens, seq_lens, block_tables, num_decodes, device):
    from nanoserve.layers.attention import AttentionMetadata

    cu = _cu(q_lens)
    return AttentionMetadata(
        slot_mapping=torch.full((cu[-1],), -1, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        max_seqlen_q=max(q_lens),
        num_decodes=num_decodes,
        seq_lens_cpu=seq_lens,
        cu_seqlens_q_cpu=cu,
    )


def test_graph_runner_maps_match_ref(make_paged_kv, gen, device, tol):
    """Two steps through one PrefillGraphRunner's static buffers (as before two replays), attention run on the
    bucket's tensors as the captured graph would: a cached-prefix step that splits, then one that does not."""
    from nanoserve.kernels.prefill import PrefillPlanner, prefill_attention_ref
    from nanoserve.layers.attention import TritonBackend
    from nanoserve.layers.step_plan import KernelPlanner
    from nanoserve.worker.cuda_graphs import PrefillGraphRunner

    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    steps = [[(1, 300), (20, 700), (3, 3)], [(30, 30), (2, 17)]]
    all_lens = [s for step in steps for _, s in step]
    k_cache, v_cache, tables = make_paged_kv(all_lens, num_kv_heads, head_dim, block_size, torch.float32, gen)
    planner = KernelPlanner(prefill=PrefillPlanner(num_heads, num_kv_heads, H200_SMS))
    runner = PrefillGraphRunner(_TinyModel(num_heads, num_kv_heads, head_dim), 64, 4, tables.shape[1],
                                torch.device(device), planner)
    first = 0
    for i, step in enumerate(steps):
        q_lens, seq_lens = [q for q, _ in step], [s for _, s in step]
        rows = tables[first : first + len(step)]
        first += len(step)
        meta = _metadata(q_lens, seq_lens, rows, 0, device)
        n = sum(q_lens)
        t = runner.prepare(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), meta)
        _, _, bucket_meta = runner._args(t)
        split_map = bucket_meta.tile_map.cpu().numpy()
        assert runner.pack == bucket_meta.pack == 2
        launch = runner.launches[t]
        splits = _check_split_map(split_map, meta.cu_seqlens_q_cpu, seq_lens, launch.block_m, launch.num_rows,
                                  launch.max_partials, runner.pack)  # fmt: skip
        assert (splits > 1) == (i == 0)
        q = torch.randn(t, num_heads, head_dim, generator=gen).to(device)  # rows past n are padding
        got = TritonBackend.attend(q, k_cache, v_cache, bucket_meta, head_dim**-0.5)
        want = prefill_attention_ref(q[:n], k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, rows, 1,
                                     head_dim**-0.5)  # fmt: skip
        torch.testing.assert_close(got[:n], want, **tol[torch.float32])
        assert (runner.split_scratch[t].count == 0).all()


def test_eager_step_with_decodes_matches_ref(make_paged_kv, gen, device, tol):
    """An eager mixed step: decodes through the decode kernel, the prefill part through its own split map."""
    from nanoserve.kernels.prefill import PrefillPlanner, prefill_attention_ref
    from nanoserve.layers.attention import TritonBackend
    from nanoserve.worker.cuda_graphs import eager_tile_map

    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    lens = [(1, 50), (1, 9), (24, 900), (5, 5)]
    q_lens, seq_lens = [q for q, _ in lens], [s for _, s in lens]
    k_cache, v_cache, tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(device)
    want = prefill_attention_ref(q, k_cache, v_cache, _metadata(q_lens, seq_lens, tables, 2, device).cu_seqlens_q,
                                 torch.tensor(seq_lens, dtype=torch.int32, device=device), tables, 24,
                                 head_dim**-0.5)  # fmt: skip
    # Packed (as the model runner plans it), and one query head per program.
    for planner, pack in ((PrefillPlanner(num_heads, num_kv_heads, H200_SMS), 2),
                          (PrefillPlanner(num_heads, num_kv_heads, H200_SMS, pack=1), 1)):
        meta = _metadata(q_lens, seq_lens, tables, 2, device)
        eager_tile_map(meta, torch.device(device), head_dim, planner)
        assert meta.pack == pack and meta.split_scratch.count.shape[1] == num_heads // pack
        assert meta.tile_map.shape[1] == SPLIT_MAP_COLUMNS and int(meta.tile_map[:, 6].max()) > 1
        assert (meta.tile_map[:, 0] >= 0).all(), "an eager launch gets no padding rows"
        got = TritonBackend.attend(q, k_cache, v_cache, meta, head_dim**-0.5)
        torch.testing.assert_close(got, want, **tol[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("pack", [1, 2])
def test_split_kernel_cuda_graph_replays(pack, make_paged_kv, gen):
    """One graph captured over a bucket's tensors (bf16, Qwen3-0.6B heads) replays steps that split differently
    or not at all: each step's split map and lengths are copied in before its replay. A replay gives the same
    bits every time (the merge's order does not depend on which split finishes last)."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    num_q_heads, num_kv_heads, head_dim, block_size = 16, 8, 128, 16
    num_tokens, max_num_seqs, sms = 128, 8, torch.cuda.get_device_properties(0).multi_processor_count
    steps = [[(100, 2100)], [(60, 60), (1, 3000), (1, 17), (30, 4000)], [(128, 128)], [(7, 9000), (2, 2)]]
    all_lens = [s for step in steps for _, s in step]
    k_cache, v_cache, tables = make_paged_kv(all_lens, num_kv_heads, head_dim, block_size, torch.bfloat16, gen)
    heads = num_q_heads // pack
    block_m = prefill_block_m(num_tokens, pack)
    num_rows = max_prefill_tiles(num_tokens, max_num_seqs, block_m, pack)
    max_partials = max_kv_partials(block_m, heads)
    concurrency = sms * prefill_programs_per_sm(block_m)
    scratch = SplitScratch.allocate(max_partials, heads, block_m, head_dim, "cuda")
    q = torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    cu = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device="cuda")
    seq = torch.zeros(max_num_seqs, dtype=torch.int32, device="cuda")
    block_tables = torch.zeros(max_num_seqs, tables.shape[1], dtype=torch.int32, device="cuda")
    tile_map = torch.full((num_rows, SPLIT_MAP_COLUMNS), -1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    args = (q, k_cache, v_cache, cu, seq, block_tables, num_tokens, head_dim**-0.5)

    def call():
        prefill_attention(*args, out=out, tile_map=tile_map, block_m=block_m, split_scratch=scratch, pack=pack)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    first, split_seen = 0, []
    for step in steps:
        q_lens, seq_lens = [ql for ql, _ in step], [s for _, s in step]
        b, n = len(step), sum(q_lens)
        cu_list = _cu(q_lens)
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        cu.copy_(torch.tensor(cu_list + [n] * (max_num_seqs - b), dtype=torch.int32))
        seq.copy_(torch.tensor(seq_lens + [0] * (max_num_seqs - b), dtype=torch.int32))
        block_tables[:b].copy_(tables[first : first + b])
        first += b
        split_map = prefill_split_map(cu_list, seq_lens, block_m, num_rows, heads, concurrency, max_partials,
                                      pack=pack)  # fmt: skip
        split_seen.append(int(split_map[:, 6].max()) > 1)
        tile_map.copy_(torch.from_numpy(split_map))
        out.fill_(float("nan"))
        graph.replay()
        want = prefill_attention_ref(q[:n], k_cache, v_cache, cu[: b + 1], seq[:b], block_tables[:b], n, head_dim**-0.5)
        torch.testing.assert_close(out[:n], want, atol=2e-2, rtol=2e-2)
        assert (scratch.count == 0).all()
        first_out = out[:n].clone()
        for _ in range(3):
            graph.replay()
            assert torch.equal(out[:n], first_out)
    assert split_seen[0] and not split_seen[2]
