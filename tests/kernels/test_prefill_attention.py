import numpy as np
import pytest
import torch

# (dtype, head_dim, num_q_heads, num_kv_heads, block_size, [(q_len, seq_len), ...]): together they cover
# GQA ratios 1/2/7/8, head_dim 64/128, block sizes 8/16/32/64, odd lengths and lengths off the block size,
# cached prefixes (q_len < seq_len), q_len 1 entries, an empty entry and several query tiles (q_len > 128).
CASES = [
    (torch.float32, 64, 4, 4, 16, [(19, 19), (1, 23), (5, 40), (33, 33)]),
    (torch.float16, 128, 14, 2, 8, [(7, 7), (12, 45), (1, 9)]),
    (torch.float16, 64, 8, 1, 32, [(40, 70), (0, 10), (3, 3)]),
    (torch.float32, 128, 2, 1, 16, [(130, 150)]),
    (torch.float16, 64, 6, 3, 64, [(1, 1), (1, 77), (1, 130)]),  # decode-only batch; page > key tile
]


def _inputs(case, make_paged_kv, gen, device):
    dtype, head_dim, num_q_heads, num_kv_heads, block_size, lens = case
    q_lens = [q for q, _ in lens]
    seq_lens = [s for _, s in lens]
    k_cache, v_cache, block_tables = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, cu, seq, block_tables, max(q_lens), head_dim**-0.5


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_prefill_ref_matches_dense(case, make_paged_kv, dense_attention, gen, device):
    from nanoserve.kernels.prefill import prefill_attention_ref

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    q = q.float()
    out = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale)
    for b in range(len(seq)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        want = dense_attention(q[lo:hi], k_cache, v_cache, block_tables[b], int(seq[b]), scale)
        torch.testing.assert_close(out[lo:hi], want, atol=1e-5, rtol=1e-5)


def _packs(case) -> list[int]:
    """One query head per program, and all of a kv head's (the default), where they differ."""
    group = case[2] // case[3]
    return sorted({1, group})


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_prefill_kernel_matches_ref(case, make_paged_kv, gen, device, tol):
    """Eager calls (the kernel builds its own map), packed by default and unpacked."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale)
    for pack in [None, *_packs(case)]:
        out = torch.full_like(q, float("nan"))
        got = prefill_attention(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out, pack=pack)
        assert got is out and got.dtype == q.dtype
        assert torch.isfinite(got).all(), "every output element must be written (and no NaN read from the cache)"
        torch.testing.assert_close(got, want, **tol[q.dtype])


@pytest.mark.parametrize("small_tiles", [False, True], ids=["step_block_m", "block_m_16"])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_prefill_tiled_matches_ref(case, small_tiles, make_paged_kv, gen, device, tol):
    """Unsplit maps (prefill_tile_map) with padding rows, packed and unpacked, tiles off the token boundaries."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref
    from nanoserve.kernels.prefill.tile_map import PADDING_ROW, max_prefill_tiles, prefill_block_m, prefill_tile_map

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale)
    for pack in _packs(case):
        block_m = 16 if small_tiles else prefill_block_m(q.shape[0], pack)
        # Padded well past what the batch needs: the padding rows must write nothing.
        num_tiles = max_prefill_tiles(q.shape[0], len(seq), block_m, pack) + 9
        tile_map_np = prefill_tile_map(cu.tolist(), seq.tolist(), block_m, num_tiles, pack)
        assert (tile_map_np[-9:] == PADDING_ROW).all() and (tile_map_np[:, 6] == 1).all()
        tile_map = torch.from_numpy(tile_map_np).to(device)
        out = torch.full_like(q, float("nan"))
        got = prefill_attention(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out,
                                tile_map=tile_map, block_m=block_m, pack=pack)  # fmt: skip
        assert got is out
        assert torch.isfinite(got).all(), "every token must be covered by exactly the tiles of its sequence"
        torch.testing.assert_close(got, want, **tol[q.dtype])


