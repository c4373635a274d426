"""Freeing the KV blocks out of the sliding window (engine/local_blocks.py, worker/kv_cache.py's two pools): Gemma 2
and 3 token for token equal to transformers with the freeing on, through prompts several windows long, chunks that
straddle the window, prefix hits, preemption and n > 1, while the window pool's blocks per sequence stay bounded; and
the tokens that fit, with and without the freeing."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from window_blocks import watch_window_blocks

from nanoserve import LLM, EngineArgs, SamplingParams

W, BS, CHUNK = 32, 16, 40  # chunks start at 0, 40, 80, ...: inside and past each window
NEW_TOKENS = 4


def _prompts() -> list[list[int]]:
    """A prompt of almost four windows, one sharing its first 96 tokens (a prefix hit), one inside the window."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 384, (96,), generator=g).tolist()
    return [shared + torch.randint(2, 384, (n,), generator=g).tolist() for n in (27, 9)] + [
        torch.randint(2, 384, (20,), generator=g).tolist()
    ]


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def window_model(request, tmp_path_factory) -> Path:
    from checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp(request.param), request.param, sliding_window=W)


def test_freeing_out_of_window_blocks_keeps_transformers_tokens(window_model, monkeypatch):
    prompts = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(window_model, dtype=torch.float32)
    expected = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())

    # 9 global blocks hold one long sequence (8 blocks) and not two samples of it: the n = 2 batch preempts. (Its
    # last token is sampled, never computed: 126 positions, 8 blocks.)
    llm = LLM(str(window_model), block_size=BS, max_num_batched_tokens=CHUNK, num_kv_blocks=9)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    assert runner.kv_groups is not None and runner.kv_groups.window == W and bm.local is not None
    local_layers = [a for a in runner.attn_layers if a.local]
    assert local_layers and all(a.k_cache.shape[0] == runner.num_local_blocks for a in local_layers)

    most = watch_window_blocks(monkeypatch, bm, W, BS)
    first = llm.generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False
    )[0]
    assert first.outputs[0].token_ids == expected[0]
    rest = llm.generate(
        prompts[1:] + prompts[:1],
        SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert rest[0].num_cached_tokens == 96  # the shared blocks, the window's among them still in the window pool
    assert llm.engine.scheduler.num_preemptions > 0
    for out, want in zip(rest, expected[1:] + expected[:1], strict=True):
        assert [o.token_ids for o in out.outputs] == [want, want]
    assert most["global"] == 8 and most["local"] <= 5
    assert bm.local.num_free_blocks == bm.local.num_blocks - 1  # every window block back (cached or not)
    for layer in local_layers:  # nothing ever wrote the null block, which kernels may load under the mask
        assert not layer.k_cache[0].any() and not layer.v_cache[0].any()


def test_disabled_keeps_one_pool(checkpoints):
    llm = LLM(str(checkpoints["gemma3"]), block_size=BS, num_kv_blocks=16, disable_hybrid_kv_cache_manager=True)
    assert llm.engine.runner.kv_groups is None and llm.engine.block_manager.local is None
    out = llm.generate([_prompts()[0][:70]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_ngram_speculation_with_the_window_pool(checkpoints):
    """Lookahead slots in both pools, and the rejected ones given back (BlockManager.trim): the tokens without
    speculation."""
    g = torch.Generator().manual_seed(4)
    motif = torch.randint(2, 384, (12,), generator=g).tolist()
    prompts = [motif * 6, torch.randint(2, 384, (50,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = dict(block_size=8, num_kv_blocks=40, max_num_batched_tokens=32)
    want = [
        o.outputs[0].token_ids
        for o in LLM(str(checkpoints["gemma3"]), **engine).generate(prompts, params, use_tqdm=False)
    ]
    spec = LLM(
        str(checkpoints["gemma3"]), speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **engine
    )
    assert spec.engine.block_manager.local is not None
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.engine.spec_stats.num_draft_tokens > 0
    assert spec.engine.block_manager.local.num_free_blocks == spec.engine.block_manager.local.num_blocks - 1


def test_more_tokens_fit_with_the_window_pool():
    """Gemma-3-27B's published config at 32k tokens with 8 sequences: the global pool, which bounds the longest
    context, holds several times the tokens of one pool for all 62 layers (52 of them windowed, W = 1024)."""
    from nanoserve.model.gemma import SLIDING, gemma_layer_types
    from nanoserve.worker.kv_cache import KVGroups, bytes_per_block, kv_groups, num_blocks_for, pool_sizes

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "gemma-3-27b"
    args = EngineArgs(model=str(path), load_format="dummy", dtype="bfloat16", max_model_len=32768, max_num_seqs=8)
    config = args.create_config()
    types = gemma_layer_types(config.model)
    windows = [config.model.sliding_window if t == SLIDING else None for t in types]
    groups = kv_groups(config, windows)
    assert groups == KVGroups([t == SLIDING for t in types], 1024) and groups.num_local == 52
    budget = 80 << 30
    one_pool = num_blocks_for(config, budget)
    num_global, num_local = pool_sizes(config, budget, groups)
    assert num_global >= 5 * one_pool
    used = num_global * bytes_per_block(config, 10) + num_local * bytes_per_block(config, 52)
    assert budget - bytes_per_block(config, 10) < used <= budget
    off = EngineArgs(model=str(path), load_format="dummy", max_model_len=32768, disable_hybrid_kv_cache_manager=True)
    assert kv_groups(off.create_config(), windows) is None
    # The CPU tier moves one pool's blocks: asked for, it keeps one pool.
    assert kv_groups(EngineArgs(model=str(path), load_format="dummy", kv_offload_gb=1).create_config(), windows) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the kernels; on a GPU they run anyway")
def test_triton_kernels_over_null_blocks(tmp_path, monkeypatch):
    """The Triton kernels (prefill, decode, the fused rope decode; run by the interpreter over the CPU caches) with the
    window pool, whose tables point freed blocks at the null block, against one pool on the PyTorch path: every
    prompt position's log-probability, through 16-token chunks that start past freed blocks."""
    from checkpoints import write_checkpoint

    from nanoserve.layers.attention import TritonBackend
    from nanoserve.layers.step_plan import KernelPlanner

    path = write_checkpoint(tmp_path / "gemma3", "gemma3", head_dim=64)  # the kernels take head_dim 64, 128 or 256
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (60, 45)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)

    def prompt_logprobs(triton: bool, **engine) -> list[list[float]]:
        llm = LLM(str(path), num_kv_blocks=32, block_size=8, max_num_seqs=2, max_num_batched_tokens=16, **engine)
        if triton:
            assert llm.engine.block_manager.local is not None
            for layer in llm.engine.runner.attn_layers:
                layer.backend = TritonBackend
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[next(iter(lp.values())).logprob for lp in o.prompt_logprobs[1:]] for o in outs]

    want = prompt_logprobs(False, disable_hybrid_kv_cache_manager=True)
    plan = KernelPlanner.plan
    monkeypatch.setattr(KernelPlanner, "plan", lambda self, *a, **kw: plan(self, *a, **{**kw, "triton": True}))
    got = prompt_logprobs(True)
    for g_row, w_row in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g_row), torch.tensor(w_row), rtol=1e-4, atol=1e-4)


def test_bench_reports_more_tokens_per_byte(capsys: pytest.CaptureFixture, checkpoints) -> None:
    """`nanoserve bench latency`'s JSON line says what each pool holds, and the window pool (its out-of-window blocks
    freed) makes each token of context cost fewer bytes than one pool for every layer."""
    import json

    from nanoserve.cli import main

    def run_bench(*flags: str) -> dict:
        assert (
            main(
                [
                    "bench",
                    "latency",
                    "--device",
                    "cpu",
                    "--dtype",
                    "float32",
                    "--input-len",
                    "5",
                    "--output-len",
                    "6",
                    "--iters",
                    "1",
                    "--model",
                    str(checkpoints["gemma3"]),
                    "--max-num-seqs",
                    "2",
                    "--max-model-len",
                    "512",
                    *flags,
                ]
            )
            == 0
        )
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    two = run_bench()
    one = run_bench("--disable-hybrid-kv-cache-manager")
    assert two["kv_window_pool_tokens"] > 0 and one["kv_window_pool_tokens"] is None
    assert two["kv_cache_tokens"] > one["kv_cache_tokens"]
    assert two["kv_bytes_per_token"] < one["kv_bytes_per_token"]


def test_one_pool_where_the_window_pool_would_save_nothing(checkpoints, monkeypatch):
    """Sized from memory, a window pool as large as the global one (max_num_seqs windows and chunks need that many
    blocks) is dropped: the engine runs with one pool, with no second table to build each step."""
    from nanoserve.worker import kv_cache

    config = EngineArgs(model=str(checkpoints["gemma3"]), block_size=BS, max_num_seqs=4).create_config()
    # A budget of as many blocks of every layer as 4 sequences' windows and two steps' chunks take.
    monkeypatch.setattr(
        kv_cache, "_CPU_POOL_BYTES", kv_cache.local_pool_cap(config, 24) * kv_cache.bytes_per_block(config)
    )
    llm = LLM(str(checkpoints["gemma3"]), block_size=BS, max_num_seqs=4)
    assert llm.engine.runner.kv_groups is None and llm.engine.block_manager.local is None
    assert not any(layer.local for layer in llm.engine.runner.attn_layers)
    out = llm.generate([_prompts()[0][:70]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    monkeypatch.undo()
    assert LLM(str(checkpoints["gemma3"]), block_size=BS, max_num_seqs=4).engine.runner.kv_groups is not None
