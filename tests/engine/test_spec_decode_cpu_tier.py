"""Speculative decoding beside the CPU KV tier (kv_offload_gb): sequences preempted to the CPU tier and brought back,
prefixes evicted there and hit, and a long-context sequence (whose older blocks live in CPU memory, and which takes
no drafts) beside drafted ones give plain decoding's greedy tokens, with drafts accepted."""

import pytest
import torch
from draft_recorder import record_drafts

from nanoserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def repeating(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(2, 384, (n,), generator=g).tolist()
    return body + body[-12:] + body[-12:-5]


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from checkpoints import write_checkpoint

    # initializer_range 0.06: greedy outputs fall into loops, which the n-gram drafts catch (test_spec_decode.py). Four
    # layers, for an EAGLE-3 head's three.
    return str(write_checkpoint(tmp_path_factory.mktemp("spec_cpu") / "llama", "llama", num_hidden_layers=4,
                                initializer_range=0.06))


@pytest.mark.parametrize("spec", ["ngram", "draft_model", "eagle3"])
def test_preemption_through_the_cpu_tier(path, spec, tmp_path):
    """A random EAGLE-3 head's drafts are rejected: it checks exactness here (its drafts through the CPU tier are
    checked below)."""
    from checkpoints import write_eagle3_head

    prompts = [repeating(n, i) for i, n in enumerate((25, 26, 27, 28))]
    want = tokens(LLM(path, num_kv_blocks=64), prompts)
    config = {"ngram": NGRAM, "draft_model": {"model": path, "num_speculative_tokens": 3},
              "eagle3": {"method": "eagle3", "model": str(write_eagle3_head(tmp_path / "head", seed=1)),
                         "num_speculative_tokens": 3}}[spec]
    llm = LLM(path, num_kv_blocks=7, kv_offload_gb=0.01, speculative_config=config)
    assert tokens(llm, prompts) == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.cpu.loaded > 0
    assert llm.engine.spec_stats.num_drafts > 0
    assert llm.engine.spec_stats.num_accepted_tokens > 0 or spec == "eagle3"
    if spec != "ngram":  # a draft's or head's KV stays in its own device pool: no CPU tier of its own
        assert llm.engine.proposer.runner.num_cpu_blocks == 0


def test_long_context_beside_drafted_sequences(path):
    prompts = [repeating(20, 7), repeating(260, 8), repeating(30, 9)]
    want = tokens(LLM(path, num_kv_blocks=64), prompts)
    llm = LLM(path, num_kv_blocks=12, kv_offload_gb=0.01, speculative_config=NGRAM)
    assert tokens(llm, prompts) == want
    assert llm.engine.block_manager.cpu.allocated > 0 and llm.engine.spec_stats.num_accepted_tokens > 0


def test_eagle3_hidden_states_come_back_with_a_prefix_from_the_cpu_tier(path, tmp_path):
    """An EAGLE-3 head reads the target's hidden states stored by KV slot beside the KV: a prefix evicted to the CPU
    tier and loaded back into other device blocks must bring them along, or the head drafts from another sequence's.
    Its drafts depend on the tokens alone (worker/eagle3.py), so they equal those after a prefix hit on the GPU."""
    from checkpoints import write_eagle3_head

    spec = {"method": "eagle3", "model": str(write_eagle3_head(tmp_path / "head", seed=1)), "num_speculative_tokens": 3}
    g = torch.Generator().manual_seed(5)
    first, long = (torch.randint(2, 384, (n,), generator=g).tolist() for n in (70, 90))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def drafts_after_a_prefix_hit(llm: LLM) -> list:
        for prompt in (first, long):  # at 8 blocks of 16, the 90-token prompt evicts most of the first one's
            llm.generate([prompt], params, use_tqdm=False)
        drafts = record_drafts(llm)
        llm.generate([first + [7]], params, use_tqdm=False)
        return drafts

    want = drafts_after_a_prefix_hit(LLM(path, num_kv_blocks=64, block_size=16, speculative_config=spec))
    llm = LLM(path, num_kv_blocks=8, block_size=16, kv_offload_gb=0.01, speculative_config=spec)
    assert drafts_after_a_prefix_hit(llm) == want
    assert llm.engine.block_manager.cpu_prefix_hits > 0
