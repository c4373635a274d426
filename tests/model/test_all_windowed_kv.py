"""A model whose every layer is windowed (Mistral-7B-v0.1's layout) keeps all its KV in the window pool
(engine/local_blocks.py, worker/kv_cache.py): token for token equal to transformers through prompts several windows
long, chunks that straddle the window, a prefix hit, n > 1 and preemption by the window pool, while each sequence
holds a window's blocks only; and the pools' sizes (the global pool block ids only, the window pool the memory)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from window_blocks import watch_window_blocks

from nanoserve import LLM, EngineArgs, SamplingParams

W, BS, CHUNK = 32, 16, 40  # chunks start at 0, 40, 80, ...: inside and past each window
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The checkpoint, two prompts of about four windows sharing their first 96 tokens, and transformers' tokens."""
    from checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=W)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 384, (96,), generator=g).tolist()
    prompts = [shared + torch.randint(2, 384, (n,), generator=g).tolist() for n in (29, 11)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    return path, prompts, expected


def test_all_windowed_model_frees_out_of_window_blocks(mistral, monkeypatch):
    path, prompts, expected = mistral
    llm = LLM(str(path), block_size=BS, max_num_batched_tokens=CHUNK, max_num_seqs=4, max_model_len=256)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    assert runner.kv_groups is not None and runner.kv_groups.all_local and bm.local is not None
    assert all(layer.local for layer in runner.attn_layers)
    # No layer's cache is the global pool's: only the window pool's blocks exist on the device.
    assert all(k.shape[0] == v.shape[0] == runner.num_local_blocks for k, v in runner.kv_cache)
    assert runner.num_kv_blocks == 4 * (256 // BS) + 2 * -(-CHUNK // BS)

    most = watch_window_blocks(monkeypatch, bm, W, BS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[0]
    params.n = 2
    second = llm.generate(prompts[1:], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 96  # the shared blocks: the window's still in the window pool
    assert [o.token_ids for o in second.outputs] == [expected[1]] * 2
    # The longest sequence spans 8 blocks; its window, a 40-token chunk and the blocks they cut take at most 5.
    assert most["global"] == 8 and most["local"] <= 5
    assert bm.local.num_free_blocks == bm.local.num_blocks - 1
    for k, v in runner.kv_cache:  # nothing ever wrote the null block, which kernels may load under the mask
        assert not k[0].any() and not v[0].any()


def test_window_pool_preempts(mistral, monkeypatch):
    """Six window blocks for two sequences that each need three or four: the window pool, not the global one, runs
    out, and the preempted sequence comes back to the same tokens."""
    from nanoserve.worker import kv_cache

    path, prompts, expected = mistral
    monkeypatch.setattr(kv_cache, "local_pool_cap", lambda *args, **kwargs: 6)
    llm = LLM(str(path), block_size=BS, max_num_batched_tokens=CHUNK, num_kv_blocks=64, enable_prefix_caching=False)
    assert llm.engine.block_manager.local.num_blocks == 7
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 64


def test_all_windowed_pool_sizes(mistral):
    """Sized from memory, the global pool gets max_num_seqs sequences of max_model_len (and two steps' chunks) in
    block ids, the window pool all the memory; a draft model's KV, kept for every global block, splits the memory
    as global layers would; too little memory for one window is refused; --disable-hybrid-kv-cache-manager and
    --kv-offload-gb keep one pool."""
    from nanoserve.worker.kv_cache import KVGroups, bytes_per_block, kv_groups, local_pool_cap, pool_sizes

    path = mistral[0]

    def config(**args):
        return EngineArgs(model=str(path), block_size=BS, max_num_seqs=8, max_model_len=512,
                          max_num_batched_tokens=CHUNK, **args).create_config()

    plain = config()
    groups = kv_groups(plain, [W, W])
    assert groups == KVGroups([True, True], W) and groups.all_local
    l_bytes = bytes_per_block(plain)
    budget = 100 * l_bytes + 5
    num_global, num_local = pool_sizes(plain, budget, groups)
    assert (num_global, num_local) == (8 * 32 + 2 * 3, 100)
    # A budget past what the global pool's ids could name: the window pool stops at their count.
    assert pool_sizes(plain, 10**9 * l_bytes, groups) == (num_global, num_global)
    line = plain.summary(num_global, (num_local - 1, W, True))
    assert "every layer sliding-window (window 32): 99 blocks = 1584 tokens" in line and "262 blocks" in line
    with pytest.raises(ValueError, match="sliding-window KV pool fits"):
        pool_sizes(plain, local_pool_cap(plain, W, num_seqs=1) * l_bytes, groups)

    drafted = config()
    drafted.draft_kv_bytes_per_block = l_bytes // 4
    num_global, num_local = pool_sizes(drafted, budget, groups)
    assert num_local == local_pool_cap(drafted, W) + 1
    assert budget - l_bytes // 4 < num_global * l_bytes // 4 + num_local * l_bytes <= budget

    assert kv_groups(config(disable_hybrid_kv_cache_manager=True), [W, W]) is None
    assert kv_groups(config(kv_offload_gb=1), [W, W]) is None
    assert kv_groups(plain, [None, None]) is None and kv_groups(plain, [600, 600]) is None  # no window under 512
