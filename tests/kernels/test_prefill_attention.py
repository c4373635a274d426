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
    from nanoserve.kernels.prefill_attention import prefill_attention_ref

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    q = q.float()
    out = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale)
    for b in range(len(seq)):
        lo, hi = int(cu[b]), int(cu[b + 1])
        want = dense_attention(q[lo:hi], k_cache, v_cache, block_tables[b], int(seq[b]), scale)
        torch.testing.assert_close(out[lo:hi], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_prefill_kernel_matches_ref(case, make_paged_kv, gen, device, tol):
    from nanoserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale)
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out)
    assert got is out and got.dtype == q.dtype
    assert torch.isfinite(got).all(), "every output element must be written (and no NaN read from the cache)"
    torch.testing.assert_close(got, want, **tol[q.dtype])


def _tile_keys(tile_map, cu, seq_lens, block_m):
    """Keys each real row of a tile map visits: up to its last query's position, capped at seq_len."""
    keys = []
    for seq, start_m in tile_map.tolist():
        if seq >= 0:
            q_len = cu[seq + 1] - cu[seq]
            keys.append(min(seq_lens[seq], seq_lens[seq] - q_len + start_m + block_m))
    return keys


@pytest.mark.parametrize("small_tiles", [False, True], ids=["step_block_m", "block_m_16"])
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_prefill_tiled_matches_ref(case, small_tiles, make_paged_kv, gen, device, tol):
    from nanoserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from nanoserve.kernels.tile_map import max_prefill_tiles, prefill_block_m, prefill_tile_map

    q, k_cache, v_cache, cu, seq, block_tables, max_q, scale = _inputs(case, make_paged_kv, gen, device)
    block_m = 16 if small_tiles else prefill_block_m(q.shape[0])
    # Padded well past what the batch needs: the (-1, 0) rows must write nothing.
    num_tiles = max_prefill_tiles(q.shape[0], len(seq), block_m) + 9
    tile_map_np = prefill_tile_map(cu.tolist(), seq.tolist(), block_m, num_tiles)
    assert tile_map_np.shape == (num_tiles, 2) and (tile_map_np[-9:] == [-1, 0]).all()
    tile_map = torch.from_numpy(tile_map_np).to(device)
    want = prefill_attention_ref(q, k_cache, v_cache, cu, seq, block_tables, max_q, scale)
    out = torch.full_like(q, float("nan"))
    got = prefill_attention(
        q, k_cache, v_cache, cu, seq, block_tables, max_q, scale, out=out, tile_map=tile_map, block_m=block_m
    )
    assert got is out
    assert torch.isfinite(got).all(), "every token must be covered by exactly the tiles of its sequence"
    torch.testing.assert_close(got, want, **tol[q.dtype])


def test_prefill_tile_map_order_and_coverage():
    from nanoserve.kernels.tile_map import prefill_tile_map

    q_lens, seq_lens, block_m = [1, 40, 0, 70, 5], [9, 300, 4, 70, 5], 16
    cu = [0, 1, 41, 41, 111, 116]
    tile_map = prefill_tile_map(cu, seq_lens, block_m, num_tiles=20)
    assert tile_map.dtype == np.int32 and tile_map.shape == (20, 2)
    real = [tuple(r) for r in tile_map.tolist() if r[0] >= 0]
    want = {(b, s) for b, q_len in enumerate(q_lens) for s in range(0, q_len, block_m)}
    assert len(real) == len(want) and set(real) == want
    assert (tile_map[len(real) :] == [-1, 0]).all()
    keys = _tile_keys(tile_map, cu, seq_lens, block_m)
    # The chunk of the 300-key sequence ending at its last key comes first; keys never increase after it.
    assert real[0] == (1, 32) and keys[0] == 300
    assert keys == sorted(keys, reverse=True)


def test_prefill_tile_map_rejects_overfull_batch():
    from nanoserve.kernels.tile_map import prefill_tile_map

    cu, seq_lens = [0, 33, 34], [33, 50]  # 3 + 1 tiles of 16 rows
    assert (prefill_tile_map(cu, seq_lens, 16, num_tiles=4)[:, 0] >= 0).all()
    with pytest.raises(ValueError, match="4 query tiles"):
        prefill_tile_map(cu, seq_lens, 16, num_tiles=3)


