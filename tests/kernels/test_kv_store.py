import pytest
import torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_matches_ref(dtype, device, gen):
    from nanoserve.kernels.kv_store import store_kvcache, store_kvcache_ref

    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 13, 6, 3, 64, 8, 5
    # key/value are strided views into a fused qkv projection output, as the engine passes them.
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    qkv = qkv.to(device)
    _, key, value = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 12]] = -1
    slot_mapping = slots.to(device)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)

    # The reference itself, checked token by token: stored tokens land in their slot, nothing else moves.
    k_expect = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_expect = torch.randn(shape, generator=gen).to(dtype).to(device)
    k_got, v_got = k_expect.clone(), v_expect.clone()
    store_kvcache_ref(key, value, k_got, v_got, slot_mapping)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expect[slot // block_size, slot % block_size] = key[t]
            v_expect[slot // block_size, slot % block_size] = value[t]
    torch.testing.assert_close(k_got, k_expect, rtol=0, atol=0)
    torch.testing.assert_close(v_got, v_expect, rtol=0, atol=0)


def test_store_kvcache_all_skipped_and_empty(device, gen):
    from nanoserve.kernels.kv_store import store_kvcache

    k_cache = torch.randn(2, 16, 1, 128, generator=gen).to(device)
    v_cache = torch.randn(2, 16, 1, 128, generator=gen).to(device)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(3, 1, 128, generator=gen).to(device)
    store_kvcache(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64, device=device))
    store_kvcache(key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
