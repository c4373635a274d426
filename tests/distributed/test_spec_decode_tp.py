"""Speculative decoding under tensor parallelism on the CPU (gloo): the n-gram lookup and a draft model run on rank 0
(the draft whole), the verify steps on every rank, which take no samples from rank 0 for them (NO_SAMPLES in
worker/step_inputs.py). Greedy tokens equal TP=1's without speculation, with drafts accepted."""

import pytest
import torch
from checkpoints import write_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineArgs

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Each repeats a stretch of itself, which the n-gram lookup drafts from."""
    g = torch.Generator().manual_seed(9)
    bodies = [torch.randint(2, 384, (n,), generator=g).tolist() for n in (5, 23)]
    return [body + body[-10:] + body[-10:-4] for body in bodies]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # initializer_range 0.06: greedy outputs fall into loops now and then (tests/engine/test_spec_decode.py).
    path = write_checkpoint(tmp_path_factory.mktemp("spec_tp") / "llama", "llama", initializer_range=0.06)
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


def test_eagle3_with_tensor_parallelism_is_refused(target):
    path, _ = target
    with pytest.raises(ValueError, match="method 'eagle3' is not supported with tensor_parallel_size > 1"):
        EngineArgs(model=str(path), tensor_parallel_size=2,
                   speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": 2}
                   ).create_config()
