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
