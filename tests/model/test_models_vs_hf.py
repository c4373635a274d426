"""Every architecture, random weights, fp32: nanoserve's greedy tokens and logits equal transformers'."""

import pytest
import torch
from checkpoints import ARCHS
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams

# Mixed lengths: shorter than a block, several blocks (block_size 16), not a multiple of it.
PROMPT_LENS = (1, 5, 16, 37, 70, 130)
NEW_TOKENS = 12


def random_prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_and_logits_match_transformers(arch, checkpoints, monkeypatch):
    path = checkpoints[arch]
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=512)
    seen: list[torch.Tensor] = []
    compute_logits = llm.engine.runner.model.compute_logits
    monkeypatch.setattr(llm.engine.runner.model, "compute_logits",
                        lambda h: seen.append(compute_logits(h)) or seen[-1])
    prompts = random_prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    first_step = seen[0]  # all prompts fit one step: one row per prompt, in order
    assert first_step.shape[0] == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref_logits = hf(ids).logits[0, -1]
        err = (first_step[i] - ref_logits).norm() / ref_logits.norm()
        assert err < 1e-4, f"{arch} prompt {i}: logits differ by {err:.2e}"
        ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), f"{arch} prompt {i}"
        assert out.outputs[0].finish_reason == "length"
