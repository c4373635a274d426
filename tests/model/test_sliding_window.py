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


def _add_sinks(path, num_layers: int, num_heads: int) -> None:
    """A sink logit per head in each layer's checkpoint tensors, under the name the layers load it by: near the
    log of the number of keys a row sees, so that the sink takes a good share of the weight."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for i in range(num_layers):
        tensors[f"model.layers.{i}.self_attn.attn.sinks"] = torch.randn(num_heads, generator=g) + 5
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("window,sinks", [(24, False), (150, True), (None, True)])
def test_long_context_mode_with_a_window(tmp_path, window, sinks, monkeypatch):
    """A prompt four times the GPU pool (long-context mode, kv_ring.py): a window inside the device's blocks skips
    every older chunk; a wider one reaches into them, which come back in position order (slots of two blocks).
    Sinks (on every layer here) join the merged pieces once."""
    import functools

    from nanoserve.layers.attention import Attention
    from nanoserve.model import llama
    from nanoserve.worker import kv_ring

    monkeypatch.setattr(kv_ring, "RING_SLOT_TOKENS", 32)
    path = write_checkpoint(tmp_path / "m", "mistral", sliding_window=window)
    if sinks:
        _add_sinks(path, 2, 4)
        monkeypatch.setattr(llama, "Attention", functools.partial(Attention, sinks=True))
    prompt = torch.randint(2, 384, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(str(path), num_kv_blocks=64, block_size=16).generate([prompt], params, use_tqdm=False)
    llm = LLM(str(path), kv_offload_gb=0.01, num_kv_blocks=6, block_size=16)
    assert all(layer.sinks is not None for layer in llm.engine.runner.attn_layers) == sinks
    got = llm.generate([prompt], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert llm.engine.block_manager.cpu.allocated > 0


@pytest.mark.parametrize("window", [None, 6])
def test_torch_backend_sinks_match_transformers_gpt_oss_eager(window):
    """The PyTorch backend's sinks (and window) against transformers' gpt-oss eager attention, which appends each
    head's sink logit to the scores, takes the softmax and drops the sink's column: a chunk of 5 new tokens after
    9 cached ones, GQA 2, block size 4, pages out of order."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from nanoserve.layers.attention import Attention, AttentionMetadata

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, seq_len, q_len, bs = 4, 2, 16, 14, 5, 4
    attn = Attention(heads, kv_heads, dim, sliding_window=window, sinks=True)
    assert attn.sinks.shape == (heads,)
    attn.sinks.data.copy_(torch.randn(heads, generator=g) * 2)
    k = torch.randn(seq_len, kv_heads, dim, generator=g)
    v = torch.randn(seq_len, kv_heads, dim, generator=g)
    q = torch.randn(q_len, heads, dim, generator=g)
    pages = [3, 0, 2, 1]
    attn.k_cache, attn.v_cache = torch.zeros(4, bs, kv_heads, dim), torch.zeros(4, bs, kv_heads, dim)
    for p in range(seq_len):
        attn.k_cache[pages[p // bs], p % bs], attn.v_cache[pages[p // bs], p % bs] = k[p], v[p]
    meta = AttentionMetadata(torch.zeros(q_len, dtype=torch.int64), torch.tensor([0, q_len], dtype=torch.int32),
                             torch.tensor([seq_len], dtype=torch.int32), torch.tensor([pages], dtype=torch.int32),
                             q_len, 0)
    got = attn.attend(q, meta)

    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    seen = (k_pos <= q_pos) & (k_pos > q_pos - (window or seq_len + 1))
    mask = torch.zeros(q_len, seq_len).masked_fill(~seen, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, sinks=attn.sinks.data, training=False)
    want, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      v.transpose(0, 1)[None], mask, dim**-0.5)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_qwen_windows_only_with_use_sliding_window_past_max_window_layers(model_type):
    """transformers' Qwen2/Qwen3 rule: no window unless use_sliding_window, then only in layers >= max_window_layers."""
    from nanoserve.config import ModelConfig
    from nanoserve.model.llama import layer_sliding_window

    def windows(**raw) -> list[int | None]:
        config = ModelConfig(architecture="", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=3,
                             num_attention_heads=1, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
                             rope_theta=1e4, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                             attention_bias=False, hidden_act="silu", torch_dtype=None, sliding_window=16,
                             eos_token_ids=[], raw={"model_type": model_type, **raw})
        return [layer_sliding_window(config, layer) for layer in range(3)]

    assert windows() == [None, None, None]
    assert windows(use_sliding_window=True, max_window_layers=1) == [None, 16, 16]
