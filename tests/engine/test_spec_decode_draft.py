"""Speculative decoding with a draft model changes no greedy token: the target as its own draft (every draft
accepted, which proves the machinery) and a smaller random draft, through prefix hits, chunked prefill, preemption
and n > 1; the draft's refusals."""

import pytest
import torch
from checkpoints import write_checkpoint
from prompts import three_prompts as prompts

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
K = 3


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = write_checkpoint(root / "target", "llama", num_hidden_layers=3, initializer_range=0.06)
    # Another architecture, fewer layers, a narrower hidden size: only the vocabulary is shared.
    draft = write_checkpoint(
        root / "draft",
        "qwen2",
        seed=1,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return target, draft


@pytest.fixture(scope="module")
def plain(dirs) -> LLM:
    return LLM(str(dirs[0]), enable_prefix_caching=False, num_kv_blocks=64)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return run(plain, prompts())


def spec_config(model) -> dict:
    return {"model": str(model), "num_speculative_tokens": K}


@pytest.mark.parametrize("hard", [False, True])
def test_target_as_its_own_draft_accepts_everything(dirs, reference, hard):
    """hard: 9 blocks of 16 hold about two of these sequences, and 24 tokens a step chunk the prompts (the draft
    catches up on them in chunks too) and cap the drafts; sequences are preempted, prefixes hit."""
    pool = dict(num_kv_blocks=9, max_num_batched_tokens=24) if hard else dict(num_kv_blocks=64)
    spec = LLM(str(dirs[0]), **pool, speculative_config={**spec_config(dirs[0]), "method": "draft_model"})
    assert run(spec, prompts()) == reference
    stats = spec.engine.spec_stats
    assert stats.num_draft_tokens > 0
    # Every draft is the target's own argmax: each verify step emits k + 1 tokens, save where max_tokens (or the
    # step's token budget) caps k.
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_acceptance_length > (K if hard else K + 0.5)
    if hard:
        assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.block_manager.prefix_hits > 0


def test_small_draft_through_prefix_hits_chunks_and_preemption(dirs, plain, reference):
    # 9 blocks of 16 hold about two of these sequences; 24 tokens a step chunk the prompts and cap the drafts.
    spec = LLM(str(dirs[0]), num_kv_blocks=9, max_num_batched_tokens=24, speculative_config=spec_config(dirs[1]))
    assert run(spec, prompts()) == reference
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == 9
    assert engine.proposer.tables == {}  # the draft's blocks, given back when each sequence finished
    assert len(engine.proposer.free) == 9
    out = spec.generate(
        prompts()[2], SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3
    # Penalties and logit_bias at drafted positions count the drafts before them, in the draft's q as the target's.
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        logit_bias={7: 2.0},
    )
    assert run(spec, prompts(), params) == run(plain, prompts(), params)


def test_sampling_with_the_target_as_draft_accepts_nearly_everything(dirs):
    """q = p (the same model, the same parameters): min(1, p/q) accepts all but rounding's few."""
    spec = LLM(str(dirs[0]), num_kv_blocks=64, speculative_config=spec_config(dirs[0]))
    params = SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.95,
        min_p=0.01,
        presence_penalty=0.3,
        logit_bias={9: 1.5},
        seed=3,
        max_tokens=20,
        ignore_eos=True,
    )
    first = run(spec, prompts(), params)
    assert all(len(t) == 20 for t in first)
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens
    # Seeded: the draft's draws and verification's come from the request's own generator, in a fixed order.
    assert run(spec, prompts()[:1], params) == first[:1]


def test_cached_tokens_are_the_common_prefix_with_the_sequence():
    """What the draft's pool holds is kept as (tokens seen, drafts after them): it serves as many of the sequence's
    tokens as the two lists share, all but the sequence's last at most, as a whole-list compare would say."""
    from nanoserve.worker.draft_model import DraftModelProposer

    proposer = DraftModelProposer.__new__(DraftModelProposer)
    g = torch.Generator().manual_seed(0)
    for case in range(200):
        seen = int(torch.randint(0, 6, (), generator=g))
        prompt = torch.randint(0, 4, (seen,), generator=g).tolist()
        drafts = torch.randint(0, 4, (int(torch.randint(0, 4, (), generator=g)),), generator=g).tolist()
        tokens = prompt + torch.randint(0, 4, (int(torch.randint(0, 5, (), generator=g)),), generator=g).tolist()
        if not tokens:
            continue
        proposer.cached = {case: (seen, drafts)}
        held = prompt + drafts
        common = next((i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b),
                      min(len(held), len(tokens)))
        assert proposer._num_cached(case, tokens) == min(common, len(tokens) - 1)


@pytest.mark.parametrize(
    "extra, error",
    [
        ({"prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max: only for method 'ngram'"),
        ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size: only 1"),
    ],
)
def test_draft_config_refusals(extra, error):
    from nanoserve.spec_decode.config import SpeculativeConfig

    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.from_dict({"model": "d", "num_speculative_tokens": 2} | extra)


def test_vocab_mismatch_and_missing_draft_are_refused(dirs, tmp_path):
    other = write_checkpoint(tmp_path / "other", "llama", vocab_size=400, num_hidden_layers=1)
    with pytest.raises(ValueError, match="the draft's vocab_size 400 differs from the target's 384"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=spec_config(other))
    with pytest.raises(ValueError, match="speculative_config.model: the draft"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=spec_config(tmp_path / "missing"))
