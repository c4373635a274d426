"""Every rope_scaling type: inverse frequencies, attention factor and cos/sin tables equal transformers', from the
config.json transformers writes (or the legacy rope_scaling form checkpoints ship) through ModelConfig."""

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanoserve.config import ModelConfig
from nanoserve.layers.rotary import RotaryEmbedding, rope_frequencies


def _factors(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1 + 3 * torch.rand(n, generator=g)).tolist()


# (name, head_dim, max_position_embeddings, rope_theta, scaling, top-level extras)
CASES = [
    ("gpt-oss yarn", 64, 131072, 150000, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 4096}, {}),
    ("qwen2.5 yarn", 128, 32768, 1000000.0, {"type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768}, {}),
    ("deepseek yarn mscale", 64, 163840, 10000.0, {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32,
                                                   "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
                                                   "original_max_position_embeddings": 4096}, {}),
    ("yarn attention_factor, default original length", 32, 2048, 10000.0,
     {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.8}, {}),
    ("phi-3 longrope", 96, 131072, 10000.0, {"type": "longrope", "short_factor": _factors(48, 0),
                                             "long_factor": _factors(48, 1)},
     {"original_max_position_embeddings": 4096}),
    ("longrope factor and attention_factor", 64, 8192, 10000.0,
     {"rope_type": "longrope", "factor": 4.0, "attention_factor": 1.2, "original_max_position_embeddings": 2048,
      "short_factor": _factors(32, 2), "long_factor": _factors(32, 3)}, {}),
    ("dynamic", 64, 2048, 10000.0, {"type": "dynamic", "factor": 2.0}, {}),
    ("dynamic factor 4", 128, 4096, 500000.0, {"rope_type": "dynamic", "factor": 4.0}, {}),
    ("llama3", 128, 131072, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, {}),
    ("linear", 64, 4096, 10000.0, {"type": "linear", "factor": 2.0}, {}),
]
IDS = [c[0] for c in CASES]


def _hf_config(head_dim, max_pos, theta, scaling, extras) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_pos, rope_theta=theta, rope_scaling=dict(scaling),
                       architectures=["LlamaForCausalLM"], **extras)


def _model_config(tmp_path, raw_fields: dict) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4} | raw_fields
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_dir(str(tmp_path), generation_config="none")


def _saved_by_transformers(tmp_path, hf: LlamaConfig) -> ModelConfig:
    hf.save_pretrained(tmp_path)
    return ModelConfig.from_dir(str(tmp_path), generation_config="none")


def _legacy(tmp_path, head_dim, max_pos, theta, scaling, extras) -> ModelConfig:
    """config.json as checkpoints made before transformers 5 ship it: rope_scaling and rope_theta at the top."""
    return _model_config(tmp_path, {"head_dim": head_dim, "max_position_embeddings": max_pos, "rope_theta": theta,
                                    "rope_scaling": scaling} | extras)


def _lengths(max_pos: int, scaling: dict, extras: dict) -> list[int]:
    """max_model_len values either side of every length the type's formula turns on."""
    old = extras.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings", max_pos))
    return sorted({16, old, old + 1, max_pos, 2 * max_pos})


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("written", ["transformers", "legacy"])
def test_frequencies_and_attention_factor_match_transformers(case, written, tmp_path):
    name, head_dim, max_pos, theta, scaling, extras = case
    hf = _hf_config(head_dim, max_pos, theta, scaling, extras)
    ours = (_saved_by_transformers(tmp_path, hf) if written == "transformers"
            else _legacy(tmp_path, head_dim, max_pos, theta, scaling, extras))
    kind = hf.rope_parameters["rope_type"]
    for max_model_len in _lengths(max_pos, scaling, extras):
        # The length transformers computes a length-dependent type for: longrope's and dynamic NTK's choice is made
        # once from max_model_len (see layers/rotary.py), the longest sequence the engine runs.
        seq_len = max_model_len if kind in ("longrope", "dynamic") else None
        ref_inv_freq, ref_attention = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", seq_len=seq_len)
        inv_freq, attention = rope_frequencies(ours.head_dim, ours.rope_theta, ours.rope_scaling, max_model_len)
        assert torch.equal(inv_freq, ref_inv_freq), f"{name}, max_model_len {max_model_len}"
        assert attention == ref_attention, f"{name}, max_model_len {max_model_len}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tables_match_transformers_rotary_embedding(case, tmp_path):
    """cos and sin as transformers' LlamaRotaryEmbedding gives them for a whole sequence of max_model_len tokens
    (attention factor included), for both halves the GPU kernels read and the full rows the CPU path reads."""
    name, head_dim, max_pos, theta, scaling, extras = case
    hf = _hf_config(head_dim, max_pos, theta, scaling, extras)
    ours = _saved_by_transformers(tmp_path, hf)
    old = ours.rope_scaling.get("original_max_position_embeddings", max_pos)
    # Short tables (a few hundred positions) keep the test fast; longrope's original length decides its factor.
    for max_model_len in sorted({min(old, 300), min(old + 1, 301)}):
        rotary = RotaryEmbedding(ours.head_dim, max_model_len, ours.rope_theta, ours.rope_scaling)
        positions = torch.arange(max_model_len)[None, :]
        ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
        assert torch.equal(rotary.cos, ref_cos[0]) and torch.equal(rotary.sin, ref_sin[0]), name
        half = head_dim // 2
        assert torch.equal(rotary.cos_half, ref_cos[0, :, :half]) and torch.equal(rotary.sin_half, ref_sin[0, :, :half])


