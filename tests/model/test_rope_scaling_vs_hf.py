"""Checkpoints with yarn, longrope and dynamic NTK rope_scaling, random weights, fp32: nanoserve's greedy tokens and
first-step logits equal transformers'.

transformers' longrope and dynamic NTK depend on the length of the sequence run; nanoserve decides them once from
max_model_len (layers/rotary.py says why). The prompts are chosen where the two agree: for longrope, all longer than
original_max_position_embeddings with max_model_len past it (long_factor throughout in both), or all fitting in it
with max_model_len equal to it (short_factor throughout); for dynamic NTK, within max_position_embeddings (the base
is unchanged there in both). yarn does not depend on the length, and its prompts run past its original length."""

import pytest
import torch
from checkpoints import rope_factors, write_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams

NEW_TOKENS = 8
OLD_LEN = 64  # original_max_position_embeddings; the checkpoints' max_position_embeddings is 512


def _factors(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1 + 7 * torch.rand(8, generator=g)).tolist()  # head_dim 16: 8 frequencies


LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": OLD_LEN, "short_factor": _factors(0),
            "long_factor": _factors(1)}
# (id, arch, rope_scaling, max_model_len, prompt lengths)
CASES = [
    ("qwen2 yarn", "qwen2", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": OLD_LEN}, None,
     (5, 37, 70, 130)),
    ("llama yarn gpt-oss fields", "llama", {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": OLD_LEN}, None,
     (5, 70, 130)),
    ("llama longrope long", "llama", LONGROPE, None, (70, 130)),
    ("llama longrope short", "llama", LONGROPE, OLD_LEN, (5, 37, OLD_LEN - NEW_TOKENS)),
    ("llama dynamic", "llama", {"rope_type": "dynamic", "factor": 4.0}, None, (5, 70, 130)),
    # Phi-3's layout: partial rotary (24 factors for 48 of 64 dims) and the original length at the top level.
    ("phi3 longrope long", "phi3", {"rope_type": "longrope", "short_factor": rope_factors(24, 2),
                                    "long_factor": rope_factors(24, 3)}, None, (70, 130)),
]
# Fields beside rope_scaling, per case id.
OVERRIDES = {"phi3 longrope long": {"original_max_position_embeddings": OLD_LEN}}


@pytest.mark.parametrize("case_id, arch, scaling, max_model_len, lens", CASES, ids=[c[0] for c in CASES])
def test_greedy_and_logits_match_transformers(case_id, arch, scaling, max_model_len, lens, tmp_path, monkeypatch):
    path = write_checkpoint(tmp_path / "ckpt", arch, rope_scaling=scaling, **OVERRIDES.get(case_id, {}))
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=512, max_model_len=max_model_len)
    seen: list[torch.Tensor] = []
    compute_logits = llm.engine.runner.model.compute_logits
    monkeypatch.setattr(llm.engine.runner.model, "compute_logits",
                        lambda h: seen.append(compute_logits(h)) or seen[-1])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 384, (n,), generator=g).tolist() for n in lens]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert hf.config.rope_parameters["rope_type"] == scaling["rope_type"]
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref_logits = hf(ids).logits[0, -1]
        err = (seen[0][i] - ref_logits).norm() / ref_logits.norm()
        assert err < 1e-4, f"prompt {i}: logits differ by {err:.2e}"
        ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), f"prompt {i}"
