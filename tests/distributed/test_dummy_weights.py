"""Random weights (load_format="dummy") are the same model at every tensor-parallel size: each rank's share is a
slice of tensors drawn whole from generators seeded by name, so TP=2 gives TP=1's logits (the multi-GPU runs
compare TP sizes on random weights of real models' shapes)."""

import json

import pytest

from nanoserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8] * 5, [11, 12, 13], list(range(20, 80))]


@pytest.fixture(scope="module")
def config_only(checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy") / "qwen3"
    path.mkdir()
    (path / "config.json").write_text((checkpoints["qwen3"] / "config.json").read_text())
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    return str(path)


def _logprobs(llm: LLM) -> list[list[float]]:
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs]


def test_dummy_weights_are_the_same_model_at_tp2(config_only):
    one = _logprobs(LLM(config_only, load_format="dummy", seed=3))
    llm = LLM(config_only, load_format="dummy", seed=3, tensor_parallel_size=2)
    try:
        two = _logprobs(llm)
    finally:
        llm.shutdown()
    other_seed = _logprobs(LLM(config_only, load_format="dummy", seed=4))
    assert all(a == pytest.approx(b, abs=1e-4) for a, b in zip(one, two, strict=True))
    assert one != other_seed
