"""Speculative decoding under tensor parallelism on the CPU (gloo): the n-gram lookup, a draft model and an EAGLE-3
head run on rank 0 (the draft or head whole, the head with the target's whole embedding), the verify steps on every
rank, which take no samples from rank 0 for them (NO_SAMPLES in worker/step_inputs.py). Greedy tokens equal TP=1's
without speculation, with drafts accepted; a head drafts what it drafts at TP=1."""

import pytest
import torch
from checkpoints import write_checkpoint, write_eagle3_head
from draft_recorder import record_drafts

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.worker.draft_model import draft_engine_config

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Each repeats a stretch of itself, which the n-gram lookup drafts from."""
    g = torch.Generator().manual_seed(9)
    bodies = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (5, 23)]
    return [body + body[-10:] + body[-10:-4] for body in bodies]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # initializer_range 0.06: greedy outputs fall into loops now and then (tests/engine/test_spec_decode.py). Four
    # layers: an EAGLE-3 head reads the hidden states entering layers 2, 2 and 1 (2, L // 2, L - 3).
    path = write_checkpoint(tmp_path_factory.mktemp("spec_tp") / "llama", "llama", num_hidden_layers=4,
                            initializer_range=0.06)
    plain = LLM(str(path), num_kv_blocks=64)
    return path, [o.outputs[0].token_ids for o in plain.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_two_ranks_give_plain_tokens(target, method):
    path, want = target
    # The target as its own draft: every draft is accepted, up to the cap at max_tokens.
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1} \
        if method == "ngram" else {"model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), tensor_parallel_size=2, num_kv_blocks=64, speculative_config=spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
        assert got == want
        assert llm.engine.spec_stats.num_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_eagle3_head_drafts_as_at_one_rank(target, tmp_path, load_format):
    """The head's passes read the target's embedding, which each rank holds a share of: under TP rank 0 gives the head
    the whole table (read from the checkpoint, or drawn as the random weights are), so its drafts are TP=1's."""
    path, want = target
    head = write_eagle3_head(tmp_path / "head", seed=1)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    runs = []
    for tp in (1, 2):
        llm = LLM(str(path), tensor_parallel_size=tp, num_kv_blocks=64, speculative_config=spec,
                  load_format=load_format)
        try:
            drafts = record_drafts(llm)
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
            runs.append((tokens, drafts))
        finally:
            llm.shutdown()
    assert runs[0] == runs[1] and any(any(d) for d in runs[0][1])
    if load_format == "auto":
        assert runs[0][0] == want


def test_a_dense_draft_beside_expert_parallel_experts(target, tmp_path):
    """The draft runs whole on rank 0: the target's enable_expert_parallel is not its own (a dense draft would be
    refused it), as its tensor_parallel_size is not."""
    moe = write_checkpoint(tmp_path / "moe", "qwen3_moe")
    config = EngineArgs(model=str(moe), tensor_parallel_size=2, enable_expert_parallel=True, load_format="dummy",
                        speculative_config={"model": str(target[0]), "num_speculative_tokens": 2}).create_config()
    draft = draft_engine_config(config)
    assert (draft.args.tensor_parallel_size, draft.args.enable_expert_parallel) == (1, False)
