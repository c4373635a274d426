"""Speculative decoding under async scheduling: a draft model or EAGLE-3 head drafts for the next step on the device
from a verify step the host has not read (LLMEngine._propose_early), and greedy tokens stay plain decoding's, through
prefix hits, chunked prefill, preemption, n > 1, stops and max_tokens mid-draft. With the target as its own draft every
early draft must still be accepted: a draft drawn from the wrong position or token would be rejected."""

import pytest
from checkpoints import write_checkpoint, write_eagle3_head
from prompts import three_prompts as prompts

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
K = 3
HARD = dict(num_kv_blocks=9, max_num_batched_tokens=24)  # about two sequences' blocks; prompts chunked; preemption


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_spec")
    target = write_checkpoint(root / "target", "llama", num_hidden_layers=4, initializer_range=0.06)
    draft = write_checkpoint(root / "draft", "qwen2", seed=1, num_hidden_layers=1, hidden_size=32,
                             intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return target, draft, write_eagle3_head(root / "head", seed=1)


@pytest.fixture(scope="module")
def plain(dirs) -> LLM:
    return LLM(str(dirs[0]), enable_prefix_caching=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return run(plain, prompts())


def spec(dirs, which: str, **kwargs) -> LLM:
    model = {"self": dirs[0], "draft": dirs[1], "eagle3": dirs[2]}[which]
    config = {"model": str(model), "num_speculative_tokens": K} | ({"method": "eagle3"} if which == "eagle3" else {})
    return LLM(str(dirs[0]), async_scheduling=True, speculative_config=config, **kwargs)


def check_drained(llm: LLM, num_blocks: int) -> None:
    engine = llm.engine
    assert engine.early_drafts and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == num_blocks
    assert engine.proposer.tables == {} and engine.proposer.early == {} and len(engine.proposer.free) == num_blocks


def test_target_as_its_own_draft_accepts_every_early_draft(dirs, reference):
    llm = spec(dirs, "self", **HARD)
    assert run(llm, prompts()) == reference
    stats, engine = llm.engine.spec_stats, llm.engine
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert engine.proposer.num_early_taken > stats.num_drafts // 2  # most proposals were early
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    check_drained(llm, HARD["num_kv_blocks"])


@pytest.mark.parametrize("which", ["draft", "eagle3"])
def test_greedy_through_prefix_hits_chunks_preemption_and_n(dirs, reference, which):
    llm = spec(dirs, which, **HARD)
    assert run(llm, prompts()) == reference
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    assert engine.spec_stats.num_draft_tokens > 0 and engine.proposer.num_early_taken > 0
    out = llm.generate(prompts()[2], SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3
    check_drained(llm, HARD["num_kv_blocks"])


def test_eagle3_early_drafts_are_the_synchronous_ones(dirs):
    """A head's drafts depend on the sequence's tokens alone: drafted early, from the verify step's tokens on the
    device, they are accepted exactly as often as drafted after the host read them."""
    sync = LLM(str(dirs[0]), num_kv_blocks=64, speculative_config={"method": "eagle3", "model": str(dirs[2]),
                                                                   "num_speculative_tokens": K})
    early = spec(dirs, "eagle3", num_kv_blocks=64)
    assert run(early, prompts()) == run(sync, prompts())
    a, b = early.engine.spec_stats, sync.engine.spec_stats
    assert (a.num_drafts, a.num_draft_tokens, a.accepted_per_pos) == (b.num_drafts, b.num_draft_tokens,
                                                                      b.accepted_per_pos)


def test_stops_and_max_tokens_mid_draft(dirs, plain):
    """Every early draft accepted (the target drafts for itself), so stops land inside verified runs: no token past
    a stop id, a stop string or max_tokens is emitted, and the sequence's next step never runs."""
    llm = spec(dirs, "self", num_kv_blocks=64)
    for params in (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 5, 7)):
        assert run(llm, prompts(), params) == run(plain, prompts(), params)
    ref = plain.generate(prompts(), GREEDY, use_tqdm=False)
    stop_ids = [r.outputs[0].token_ids[6] for r in ref]
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop_ids)
    assert run(llm, prompts(), params) == run(plain, prompts(), params)
    texts = [r.outputs[0].text for r in ref]
    stop = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[t[len(t) // 2:][:2] for t in texts if t])
    got = llm.generate(prompts(), stop, use_tqdm=False)
    want = plain.generate(prompts(), stop, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].text) for o in want]
    check_drained(llm, 64)


def test_sampling_with_the_target_as_draft_accepts_nearly_everything(dirs):
    """q = p drafted early (the same model and parameters): min(1, p/q) accepts all but rounding's few, and a seeded
    request is reproducible alone and in a batch; a penalized request beside them is proposed for on the host."""
    llm = spec(dirs, "self", num_kv_blocks=64)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01, logit_bias={9: 1.5}, seed=3,
                            max_tokens=20, ignore_eos=True)
    first = run(llm, prompts(), params)
    assert all(len(t) == 20 for t in first)
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    assert llm.engine.proposer.num_early_taken > 0
    assert run(llm, prompts()[:1], params) == first[:1]
    check_drained(llm, 64)


def test_constrained_and_penalized_samples_beside_early_drafted_ones(dirs, plain):
    """In the same steps as early-drafted samples: a grammar's sample (never drafted for; the verify step's sampling
    waits for its masks) and a penalized one (proposed for on the host, its q reading its tokens)."""
    from nanoserve.structured.params import StructuredOutputs

    choice = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputs(choice=["alpha", "beta"]))
    penalized = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2)
    batch, params = [*prompts(), "Hello"], [GREEDY, GREEDY, penalized, choice]
    llm = spec(dirs, "self", num_kv_blocks=64)
    llm.generate(["Hi"], choice, use_tqdm=False)  # the grammar compiled (and cached) before the batch comes
    beside = []  # steps that verified drafts beside the constrained sample

    def record(outputs):
        entries = llm.engine.last_batch.scheduled
        if any(e.seq.params.structured_outputs is not None for e in entries):
            beside.append(any(e.draft_token_ids for e in entries))
        return outputs

    llm.engine.add_step_hook(record)
    got = llm.generate(batch, params, use_tqdm=False)
    assert any(beside), "the constrained sample never ran in a step with drafts"
    want = plain.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[3].outputs[0].text in ("alpha", "beta")
    assert llm.engine.proposer.num_early_taken > 0
    check_drained(llm, 64)
    # The hook closes a cycle through the engine, which would keep its mask thread (and the process's lowered switch
    # interval, structured/manager.py) alive until a garbage collection: later tests read that interval.
    llm.engine.step_hooks.remove(record)
    llm.shutdown()


@pytest.mark.parametrize("case", ["ngram", "cpu_tier"])
def test_synchronous_where_early_drafts_are_not_built(dirs, reference, case, caplog):
    """n-gram (a host lookup) and the CPU KV tier keep speculative steps synchronous under async scheduling, with a
    warning, and decode as without it."""
    if case == "ngram":
        config, extra = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}, {}
    else:
        config, extra = {"model": str(dirs[0]), "num_speculative_tokens": K}, dict(kv_offload_gb=0.01)
    llm = LLM(str(dirs[0]), num_kv_blocks=64, async_scheduling=True, speculative_config=config, **extra)
    assert not llm.engine.early_drafts and not llm.engine.async_scheduling
    assert "speculative steps are synchronous" in caplog.text
    assert run(llm, prompts()) == reference
