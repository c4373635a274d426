"""chunk_attention: a sequence's attention computed piece by piece (a causal window of recent keys, then chunks of
older keys, in any order) and merged by log-sum-exp equals attention over all its keys at once."""

from pathlib import Path

import pytest
import torch

# (dtype, head_dim, num_q_heads, num_kv_heads, block_size, q_len, seq_len, window blocks, chunk blocks)
CASES = [
    (torch.float32, 64, 4, 2, 16, 19, 100, 2, 2),  # a prefill chunk over a window and three older chunks
    (torch.float16, 128, 8, 1, 8, 1, 77, 1, 3),  # a decode: one query, the window its partial last block
    (torch.float32, 64, 6, 3, 16, 40, 40, 3, 4),  # nothing older: the window alone
    (torch.float16, 64, 2, 2, 32, 70, 300, 3, 1),  # queries straddle a block boundary; one-block chunks
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("order,window", [("window_first", None), ("window_last", None), ("window_first", 5),
                                          ("window_last", 17)])
def test_pieces_merge_to_full_attention(case, order, window, make_paged_kv, dense_attention, gen, device):
    """(window: the sliding window, which leaves some pieces, or some of their rows, no visible key.)"""
    from nanoserve.kernels.chunk_attention import chunk_attention, chunk_attention_ref

    dtype, head_dim, hq, hkv, bs, q_len, seq_len, window_blocks, chunk_blocks = case
    k_cache, v_cache, tables = make_paged_kv([seq_len], hkv, head_dim, bs, dtype, gen)
    table = tables[0, :-(-seq_len // bs)]
    q = torch.randn(q_len, hq, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    want = dense_attention(q, k_cache, v_cache, table, seq_len, scale, window)

    # The window: the last window_blocks blocks, wherever the queries start.
    first_window = max(0, len(table) - window_blocks)
    first_window = min(first_window, (seq_len - q_len) // bs)  # the window holds every query's own key
    pieces = [(table[first_window:], seq_len - first_window * bs, first_window * bs)]
    older = [(table[i:min(i + chunk_blocks, first_window)], (min(i + chunk_blocks, first_window) - i) * bs, i * bs)
             for i in range(0, first_window, chunk_blocks)]
    pieces = pieces + older if order == "window_first" else older + pieces
    for fn in (chunk_attention, chunk_attention_ref):
        out = torch.full((q_len, hq, head_dim), float("nan"), device=device)
        lse = torch.full((q_len, hq), float("nan"), device=device)
        for i, (ids, num_keys, key_pos0) in enumerate(pieces):
            fn(q, k_cache, v_cache, ids.contiguous(), num_keys, key_pos0, seq_len - q_len, scale, out, lse,
               accumulate=i > 0, window=window)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("window", [None, 9])
def test_softcap_pieces_merge_to_full_attention(window, make_paged_kv, dense_attention, gen, device):
    """Gemma 2's soft-capped scores (cap 5: large scores, so the cap bites) in each piece, kernel and reference."""
    from nanoserve.kernels.chunk_attention import chunk_attention, chunk_attention_ref

    hq, hkv, d, bs, q_len, seq_len, cap = 4, 2, 64, 16, 11, 70, 5.0
    k_cache, v_cache, tables = make_paged_kv([seq_len], hkv, d, bs, torch.float32, gen)
    table = tables[0, :-(-seq_len // bs)]
    q = (torch.randn(q_len, hq, d, generator=gen) * 3).to(device)
    want = dense_attention(q, k_cache, v_cache, table, seq_len, d**-0.5, window, softcap=cap)
    assert not torch.allclose(want, dense_attention(q, k_cache, v_cache, table, seq_len, d**-0.5, window), atol=1e-3)
    pieces = [(table[2:], seq_len - 2 * bs, 2 * bs), (table[:2], 2 * bs, 0)]  # the recent keys, then older ones
    for fn in (chunk_attention, chunk_attention_ref):
        out, lse = torch.empty(q_len, hq, d, device=device), torch.empty(q_len, hq, device=device)
        for i, (ids, num_keys, key_pos0) in enumerate(pieces):
            fn(q, k_cache, v_cache, ids.contiguous(), num_keys, key_pos0, seq_len - q_len, d**-0.5, out, lse,
               accumulate=i > 0, window=window, softcap=cap)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_ring_slot_layout(gen, device):
    """Keys and values of a block side by side ([blocks, 2, block_size, Hkv, D], as the ring's slots hold them) read
    through strided views give what the pool's layout gives."""
    from nanoserve.kernels.chunk_attention import chunk_attention

    blocks, bs, hkv, d = 5, 16, 2, 64
    slot = torch.randn(blocks, 2, bs, hkv, d, generator=gen).to(device)
    q = torch.randn(7, 4, d, generator=gen).to(device)
    ids = torch.arange(blocks, dtype=torch.int32, device=device)
    results = []
    for k, v in ((slot[:, 0], slot[:, 1]), (slot[:, 0].contiguous(), slot[:, 1].contiguous())):
        out, lse = torch.empty(7, 4, d, device=device), torch.empty(7, 4, device=device)
        chunk_attention(q, k, v, ids, blocks * bs - 3, 0, 1000, d**-0.5, out, lse, accumulate=False)
        results.append((out, lse))
    torch.testing.assert_close(results[0], results[1])


def test_no_visible_key_gives_zero_weight(gen, device):
    """A piece whose keys all come after the queries adds nothing (lse -inf), and merging it changes nothing."""
    from nanoserve.kernels.chunk_attention import chunk_attention

    k = torch.randn(2, 16, 1, 64, generator=gen).to(device)
    v = torch.randn(2, 16, 1, 64, generator=gen).to(device)
    q = torch.randn(3, 2, 64, generator=gen).to(device)
    ids = torch.tensor([1, 0], dtype=torch.int32, device=device)
    out, lse = torch.empty(3, 2, 64, device=device), torch.empty(3, 2, device=device)
    chunk_attention(q, k, v, ids, 32, 0, 31, 0.125, out, lse, accumulate=False)
    before = (out.clone(), lse.clone())
    chunk_attention(q, k, v, ids, 32, 100, 31, 0.125, out, lse, accumulate=True)
    torch.testing.assert_close((out, lse), before)


def test_triton_alone_reads_triton_interpret():
    """Kernel or PyTorch is the attention backend's choice (layers/attention.py's backend_for, set by the model
    runner), compiled or interpreted Triton's own: no module of nanoserve reads TRITON_INTERPRET."""
    package = Path(__file__).resolve().parents[2] / "nanoserve"
    readers = [str(p.relative_to(package)) for p in package.rglob("*.py") if "TRITON_INTERPRET" in p.read_text()]
    assert not readers


@pytest.mark.parametrize("backend_name", ["TorchBackend", "TritonBackend"])
def test_long_context_pieces_take_the_layers_backend(backend_name, monkeypatch):
    """Long-context attention's pieces run what the layer's backend runs: the reference beside TorchBackend (even on
    a GPU, for a reference run), the kernel beside TritonBackend."""
    from nanoserve.kernels.chunk_attention import chunk_attention_ref
    from nanoserve.layers import attention

    backend = getattr(attention, backend_name)
    monkeypatch.setattr(backend, "attend", staticmethod(lambda q, *args: torch.zeros_like(q)))
    taken = []

    class LongContext:
        def attend(self, layer, q, k_cache, v_cache, out, scale, chunk_attention, window, sinks, softcap, k_scale,
                   v_scale) -> None:
            taken.append(chunk_attention)

    layer = attention.Attention(2, 1, 64)
    layer.backend = backend
    meta = attention.AttentionMetadata(torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int32),
                                       torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1,
                                       1, long_context=LongContext())
    layer.attend(torch.zeros(1, 2, 64), meta)
    # By name: tests/kernels/conftest.py reloads the kernel modules, so an earlier import may hold another copy.
    want = chunk_attention_ref if backend_name == "TorchBackend" else backend.chunk_attention
    assert [(f.__module__, f.__name__) for f in taken] == [(want.__module__, want.__name__)]
