"""The fp8 KV cache (kv_cache_dtype fp8) through every kernel that writes or reads it, against the PyTorch references
on random inputs: stores quantize (x / scale, clamped to +-448), reads take the layer's k_scale / v_scale. On the CPU
the interpreter runs them (it loads and stores float8e4nv); queries fp32 and fp16, the cache fp8."""

import pytest
import torch

from nanoserve.kernels.kv_quant import FP8_MAX, dequantize_kv, quantize_kv

FP8 = torch.float8_e4m3fn
# Scales that make the stored values use fp8's range: random K/V (|x| up to ~4) over 0.02 reach past 448 and clamp.
K_SCALE, V_SCALE = 0.02, 0.05


def _fp8_paged_kv(make_paged_kv, seq_lens, hkv, head_dim, block_size, gen, **kw):
    """make_paged_kv's NaN-poisoned caches and block table, the caches stored as fp8 with K_SCALE / V_SCALE."""
    k, v, tables = make_paged_kv(seq_lens, hkv, head_dim, block_size, torch.float32, gen, **kw)
    return quantize_kv(k * 2, FP8, K_SCALE), quantize_kv(v, FP8, V_SCALE), tables


def _assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Stored fp8 values as the reference stores them, but for a few: Triton's interpreter rounds some fp32 values to
    fp8 wrongly (124.0 to 64.0 where torch and the GPU give 128.0: a rounding that carries into the exponent loses
    it), and on a GPU the fp32 division may differ in its last bit, which can move a rounding by a step."""
    same = (got.view(torch.uint8) == want.view(torch.uint8)) | (got.isnan() & want.isnan())
    assert same.float().mean() > 0.97
    ratio = got.float()[~same] / want.float()[~same]
    assert ((ratio >= 0.5) & (ratio <= 2)).all()


def test_quantize_kv_rounds_clamps_and_scales():
    x = torch.tensor([0.3, -1.0, 100.0, -100.0, 8.96])
    stored = quantize_kv(x, FP8, 0.02)
    assert stored.dtype == FP8
    back = dequantize_kv(stored, torch.float32, 0.02)
    torch.testing.assert_close(back[[2, 3]], torch.tensor([FP8_MAX, -FP8_MAX]) * 0.02)  # clamped, not NaN
    torch.testing.assert_close(back[[0, 1, 4]], x[[0, 1, 4]], rtol=2**-4, atol=0)  # 3 mantissa bits: half a step
    assert quantize_kv(x, torch.float16, 0.02).dtype == torch.float16  # other caches ignore the scale
    torch.testing.assert_close(dequantize_kv(x.half(), torch.float32, 0.02), x.half().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_fp8(dtype, device, gen):
    from nanoserve.kernels.kv_store import store_kvcache, store_kvcache_ref

    tokens, hkv, d, bs, blocks = 9, 2, 64, 8, 4
    key = (torch.randn(tokens, hkv, d, generator=gen) * 4).to(device, dtype)
    value = torch.randn(tokens, hkv, d, generator=gen).to(device, dtype)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
    slots[[2, 7]] = -1
    k_cache = quantize_kv(torch.randn(blocks, bs, hkv, d, generator=gen), FP8).to(device)
    v_cache = quantize_kv(torch.randn(blocks, bs, hkv, d, generator=gen), FP8).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slots.to(device), K_SCALE, V_SCALE)
    store_kvcache_ref(key, value, k_ref, v_ref, slots.to(device), K_SCALE, V_SCALE)
    _assert_same_fp8(k_cache, k_ref)
    _assert_same_fp8(v_cache, v_ref)


@pytest.mark.parametrize("norm", [False, True])
def test_qkv_rope_store_fp8(norm, device, gen):
    from nanoserve.kernels.qkv_rope_store import qkv_rope_store, qkv_rope_store_ref

    tokens, hq, hkv, d, bs, blocks = 5, 4, 2, 64, 8, 3
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(device)
    freqs = torch.randn(64, d // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    weights = [torch.randn(d, generator=gen).to(device) for _ in range(2)] if norm else [None, None]
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(device)
    slots = torch.tensor([3, -1, 17, 0, 22], device=device)
    caches = [quantize_kv(torch.randn(blocks, bs, hkv, d, generator=gen), FP8).to(device) for _ in range(2)]
    want_qkv, want_k, want_v = qkv.clone(), caches[0].clone(), caches[1].clone()
    qkv_rope_store(qkv, hq, hkv, positions, cos, sin, *weights, 1e-6, *caches, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    qkv_rope_store_ref(
        want_qkv, hq, hkv, positions, cos, sin, *weights, 1e-6, want_k, want_v, slots, k_scale=K_SCALE, v_scale=V_SCALE
    )
    torch.testing.assert_close(qkv, want_qkv, atol=1e-5, rtol=1e-5)
    _assert_same_fp8(caches[0], want_k)
    _assert_same_fp8(caches[1], want_v)


def test_reference_reads_scaled_values(make_paged_kv, gen, device):
    """The references read an fp8 cache as its values times the scales: the same as an fp32 cache holding those."""
    from nanoserve.kernels.decode_attention import decode_attention_ref

    k8, v8, tables = _fp8_paged_kv(make_paged_kv, [7, 40], 2, 64, 16, gen, pad_value=0)
    q = torch.randn(2, 4, 64, generator=gen).to(device)
    seq = torch.tensor([7, 40], dtype=torch.int32, device=device)
    got = decode_attention_ref(q, k8, v8, seq, tables, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    want = decode_attention_ref(
        q, dequantize_kv(k8, torch.float32, K_SCALE), dequantize_kv(v8, torch.float32, V_SCALE), seq, tables, 0.125
    )
    torch.testing.assert_close(got, want)


# (query dtype, num_q_heads, num_kv_heads, seq_lens, num_splits, fused merge): one split, split with the reduce
# launch, split with the merge in the launch; a length-0 row.
DECODE_CASES = [
    (torch.float32, 4, 2, [1, 70, 0], 1, False),
    (torch.float16, 8, 2, [130, 9], 3, False),
    (torch.float32, 4, 1, [200, 65], 4, True),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=range(len(DECODE_CASES)))
def test_decode_attention_fp8(case, make_paged_kv, gen, device, tol):
    from nanoserve.kernels.decode_attention import decode_attention, decode_attention_ref

    dtype, hq, hkv, seq_lens, num_splits, fused = case
    k8, v8, tables = _fp8_paged_kv(make_paged_kv, seq_lens, hkv, 64, 16, gen, pad_value=0)
    q = torch.randn(len(seq_lens), hq, 64, generator=gen).to(device, dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    counters = torch.zeros(len(seq_lens) * hkv, dtype=torch.int32, device=device) if fused else None
    want = decode_attention_ref(q, k8, v8, seq, tables, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    got = decode_attention(
        q, k8, v8, seq, tables, 0.125, num_splits=num_splits, counters=counters, k_scale=K_SCALE, v_scale=V_SCALE
    )
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tol[dtype])


def test_decode_rope_attention_fp8(make_paged_kv, gen, device, tol):
    """The new token's K/V enter the sums as the cache stores them (quantized), as the unfused path reads them."""
    from nanoserve.kernels.decode_attention import decode_attention_ref
    from nanoserve.kernels.decode_rope_attention import decode_rope_attention, decode_rope_attention_ref
    from nanoserve.kernels.qkv_rope_store import qkv_rope_store_ref

    hq, hkv, d, bs, seq_lens = 4, 2, 64, 16, [1, 77]
    k8, v8, tables = _fp8_paged_kv(make_paged_kv, seq_lens, hkv, d, bs, gen, pad_value=0)
    qkv = torch.randn(len(seq_lens), (hq + 2 * hkv) * d, generator=gen).to(device)
    freqs = torch.randn(max(seq_lens), d // 2, generator=gen)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    positions = torch.tensor([n - 1 for n in seq_lens], device=device)
    slots = torch.tensor(
        [int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(seq_lens)], device=device
    )
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (qkv, hq, hkv, positions, cos, sin, None, None, 1e-6)
    k_ref, v_ref = k8.clone(), v8.clone()
    decode_rope_attention_ref(*args, k_ref, v_ref, slots, seq, tables, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    got = decode_rope_attention(
        *args,
        k8,
        v8,
        slots,
        seq,
        tables,
        0.125,
        num_splits=2,
        counters=torch.zeros(len(seq_lens) * hkv, dtype=torch.int32, device=device),
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    _assert_same_fp8(k8, k_ref)
    _assert_same_fp8(v8, v_ref)
    # Attention over what the kernel stored (see _assert_same_fp8 for why it may differ in a few values).
    q = qkv.clone()
    qkv_rope_store_ref(q, hq, hkv, positions, cos, sin, None, None, 1e-6, k_ref.clone(), v_ref.clone(), slots)
    q = q[:, : hq * d].view(-1, hq, d)
    want = decode_attention_ref(q, k8, v8, seq, tables, 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.testing.assert_close(got, want, **tol[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_fp8(dtype, make_paged_kv, gen, device, tol):
    """A prefix hit (3 new tokens over 40 cached), a whole prompt and a decode row in one call."""
    from nanoserve.kernels.prefill import prefill_attention, prefill_attention_ref

    q_lens, seq_lens, hq, hkv = [3, 20, 1], [43, 20, 9], 4, 2
    k8, v8, tables = _fp8_paged_kv(make_paged_kv, seq_lens, hkv, 64, 16, gen)
    q = torch.randn(sum(q_lens), hq, 64, generator=gen).to(device, dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(device, torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    want = prefill_attention_ref(q, k8, v8, cu, seq, tables, max(q_lens), 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    got = prefill_attention(q, k8, v8, cu, seq, tables, max(q_lens), 0.125, k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **tol[dtype])


def test_chunk_attention_fp8(make_paged_kv, gen, device):
    """Long-context pieces over fp8 blocks: a first piece, then one merged into it."""
    from nanoserve.kernels.chunk_attention import chunk_attention, chunk_attention_ref

    hq, hkv, d, bs = 4, 2, 64, 16
    k8, v8, tables = _fp8_paged_kv(make_paged_kv, [64], hkv, d, bs, gen)
    q = torch.randn(5, hq, d, generator=gen).to(device)
    results = []
    for attend in (chunk_attention, chunk_attention_ref):
        out = torch.empty(5, hq, d, device=device)
        lse = torch.empty(5, hq, device=device)
        attend(
            q, k8, v8, tables[0, :2], 32, 60, 60, 0.125, out, lse, accumulate=False, k_scale=K_SCALE, v_scale=V_SCALE
        )
        attend(q, k8, v8, tables[0, 2:4], 32, 0, 60, 0.125, out, lse, accumulate=True, k_scale=K_SCALE, v_scale=V_SCALE)
        results.append((out, lse))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