def test_longrope_switches_factors_at_the_original_length(tmp_path):
    name, head_dim, max_pos, theta, scaling, extras = CASES[4]
    ours = _legacy(tmp_path, head_dim, max_pos, theta, scaling, extras)
    short, _ = rope_frequencies(head_dim, theta, ours.rope_scaling, 4096)
    long, attention = rope_frequencies(head_dim, theta, ours.rope_scaling, 4097)
    assert torch.allclose(short * torch.tensor(scaling["short_factor"]), long * torch.tensor(scaling["long_factor"]))
    assert attention == pytest.approx((1 + torch.log(torch.tensor(32.0)) / torch.log(torch.tensor(4096.0))) ** 0.5)


def test_yarn_attention_factor_scales_the_tables():
    scaling = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
               "max_position_embeddings": 131072}
    plain = RotaryEmbedding(64, 64, 150000, {**scaling, "attention_factor": 1.0})
    scaled = RotaryEmbedding(64, 64, 150000, scaling)
    factor = 0.1 * torch.log(torch.tensor(32.0)).item() + 1
    assert torch.allclose(scaled.cos_half, plain.cos_half * factor) and torch.allclose(scaled.sin, plain.sin * factor)


def test_default_rope_is_no_scaling(tmp_path):
    ours = _model_config(tmp_path, {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert ours.rope_scaling is None and ours.rope_theta == 5e5


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "su2", "factor": 2.0}, "rope_scaling: type 'su2' is not supported"),
    ({"type": "llama3", "factor": 8.0}, "rope_scaling: type .llama3. needs .low_freq_factor."),
    ({"rope_type": "dynamic"}, "rope_scaling: type 'dynamic' needs 'factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16}, "rope_scaling: type 'longrope' needs 'long_factor'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
     "rope_scaling: short_factor has 8 values; the rotary dimension 32 needs 16"),
])
def test_bad_rope_scaling_is_refused_naming_the_field(scaling, message, tmp_path):
    ours = _model_config(tmp_path, {"max_position_embeddings": 64, "rope_scaling": scaling})
    with pytest.raises(ValueError, match=message):
        RotaryEmbedding(32, 64, 10000.0, ours.rope_scaling)


def test_partial_rotary_matches_transformers_phi3():
    """partial_rotary_factor 0.75 (Phi-4-mini's): transformers' Phi-3 rotation on the CPU path, and the kernels'
    reference on the half tables the GPU reads; the last quarter of each head passes through."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from nanoserve.kernels.rotary import apply_rotary_ref

    hf = Phi3Config(hidden_size=256, num_attention_heads=4, partial_rotary_factor=0.75, max_position_embeddings=64)
    rotary = RotaryEmbedding(64, 64, 10000.0, None, rotary_dim=48)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 4, 64, generator=g), torch.randn(9, 2, 64, generator=g)
    positions = torch.randint(0, 64, (9,), generator=g)
    got_q, got_k = rotary(positions, q, k)
    cos, sin = Phi3RotaryEmbedding(hf)(q, positions[None, :])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., 48:], q[..., 48:])
    ref_q, ref_k = q.clone(), k.clone()
    apply_rotary_ref(ref_q, ref_k, rotary.cos_half, rotary.sin_half, positions)
    torch.testing.assert_close(ref_q, got_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ref_k, got_k, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [13, 80])
def test_bad_rotary_dim_is_refused(rotary_dim):
    with pytest.raises(ValueError, match="^partial_rotary_factor: the rotary dimension"):
        RotaryEmbedding(64, 16, 10000.0, None, rotary_dim=rotary_dim)
