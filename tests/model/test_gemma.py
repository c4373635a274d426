"""Gemma 2 and 3 (tests/checkpoints.py's small ones, random weights, fp32) against transformers through the engine's
hard paths: prompts longer than the 24-token window, chunked prefill whose chunks straddle it, prefix hits, preemption
and n > 1; and Gemma 3's multimodal checkpoints, served text-only. test_models_vs_hf.py has mixed lengths and the first
step's logits."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams

NEW_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Two prompts past the window sharing their first 40 tokens (a prefix hit for the second), one inside it."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(2, 384, (40,), generator=g).tolist()
    return [shared + torch.randint(2, 384, (n,), generator=g).tolist() for n in (30, 13)] + [
        torch.randint(2, 384, (17,), generator=g).tolist()
    ]


def _hf_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ref[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_hard_paths_match_transformers(arch, checkpoints):
    path = checkpoints[arch]
    prompts = _prompts()
    expected = _hf_tokens(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), prompts)
    # 16-token steps of 8-token blocks: chunks start inside and past the window. 12 blocks hold one long sequence
    # (9-10 blocks) and not two, so running the second batch's samples together preempts some.
    llm = LLM(str(path), block_size=8, max_num_batched_tokens=16, num_kv_blocks=12, enable_prefix_caching=True)
    attns = [layer.self_attn.attn for layer in llm.engine.runner.model.model.layers]
    if arch == "gemma2":
        assert [(a.sliding_window, a.softcap, a.scale) for a in attns] == [(24, 1.5, 20**-0.5), (None, 1.5, 20**-0.5)]
    else:
        assert [(a.sliding_window, a.softcap) for a in attns] == [(24, None), (24, None), (None, None)]
    first = llm.generate(prompts[:1], PARAMS, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == expected[0]
    rest = llm.generate(
        prompts[1:] + prompts[:1],
        SamplingParams(n=2, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert rest[0].num_cached_tokens >= 32  # the shared 40 tokens' whole blocks
    assert llm.engine.scheduler.num_preemptions > 0
    for out, want in zip(rest, expected[1:] + expected[:1], strict=True):
        assert [o.token_ids for o in out.outputs] == [want, want]


def test_multimodal_checkpoint_serves_its_language_model(tmp_path, caplog):
    """Gemma3ForConditionalGeneration as transformers writes it (text_config, weights under model.language_model.*,
    a vision tower and projector beside them): the language model's tokens, and a start-up line that says so."""
    from checkpoints import VOCAB, write_tokenizer
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=0.2,
        sliding_window=16,
        sliding_window_pattern=2,
        query_pre_attn_scalar=32,
        max_position_embeddings=256,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 1,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and "norm" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    prompts = [p[:35] for p in _prompts()[:2]]
    expected = _hf_tokens(model, prompts)
    with caplog.at_level(logging.WARNING, logger="nanoserve.model.gemma"):
        llm = LLM(str(tmp_path), num_kv_blocks=32)
    assert "vision tower" in caplog.text and "skipped" in caplog.text
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the kernels; on a GPU they run anyway")
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_triton_kernels_give_the_reference_tokens(arch, tmp_path, monkeypatch):
    """The model's wiring of soft-capping, the scale, windows and the (1 + w) q/k norms into the GPU kernels: the
    attention layers on TritonBackend (prefill, decode and, for every all-decode step the plan fuses, decode attention
    with rotary and the KV store; run by the interpreter over the CPU caches) give the PyTorch backend's tokens."""
    from checkpoints import write_checkpoint

    from nanoserve.kernels import decode_rope_attention as module
    from nanoserve.layers.attention import TritonBackend
    from nanoserve.layers.step_plan import KernelPlanner

    path = write_checkpoint(tmp_path / arch, arch, head_dim=64)  # the kernels take head_dim 64, 128 or 256
    # Gemma 3's q/k norms fuse into decode attention at batch 1 only (layers/step_plan.py), Gemma 2's up to 4.
    prompts = [p[:30] for p in _prompts()[: 1 if arch == "gemma3" else 2]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def generate(triton: bool) -> list[list[int]]:
        llm = LLM(str(path), num_kv_blocks=16, block_size=8, max_num_seqs=2)
        if triton:
            for layer in llm.engine.runner.attn_layers:
                layer.backend = TritonBackend
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = generate(False)
    plan, calls = KernelPlanner.plan, []
    monkeypatch.setattr(KernelPlanner, "plan", lambda self, *a, **kw: plan(self, *a, **{**kw, "triton": True}))
    original = module.decode_rope_attention
    monkeypatch.setattr(module, "decode_rope_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    assert generate(True) == reference
    assert calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts Python calls, which graph replays skip")
def test_one_row_graphs_fuse_gemmas_prologues(checkpoints, monkeypatch):
    """Gemma 3 with graph capture faked for its one-row steps (layers/step_plan.py's plan): each layer hands its
    (1 + w) add + norms to qkv_proj's and gate_up_proj's GEMVs and GELU-and-mul to down_proj's, and the tokens are
    the unfused model's. The GEMVs run as their references here (the interpreter takes about a second a launch);
    tests/kernels/test_gemv_fused.py holds the kernels to those."""
    from nanoserve.kernels import gemv
    from nanoserve.layers.step_plan import KernelPlanner

    prompts = [_prompts()[2][:9]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def generate() -> list[list[int]]:
        llm = LLM(str(checkpoints["gemma3"]), num_kv_blocks=16, max_num_seqs=1)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = generate()
    calls = []

    def norm_linear(x, residual, norm_w, eps, w, b, late_dependents=False, weight_offset=0.0, weight_scale=None):
        calls.append(("norm", weight_offset))
        return gemv.skinny_norm_linear_ref(x, residual, norm_w, eps, w, b, weight_offset=weight_offset)

    def act_linear(x, w, b, activation="silu", weight_scale=None):
        calls.append(("act", activation))
        return gemv.skinny_silu_mul_linear_ref(x, w, b, activation=activation)

    monkeypatch.setattr(gemv, "skinny_norm_linear", norm_linear)
    monkeypatch.setattr(gemv, "skinny_silu_mul_linear", act_linear)
    monkeypatch.setattr(gemv, "skinny_linear", gemv.skinny_linear_ref)
    plan = KernelPlanner.plan
    monkeypatch.setattr(KernelPlanner, "plan", lambda self, *a, **kw: plan(self, *a, **{**kw, "graph": True}))
    assert generate() == reference
    # 2 one-row decode steps x 3 layers: two (1 + w) norms and one GELU-and-mul each.
    assert sorted(calls) == [("act", "gelu_tanh")] * 6 + [("norm", 1.0)] * 12


@pytest.mark.parametrize("name", ["gemma-2-9b", "gemma-3-27b"])
def test_published_configs_read_as_transformers_reads_them(name):
    """The bench configs (published config.json files: Gemma 3's multimodal one lists in text_config only what
    differs from the defaults, and rope_theta, rope_local_base_freq, sliding_window_pattern in the old form): the
    fields nanoserve takes equal the ones transformers' config resolves to."""
    from pathlib import Path

    from transformers import AutoConfig

    from nanoserve.config import ModelConfig
    from nanoserve.model.gemma import Gemma3ForCausalLM, gemma_layer_types

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / name
    hf = AutoConfig.from_pretrained(path)
    hf = getattr(hf, "text_config", hf)
    ours = ModelConfig.from_dir(str(path))
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "max_position_embeddings", "sliding_window")
    assert [getattr(ours, f) for f in fields] == [getattr(hf, f) for f in fields]
    assert gemma_layer_types(ours) == hf.layer_types
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        assert ours.raw.get(key) == getattr(hf, key)
    if name == "gemma-3-27b":
        ropes = hf.rope_parameters
        assert ours.rope_theta == ropes["full_attention"]["rope_theta"] == 1e6
        assert ours.rope_scaling["rope_type"] == ropes["full_attention"]["rope_type"] == "linear"
        assert ours.rope_scaling["factor"] == ropes["full_attention"]["factor"] == 8.0
        rotaries = Gemma3ForCausalLM.rotaries(None, ours, 16)
        local = 1.0 / ropes["sliding_attention"]["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)
        torch.testing.assert_close(rotaries["sliding_attention"].cos_half[5], (5 * local).cos())
        assert hf.rope_parameters["sliding_attention"]["rope_type"] == "default"


@pytest.mark.usefixtures("one_thread_per_rank")  # module-scoped: this test is the module's last
def test_two_ranks_give_one_ranks_tokens(checkpoints):
    """Gemma 2 under tensor parallelism on gloo: its final soft-capping runs on the gathered logits, its scaled
    embedding on the all-reduced lookup; chunked prefill and a prefix hit on the way."""
    prompts = _prompts()
    engine = dict(block_size=8, max_num_batched_tokens=16, num_kv_blocks=32, enable_prefix_caching=True)
    want = [
        o.outputs[0].token_ids
        for o in LLM(str(checkpoints["gemma2"]), **engine).generate(prompts, PARAMS, use_tqdm=False)
    ]
    llm = LLM(str(checkpoints["gemma2"]), tensor_parallel_size=2, **engine)
    try:
        assert llm.engine.runner.model.lm_head.weight.shape[0] == 384 // 2
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    finally:
        llm.shutdown()
