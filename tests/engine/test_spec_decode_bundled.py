"""The shipped draft model (nanoserve/assets/draft) and EAGLE-3 head (nanoserve/assets/eagle3, scripts/TRAINING.md)
speculate for the bundled model: greedy chat output through the calculator tool loop is plain decoding's (no accepted
draft lands between a call's <|python_end|> and the result the loop forces after it), and their drafts are accepted,
which a draft or head of random weights cannot achieve (its mean acceptance length stays near 1). The head loads
through speculative_config's eagle3 method, reading the target layers its config names."""

from pathlib import Path

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import bundled_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")
ASSETS = Path(bundled_model_dir())
GREEDY = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
# Held-out prompts of scripts/train_tiny_model.py's evaluation (seed 1338): arithmetic and letter counting.
PROMPTS = [
    "I need 980 x 8168",
    "calculate 113 added to 25.",
    'How often does "o" occur in "harbor"?',
    "5872 * 31 * 19=?",
    "Evaluate 779×2.",
]
# Both measured 3.85 (94 of 99 drafts accepted) with k = 3 on these prompts (CPU, fp32); the floor leaves room for
# another device's rounding.
MIN_MEAN_ACCEPTANCE_LENGTH = 3.0
SPECS = {"draft": {"model": str(ASSETS / "draft"), "num_speculative_tokens": 3},
         "eagle3": {"method": "eagle3", "model": str(ASSETS / "eagle3"), "num_speculative_tokens": 3}}


def chat(llm: LLM) -> list[list[int]]:
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return chat(LLM())


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
def test_shipped_draft_is_accepted_and_changes_no_greedy_token(name, async_scheduling, plain):
    """async_scheduling: the next step's drafts are made on the device before the host reads the verify step."""
    llm = LLM(speculative_config=SPECS[name], async_scheduling=async_scheduling)
    if name == "eagle3":  # the layers it was trained on, not the engine's default for 4 layers
        assert llm.engine.proposer.aux_layers == (1, 2, 3)
    assert chat(llm) == plain
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    assert stats.mean_acceptance_length > MIN_MEAN_ACCEPTANCE_LENGTH, stats
    assert (llm.engine.proposer.num_early_taken > 0) == async_scheduling
