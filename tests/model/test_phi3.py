"""Phi-3 / Phi-4-mini (tests/checkpoints.py's "phi3": packed qkv_proj and gate_up_proj, partial rotary, LongRoPE, a
48-token window) against transformers through the engine's hard paths, the config.json forms Phi-3 checkpoints ship,
and the loading rules of packed tensors. test_models_vs_hf.py checks the first step's logits and greedy tokens."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from nanoserve import LLM, SamplingParams
from nanoserve.config import ModelConfig
from nanoserve.model.phi3 import Phi3ForCausalLM

NEW_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
WINDOW = 48


def prompts() -> list[list[int]]:
    """A shared 40-token prefix (two full blocks of 16) and suffixes: 41 to 101 tokens, across the window."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [system + torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 30, 61)]


@pytest.fixture(scope="module")
def phi3(checkpoints):
    path = checkpoints["phi3"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = []
    for p in prompts():
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        reference.append(out[0, len(p) :].tolist())
    return path, reference


def run(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def test_prefix_hits_and_preemption_match_transformers(phi3):
    path, reference = phi3
    llm = LLM(str(path), num_kv_blocks=12, max_num_batched_tokens=512)
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.rotary.cos_half.shape[1] == 24 and attn.attn.sliding_window == WINDOW  # 48 of 64 dims rotate
    assert run(llm) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert run(llm) == reference  # again, from the prefix cache
    assert llm.engine.block_manager.prefix_hits > 0


def test_chunked_prefill_n2_and_async_scheduling_match_transformers(phi3):
    """13-token chunks, whose starts fall inside and past the window, and two greedy samples forked per prompt."""
    path, reference = phi3
    llm = LLM(str(path), num_kv_blocks=128, max_num_batched_tokens=13, async_scheduling=True)
    params = SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in outs] == [[r, r] for r in reference]


def _config_dir(tmp_path, **fields) -> ModelConfig:
    """A Phi-3 config.json as early checkpoints ship it: partial_rotary_factor and the original length at the top."""
    raw = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 32,
        "hidden_size": 256,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.75,
    } | fields
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(str(tmp_path), generation_config="none")


@pytest.mark.parametrize("legacy_type", ["su", "yarn", "longrope"])
def test_legacy_longrope_names_match_transformers_tables(legacy_type, tmp_path):
    """rope_scaling type "su" (Phi-3-mini-128k's first release) and "yarn" are longrope for Phi-3, as transformers'
    Phi3Config reads them: the tables of a 48-dim rotation of 64-dim heads equal Phi3RotaryEmbedding's, short_factor
    up to the original length and long_factor past it. (transformers 5 no longer loads an "su" config whose
    rope_scaling lacks original_max_position_embeddings; it is compared with the same config named longrope.)"""
    g = torch.Generator().manual_seed(1)
    scaling = {
        "type": legacy_type,
        "short_factor": (1 + torch.rand(24, generator=g)).tolist(),
        "long_factor": (1 + 3 * torch.rand(24, generator=g)).tolist(),
    }
    config = _config_dir(tmp_path, rope_scaling=scaling, sliding_window=None)
    assert config.rope_scaling["rope_type"] == "longrope"
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    _config_dir(hf_dir, rope_scaling=scaling | {"type": "longrope" if legacy_type == "su" else legacy_type})
    hf = Phi3Config.from_pretrained(hf_dir)
    for max_model_len in (64, 256):
        rotary = Phi3ForCausalLM(config, max_model_len).model.layers[0].self_attn.rotary
        cos, sin = Phi3RotaryEmbedding(hf)(torch.zeros(1), torch.arange(max_model_len)[None, :])
        assert torch.equal(rotary.cos, cos[0]) and torch.equal(rotary.sin, sin[0]), max_model_len
        assert rotary.cos.shape == (max_model_len, 48)


def test_windows_beyond_max_model_len_are_dropped(tmp_path):
    """The 128k models' 262144-token window hides nothing from a shorter context; Phi-3-mini-4k's 2047 stays."""
    long = Phi3ForCausalLM(_config_dir(tmp_path, sliding_window=262144), 256)
    assert long.model.layers[0].self_attn.attn.sliding_window is None
    short = Phi3ForCausalLM(_config_dir(tmp_path, sliding_window=2047), 4096)
    assert short.model.layers[0].self_attn.attn.sliding_window == 2047


def test_packed_tensors_are_checked_by_name(tmp_path, checkpoints):
    """A packed tensor of the wrong height, and a quantized checkpoint's packed scale, are refused naming it."""
    src = checkpoints["phi3"]
    tensors = load_file(src / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    bad = "model.layers.1.self_attn.qkv_proj.weight"
    save_file(tensors | {bad: tensors[bad][:-64]}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"^model: '{bad}' checkpoint shard 'q\+k\+v' has 192 rows, expected 256"):
        LLM(str(tmp_path))
    scale = "model.layers.0.mlp.gate_up_proj.weight_scale"
    save_file(tensors | {scale: torch.ones(1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"^model: '{scale}': quantized Phi-3 checkpoints are not supported"):
        LLM(str(tmp_path))
