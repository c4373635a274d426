"""Sliding-window attention end to end: a window W lets the query at position p see keys p - W + 1 .. p only.
Mistral (every layer) and Qwen2 (layers >= max_window_layers), random weights, fp32, greedy tokens equal
transformers' on prompts longer than the window, through chunked prefill (chunks straddle the window) and prefix
hits. Before sliding-window attention, max_model_len was capped at the window and these prompts were refused."""

import pytest
import torch
from checkpoints import write_checkpoint
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams

WINDOW = 24
PROMPT_LENS = (10, 23, 24, 25, 47, 90)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    return {
        "mistral": write_checkpoint(root / "mistral", "mistral", sliding_window=WINDOW),
        # Layer 0 global, layer 1 windowed.
        "qwen2": write_checkpoint(root / "qwen2", "qwen2", sliding_window=WINDOW, use_sliding_window=True,
                                  max_window_layers=1),
    }


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_tokens(path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ref[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_windowed_models_match_transformers(arch, windowed):
    path = windowed[arch]
    # 32-token steps: long prompts prefill in chunks whose starts fall inside and past the window.
    llm = LLM(str(path), num_kv_blocks=64, block_size=8, max_num_batched_tokens=32, enable_prefix_caching=True)
    attns = [layer.self_attn.attn for layer in llm.engine.runner.model.model.layers]
    if arch == "mistral":
        assert [a.sliding_window for a in attns] == [WINDOW, WINDOW]
    else:
        assert [a.sliding_window for a in attns] == [None, WINDOW]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = _prompts(0)
    # The second batch shares the first prompts' beginnings: prefix hits over blocks partly out of the window.
    again = [p[: len(p) * 3 // 4] + q[: len(p) // 4 + 1] for p, q in zip(prompts, _prompts(1), strict=True)]
    expected = _hf_tokens(path, prompts + again)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got += [o.outputs[0].token_ids for o in llm.generate(again, params, use_tqdm=False)]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"{arch} prompt {i} ({len((prompts + again)[i])} tokens)"


@pytest.mark.parametrize("window", [24, 150])
def test_long_context_mode_with_a_window(tmp_path, window, monkeypatch):
    """A prompt four times the GPU pool (long-context mode, kv_ring.py): a window inside the device's blocks skips
    every older chunk; a wider one reaches into them, which come back in position order (slots of two blocks)."""
    from nanoserve.worker import kv_ring

    monkeypatch.setattr(kv_ring, "RING_SLOT_TOKENS", 32)
    path = str(write_checkpoint(tmp_path / "m", "mistral", sliding_window=window))
    prompt = torch.randint(2, 384, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(path, num_kv_blocks=64, block_size=16).generate([prompt], params, use_tqdm=False)
    llm = LLM(path, kv_offload_gb=0.01, num_kv_blocks=6, block_size=16)
    got = llm.generate([prompt], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert llm.engine.block_manager.cpu.allocated > 0
