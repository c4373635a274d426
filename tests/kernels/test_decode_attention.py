import pytest
import torch

# (dtype, head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, num_splits): GQA ratios 1/2/7/8,
# head_dim 64/128, block sizes 8/16/32/128, lengths off the block size and the 64-key tile, one split, more
# splits than a short sequence fills (neutral partials), the shape-derived default, and a length-0 row.
CASES = [
    (torch.float32, 64, 2, 2, 16, [1, 17, 100], 1),
    (torch.float16, 128, 14, 2, 8, [9, 70, 130], 3),
    (torch.float16, 64, 8, 1, 32, [33, 200], 8),
    (torch.float32, 128, 4, 2, 16, [5, 0, 150], None),
    (torch.float16, 64, 3, 3, 128, [300, 129], 2),
    (torch.float32, 64, 2, 1, 16, [1100, 3], 20),  # more than 16 splits in use: the reduce loops
]


def _inputs(case, make_paged_kv, gen, device):
    dtype, head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, num_splits = case
    k_cache, v_cache, block_tables = make_paged_kv(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, gen, pad_value=0
    )
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, seq, block_tables, head_dim**-0.5, num_splits


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_decode_ref_matches_dense(case, make_paged_kv, dense_attention, gen, device):
    from nanoserve.kernels.decode_attention import decode_attention_ref

    q, k_cache, v_cache, seq, block_tables, scale, _ = _inputs(case, make_paged_kv, gen, device)
    q = q.float()
    out = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale)
    for b, seq_len in enumerate(seq.tolist()):
        if seq_len == 0:
            assert (out[b] == 0).all()
            continue
        want = dense_attention(q[b : b + 1], k_cache, v_cache, block_tables[b], seq_len, scale)
        torch.testing.assert_close(out[b], want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_decode_kernel_matches_ref(case, make_paged_kv, gen, device, tol):
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    q, k_cache, v_cache, seq, block_tables, scale, num_splits = _inputs(case, make_paged_kv, gen, device)
    want = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k_cache, v_cache, seq, block_tables, scale, num_splits=num_splits, out=out)
    assert got is out and got.dtype == q.dtype
    assert torch.isfinite(got).all(), "every output element must be written (and no NaN read from the cache)"
    torch.testing.assert_close(got, want, **tol[q.dtype])
