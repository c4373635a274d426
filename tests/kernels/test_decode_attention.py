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
    # 64 sequences in 16 bits: 128-key tiles in three stages; lengths off both tiles, one of them 0.
    (torch.float16, 64, 2, 1, 16, [i * 37 % 301 for i in range(64)], 2),
]

# The one-launch path, one case per batch size 1..9 and then the merge's extremes: GQA ratios 1/2/4/7/8,
# head_dim 64/128, odd lengths off the block size and the 64-key tile, length-0 padding rows, 1/2/3/16
# splits, more splits than a sequence has key tiles (empty splits still count), and the most splits.
FUSED_CASES = [
    (torch.float32, 128, 32, 8, 16, [131], 16),  # Llama-3.1-8B's heads at batch 1: 3 tiles, 16 splits
    (torch.float16, 128, 16, 8, 16, [1, 77], 2),  # Qwen3-0.6B's heads
    (torch.float32, 64, 7, 1, 32, [33, 201, 95], 3),
    (torch.float16, 64, 16, 2, 8, [65, 1, 299, 0], 1),  # one split: the output is written directly
    (torch.float32, 64, 2, 1, 16, [1101, 7, 129, 63, 255], 16),  # 1,101 keys: 9 splits of 2 tiles
    (torch.float16, 128, 8, 4, 32, [3, 0, 65, 191, 17, 257], 3),
    (torch.float32, 128, 8, 1, 16, [5, 9, 13, 129, 1, 63, 67], 7),
    (torch.float16, 64, 14, 2, 16, [45, 3, 99, 161, 0, 23, 1, 201], 2),
    (torch.float32, 64, 4, 2, 128, [1, 3, 5, 7, 127, 129, 131, 255, 385], 2),
    (torch.float32, 64, 8, 1, 128, [2601, 71], 40),  # 41 tiles over 40 splits, merged 16 splits at a time
    (torch.float16, 128, 2, 1, 16, [301], 48),  # 48 splits, all but 5 empty, merged 32 at a time
    (torch.float32, 64, 1, 1, 128, [8191], 128),  # the most splits, one tile each, merged at once
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


@pytest.mark.parametrize("case", FUSED_CASES, ids=range(len(FUSED_CASES)))
def test_fused_decode_matches_ref(case, make_paged_kv, gen, device, tol):
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    q, k_cache, v_cache, seq, block_tables, scale, num_splits = _inputs(case, make_paged_kv, gen, device)
    batch, num_kv_heads = q.shape[0], k_cache.shape[2]
    want = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale)
    # Spare slots past batch * num_kv_heads (a buffer sized for the largest batch) must be left alone.
    counters = torch.full((batch * num_kv_heads + 3,), 7, dtype=torch.int32, device=device)
    counters[: batch * num_kv_heads] = 0
    spare = counters[batch * num_kv_heads :].clone()
    outs = []
    # Twice with one buffer: the kernel must leave every counter at zero for the next launch.
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        got = decode_attention(
            q, k_cache, v_cache, seq, block_tables, scale, num_splits=num_splits, out=out, counters=counters
        )
        assert got is out and got.dtype == q.dtype
        assert (counters[: batch * num_kv_heads] == 0).all(), "the merging program must reset its counter"
        assert torch.equal(counters[batch * num_kv_heads :], spare)
        assert torch.isfinite(got).all(), "every output element must be written (and no NaN read)"
        torch.testing.assert_close(got, want, **tol[q.dtype])
        outs.append(got)
    assert torch.equal(outs[0], outs[1])


def test_fused_decode_strided_views(make_paged_kv, gen, device, tol):
    """As the attention layer calls it: q and out are the decode rows of larger [tokens, heads, dim]
    tensors, and the counter buffer is sized for more sequences than this batch has."""
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    case = (torch.float32, 64, 4, 2, 16, [37, 0, 150], None)
    q, k_cache, v_cache, seq, block_tables, scale, _ = _inputs(case, make_paged_kv, gen, device)
    q_all = torch.cat([q, torch.randn(5, *q.shape[1:], generator=gen).to(device)])
    out_all = torch.full_like(q_all, float("nan"))
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    decode_attention(q_all[:3], k_cache, v_cache, seq, block_tables, scale, out=out_all[:3], counters=counters)
    torch.testing.assert_close(out_all[:3], decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale),
                               **tol[q.dtype])
    assert out_all[3:].isnan().all() and (counters == 0).all()


def test_default_num_splits():
    from nanoserve.kernels.decode_launch import default_num_splits

    # Qwen3-0.6B / Llama-3.1-8B (8 kv heads) in a graph sized for 40,960 keys: 16 splits at batch 1, two up to
    # 1,024 programs (batch 128), then one: the grid fills the GPU and the reduce launch is saved.
    assert [default_num_splits(b, 8, 40960) for b in (1, 8, 64, 128, 129, 256)] == [16, 16, 2, 2, 1, 1]
    # Never a split under 64 keys.
    assert default_num_splits(1, 8, 100) == 2 and default_num_splits(1, 8, 64) == 1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6], FUSED_CASES[7]], ids=range(4))