@pytest.mark.parametrize("pack", [1, 3])
def test_prefill_tile_map_order_and_coverage(pack):
    from nanoserve.kernels.prefill.tile_map import PADDING_ROW, SPLIT_MAP_COLUMNS, prefill_tile_map

    q_lens, seq_lens, block_m = [1, 40, 0, 70, 5], [9, 300, 4, 70, 5], 16
    cu = [0, 1, 41, 41, 111, 116]
    tile_map = prefill_tile_map(cu, seq_lens, block_m, num_tiles=30, pack=pack)
    assert tile_map.dtype == np.int32 and tile_map.shape == (30, SPLIT_MAP_COLUMNS)
    real = tile_map[tile_map[:, 0] >= 0]
    assert (tile_map[len(real) :] == PADDING_ROW).all()
    # Every query row of every sequence once, in tiles of block_m rows from each sequence's first.
    want = {(b, r) for b, q_len in enumerate(q_lens) for r in range(0, q_len * pack, block_m)}
    assert {(b, r) for b, r in real[:, :2].tolist()} == want and len(real) == len(want)
    for b, start, lo, hi, slot, split, splits, q_start, q_rows, pos0 in real.tolist():
        assert (lo, slot, split, splits) == (0, -1, 0, 1)
        assert (q_start, q_rows, pos0) == (cu[b], q_lens[b] * pack, seq_lens[b] - q_lens[b])
        # Keys up to the last valid row's token position.
        assert hi == pos0 + (min(start + block_m, q_rows) - 1) // pack + 1
    # The chunk of the 300-key sequence ending at its last key comes first; keys never increase after it.
    assert tuple(real[0, :4]) == (1, (40 * pack - 1) // block_m * block_m, 0, 300)
    keys = real[:, 3].tolist()
    assert keys == sorted(keys, reverse=True)


def test_prefill_tile_map_rejects_overfull_batch():
    from nanoserve.kernels.prefill.tile_map import prefill_tile_map

    cu, seq_lens = [0, 33, 34], [33, 50]  # 3 + 1 tiles of 16 rows; packed by 2, 5 + 1
    assert (prefill_tile_map(cu, seq_lens, 16, num_tiles=4)[:, 0] >= 0).all()
    with pytest.raises(ValueError, match="4 query tiles"):
        prefill_tile_map(cu, seq_lens, 16, num_tiles=3)
    assert (prefill_tile_map(cu, seq_lens, 16, num_tiles=6, pack=2)[:, 0] >= 0).all()
    with pytest.raises(ValueError, match="6 query tiles"):
        prefill_tile_map(cu, seq_lens, 16, num_tiles=5, pack=2)


def test_max_prefill_tiles_bounds_random_batches():
    from nanoserve.kernels.prefill.tile_map import max_prefill_tiles, prefill_block_m, prefill_tile_map

    rng = np.random.default_rng(0)
    for _ in range(300):
        num_tokens, max_num_seqs = int(rng.integers(1, 600)), int(rng.integers(1, 40))
        pack = int(rng.choice([1, 2, 4, 7, 8]))
        block_m = prefill_block_m(num_tokens, pack) if rng.random() < 0.5 else 16
        batch = int(rng.integers(1, max_num_seqs + 1))
        # A random split of at most num_tokens tokens, empty entries included.
        total = int(rng.integers(0, num_tokens + 1))
        cu = [0, *np.sort(rng.integers(0, total + 1, batch - 1)).tolist(), total]
        q_lens = np.diff(cu)
        seq_lens = (q_lens + rng.integers(0, 50, batch)).tolist()
        # Must not raise: the bound holds for every such batch.
        prefill_tile_map(cu, seq_lens, block_m, max_prefill_tiles(num_tokens, max_num_seqs, block_m, pack), pack)
    assert [prefill_block_m(n) for n in (1, 100, 300, 600, 5000)] == [16, 32, 64, 64, 64]
    # Qwen3-0.6B (2 query heads per kv head): the prefix benchmark's 100-token step runs in the 128-token bucket.
    assert [prefill_block_m(n, 2) for n in (16, 32, 64, 128, 256)] == [16, 16, 32, 64, 64]


@pytest.mark.parametrize("pack", [1, 2])
def test_prefill_tiled_reused_for_new_batch(pack, make_paged_kv, gen, device, tol):
    """One set of tensors, a second batch and its map written into them in place (as before a graph replay)."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref
    from nanoserve.kernels.prefill.tile_map import max_prefill_tiles, prefill_tile_map

    dtype, head_dim, num_q_heads, num_kv_heads, block_size = torch.float32, 64, 4, 2, 16
    num_tokens, max_num_seqs = 48, 4
    # Batch b fills all 48 token rows; batch a leaves 8 padding rows at the end and an empty entry.
    lens_a, lens_b = [(30, 30), (1, 60), (0, 0), (9, 25)], [(20, 20), (17, 100), (10, 10), (1, 33)]
    k_cache, v_cache, tables = make_paged_kv(
        [s for _, s in lens_a + lens_b], num_kv_heads, head_dim, block_size, dtype, gen
    )
    block_m = 16  # small tiles, so that sequences span several
    num_tiles = max_prefill_tiles(num_tokens, max_num_seqs, block_m, pack)
    q = torch.empty(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    cu = torch.empty(max_num_seqs + 1, dtype=torch.int32, device=device)
    seq = torch.empty(max_num_seqs, dtype=torch.int32, device=device)
    block_tables = torch.empty(max_num_seqs, tables.shape[1], dtype=torch.int32, device=device)
    tile_map = torch.empty(num_tiles, 10, dtype=torch.int32, device=device)
    out = torch.empty_like(q)

    def write_batch(lens, rows):
        cu_list = np.cumsum([0] + [ql for ql, _ in lens]).tolist()
        seq_list = [s for _, s in lens]
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        cu.copy_(torch.tensor(cu_list, dtype=torch.int32))
        seq.copy_(torch.tensor(seq_list, dtype=torch.int32))
        block_tables.copy_(tables[rows])
        tile_map.copy_(torch.from_numpy(prefill_tile_map(cu_list, seq_list, block_m, num_tiles, pack)))
        out.fill_(7.0)  # rows no tile covers must keep this

    args = (q, k_cache, v_cache, cu, seq, block_tables, num_tokens, head_dim**-0.5)
    for lens, rows in ((lens_a, slice(0, 4)), (lens_b, slice(4, 8))):
        write_batch(lens, rows)
        prefill_attention(*args, out=out, tile_map=tile_map, block_m=block_m, pack=pack)
        want = prefill_attention_ref(*args, out=torch.full_like(q, 7.0))
        torch.testing.assert_close(out, want, **tol[dtype])
    assert not (out == 7.0).any(), "the second batch covers every token row"


def test_prefill_padding_tiles_read_nothing(make_paged_kv, gen, device, tol):
    """Padding rows name sequence -1: the element before each metadata tensor must never be read.

    Each tensor is a view one element into a buffer whose leading element describes a real 4-token sequence
    at index -1, written to the 4 rows before out; a padding row that ran would overwrite them.
    """
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref
    from nanoserve.kernels.prefill.tile_map import prefill_tile_map

    dtype, head_dim, num_heads, block_size, q_len, seq_len = torch.float32, 64, 2, 16, 20, 30
    k_cache, v_cache, tables = make_paged_kv([seq_len], num_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype).to(device)
    cu = torch.tensor([-4, 0, q_len], dtype=torch.int32, device=device)[1:]
    seq = torch.tensor([4, seq_len], dtype=torch.int32, device=device)[1:]
    block_tables = tables[[0, 0]][1:]
    out_buf = torch.full((4 + q_len, num_heads, head_dim), 7.0, dtype=dtype, device=device)
    tile_map = torch.from_numpy(prefill_tile_map([0, q_len], [seq_len], 16, num_tiles=6)).to(device)
    args = (q, k_cache, v_cache, cu, seq, block_tables, q_len, head_dim**-0.5)
    prefill_attention(*args, out=out_buf[4:], tile_map=tile_map, block_m=16)
    assert (out_buf[:4] == 7.0).all()
    torch.testing.assert_close(out_buf[4:], prefill_attention_ref(*args), **tol[dtype])


# A sliding window (None, or keys after position - window) and attention sinks (gpt-oss) on mixed batches, the last
# case's short chunk over a long prefix split into key ranges, several of them wholly outside the window; a window
# of 150 leaves key tiles that every row of a tile sees (no mask) between those some rows lose and the diagonal.
WINDOW_CASES = [CASES[0], CASES[1], (torch.float32, 64, 4, 2, 16, [(20, 1400), (3, 300), (1, 1)])]


@pytest.mark.parametrize("window,sinks", [(5, False), (17, True), (None, True), (150, False)])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=range(len(WINDOW_CASES)))
def test_prefill_window_and_sinks(case, window, sinks, make_paged_kv, dense_attention, gen, device, tol):
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    sink = (torch.randn(q.shape[1], generator=gen) * 2).to(device) if sinks else None
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, window=window, sinks=sink)
    for b in range(len(seq)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        dense = dense_attention(q[lo:hi], k_cache, v_cache, block_tables[b], int(seq[b]), scale, window, sink)
        torch.testing.assert_close(want[lo:hi].float(), dense, **tol[q.dtype])
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out, window=window,
                            sinks=sink)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tol[q.dtype])


@pytest.mark.parametrize("case,window", [(WINDOW_CASES[0], None), (WINDOW_CASES[2], 150)], ids=range(2))
def test_prefill_softcap(case, window, make_paged_kv, dense_attention, gen, device, tol):
    """Gemma 2's soft-capped scores (cap 2, which random scores pass) on mixed batches and split key ranges."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, window=window, softcap=2.0)
    uncapped = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, window=window)
    assert not torch.allclose(want, uncapped, **tol[q.dtype])
    for b in range(len(seq)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        dense = dense_attention(q[lo:hi], k_cache, v_cache, block_tables[b], int(seq[b]), scale, window, softcap=2.0)
        torch.testing.assert_close(want[lo:hi].float(), dense, **tol[q.dtype])
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out, window=window,
                            softcap=2.0)
    torch.testing.assert_close(got, want, **tol[q.dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_head_dim_256(dtype, make_paged_kv, dense_attention, gen, device, tol):
    """Gemma 2's and Gemma 3 1B-12B's heads (32-key tiles, prefill_block_n): a mixed batch, one entry's keys split."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    case = (dtype, 256, 4, 2, 16, [(20, 300), (33, 33), (1, 9)])
    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, softcap=3.0)
    dense = dense_attention(q[:20], k_cache, v_cache, block_tables[0], 300, scale, softcap=3.0)
    torch.testing.assert_close(want[:20].float(), dense, **tol[dtype])
    got = prefill_attention(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, softcap=3.0)
    torch.testing.assert_close(got, want, **tol[dtype])