def test_max_prefill_tiles_bounds_random_batches():
    from nanoserve.kernels.tile_map import max_prefill_tiles, prefill_block_m, prefill_tile_map

    rng = np.random.default_rng(0)
    for _ in range(300):
        num_tokens, max_num_seqs = int(rng.integers(1, 600)), int(rng.integers(1, 40))
        block_m = prefill_block_m(num_tokens) if rng.random() < 0.5 else 16
        batch = int(rng.integers(1, max_num_seqs + 1))
        # A random split of at most num_tokens tokens, empty entries included.
        total = int(rng.integers(0, num_tokens + 1))
        cu = [0, *np.sort(rng.integers(0, total + 1, batch - 1)).tolist(), total]
        q_lens = np.diff(cu)
        seq_lens = (q_lens + rng.integers(0, 50, batch)).tolist()
        # Must not raise: the bound holds for every such batch.
        prefill_tile_map(cu, seq_lens, block_m, max_prefill_tiles(num_tokens, max_num_seqs, block_m))
    assert [prefill_block_m(n) for n in (1, 100, 300, 600, 5000)] == [16, 16, 64, 128, 128]


def test_prefill_tiled_reused_for_new_batch(make_paged_kv, gen, device, tol):
    """One set of tensors, a second batch written into them in place (as before a graph replay)."""
    from nanoserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from nanoserve.kernels.tile_map import max_prefill_tiles, prefill_tile_map

    dtype, head_dim, num_q_heads, num_kv_heads, block_size = torch.float32, 64, 4, 2, 16
    num_tokens, max_num_seqs = 48, 4
    # Batch b fills all 48 token rows; batch a leaves 8 padding rows at the end and an empty entry.
    lens_a, lens_b = [(30, 30), (1, 60), (0, 0), (9, 25)], [(20, 20), (17, 100), (10, 10), (1, 33)]
    k_cache, v_cache, tables = make_paged_kv(
        [s for _, s in lens_a + lens_b], num_kv_heads, head_dim, block_size, dtype, gen
    )
    block_m = 16  # small tiles, so that sequences span several
    num_tiles = max_prefill_tiles(num_tokens, max_num_seqs, block_m)
    q = torch.empty(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    cu = torch.empty(max_num_seqs + 1, dtype=torch.int32, device=device)
    seq = torch.empty(max_num_seqs, dtype=torch.int32, device=device)
    block_tables = torch.empty(max_num_seqs, tables.shape[1], dtype=torch.int32, device=device)
    tile_map = torch.empty(num_tiles, 2, dtype=torch.int32, device=device)
    out = torch.empty_like(q)

    def write_batch(lens, rows):
        cu_list = np.cumsum([0] + [ql for ql, _ in lens]).tolist()
        seq_list = [s for _, s in lens]
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        cu.copy_(torch.tensor(cu_list, dtype=torch.int32))
        seq.copy_(torch.tensor(seq_list, dtype=torch.int32))
        block_tables.copy_(tables[rows])
        tile_map.copy_(torch.from_numpy(prefill_tile_map(cu_list, seq_list, block_m, num_tiles)))
        out.fill_(7.0)  # rows no tile covers must keep this

    args = (q, k_cache, v_cache, cu, seq, block_tables, num_tokens, head_dim**-0.5)
    for lens, rows in ((lens_a, slice(0, 4)), (lens_b, slice(4, 8))):
        write_batch(lens, rows)
        prefill_attention(*args, out=out, tile_map=tile_map, block_m=block_m)
        want = prefill_attention_ref(*args, out=torch.full_like(q, 7.0))
        torch.testing.assert_close(out, want, **tol[dtype])
    assert not (out == 7.0).any(), "the second batch covers every token row"


def test_prefill_padding_tiles_read_nothing(make_paged_kv, gen, device, tol):
    """Padding rows name sequence -1: the element before each metadata tensor must never be read.

    Each tensor is a view one element into a buffer whose leading element describes a real 4-token sequence
    at index -1, written to the 4 rows before out; a padding row that ran would overwrite them.
    """
    from nanoserve.kernels.prefill_attention import prefill_attention, prefill_attention_ref
    from nanoserve.kernels.tile_map import prefill_tile_map

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