def test_dispatch_order_leaves_outputs_alone(case, fused, make_paged_kv, gen, device):
    """A dispatch order (longest first, as the decode graphs give it, or any permutation) changes which program
    runs when, never what a sequence's row holds: bit for bit the unordered launch, on every path (one split, the
    reduce launch, the merge in the same launch)."""
    from nanoserve.kernels.decode_attention import decode_attention

    q, k_cache, v_cache, seq, block_tables, scale, num_splits = _inputs(case, make_paged_kv, gen, device)
    batch = q.shape[0]
    counters = torch.zeros(batch * k_cache.shape[2], dtype=torch.int32, device=device) if fused else None
    want = decode_attention(q, k_cache, v_cache, seq, block_tables, scale, num_splits=num_splits, counters=counters)
    # (The identity order, too, gave the unordered launch's bytes; dropped for CI's time.)
    for order in (torch.argsort(seq, descending=True, stable=True), torch.randperm(batch, generator=gen).to(device)):
        got = decode_attention(q, k_cache, v_cache, seq, block_tables, scale, num_splits=num_splits,
                               counters=counters, order=order)
        assert torch.equal(got, want)


@pytest.mark.parametrize("window,sinks", [(5, False), (17, True), (None, True), (100, True)])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], FUSED_CASES[4]], ids=range(3))
def test_decode_window_and_sinks(case, window, sinks, make_paged_kv, dense_attention, gen, device, tol):
    """A sliding window (the query sees the last `window` keys; splits share those out) and attention sinks (each
    query head's logit in the denominator, once over the splits), on the one-split, reduce and one-launch paths."""
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    q, k_cache, v_cache, seq, block_tables, scale, num_splits = _inputs(case, make_paged_kv, gen, device)
    sink = (torch.randn(q.shape[1], generator=gen) * 2).to(device) if sinks else None
    want = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale, window=window, sinks=sink)
    for b, seq_len in enumerate(seq.tolist()):
        if seq_len:
            dense = dense_attention(q[b : b + 1], k_cache, v_cache, block_tables[b], seq_len, scale, window, sink)
            torch.testing.assert_close(want[b].float(), dense[0], **tol[q.dtype])
    for splits in {1, num_splits}:
        for counters in (None, torch.zeros(q.shape[0] * k_cache.shape[2], dtype=torch.int32, device=device)):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, k_cache, v_cache, seq, block_tables, scale, num_splits=splits, out=out,
                             counters=counters, window=window, sinks=sink)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, want, **tol[q.dtype])


@pytest.mark.parametrize("case,window", [(CASES[1], None), (CASES[3], 17), (FUSED_CASES[4], 17)], ids=range(3))
def test_decode_softcap(case, window, make_paged_kv, dense_attention, gen, device, tol):
    """Gemma 2's soft-capped scores (a cap of 2: the scores of random inputs reach past it), on the one-split, reduce
    and one-launch paths, with and without a window."""
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    q, k_cache, v_cache, seq, block_tables, scale, num_splits = _inputs(case, make_paged_kv, gen, device)
    cap = 2.0
    want = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale, window=window, softcap=cap)
    uncapped = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale, window=window)
    assert not torch.allclose(want, uncapped, **tol[q.dtype])
    for b, seq_len in enumerate(seq.tolist()):
        if seq_len:
            dense = dense_attention(q[b : b + 1], k_cache, v_cache, block_tables[b], seq_len, scale, window,
                                    softcap=cap)
            torch.testing.assert_close(want[b].float(), dense[0], **tol[q.dtype])
    for splits in {1, num_splits}:
        for counters in (None, torch.zeros(q.shape[0] * k_cache.shape[2], dtype=torch.int32, device=device)):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, k_cache, v_cache, seq, block_tables, scale, num_splits=splits, out=out,
                             counters=counters, window=window, softcap=cap)
            torch.testing.assert_close(out, want, **tol[q.dtype])


@pytest.mark.parametrize("case", [(torch.float16, 256, 4, 2, 16, [70, 1, 130], 3),
                                  (torch.float32, 256, 2, 1, 16, [200, 65], 2)], ids=range(2))
def test_head_dim_256(case, make_paged_kv, dense_attention, gen, device, tol):
    """Gemma 2's and Gemma 3 1B-12B's heads (their own tile rule, decode_launch.py): one split, the reduce launch and
    the one-launch merge against the reference, which is checked against dense attention."""
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    q, k_cache, v_cache, seq, block_tables, scale, num_splits = _inputs(case, make_paged_kv, gen, device)
    want = decode_attention_ref(q, k_cache, v_cache, seq, block_tables, scale, window=40)
    dense = dense_attention(q[:1], k_cache, v_cache, block_tables[0], int(seq[0]), scale, 40)
    torch.testing.assert_close(want[0].float(), dense[0], **tol[q.dtype])
    for splits, counters in ((1, None), (num_splits, None),
                             (num_splits, torch.zeros(q.shape[0] * k_cache.shape[2], dtype=torch.int32,
                                                      device=device))):
        got = decode_attention(q, k_cache, v_cache, seq, block_tables, scale, num_splits=splits, counters=counters,
                               window=40)
        torch.testing.assert_close(got, want, **tol[q.dtype])
