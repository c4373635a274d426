"""FP8 checkpoints of each format, written here from random weights, run by the engine on the CPU (fp32): greedy
tokens equal transformers' on the same model with the dequantized weights and the activations quantized as the
format defines (tests/quantization/fp8_checkpoints.py), and the first step's logits agree to fp32 rounding;
`--quantization fp8` on an unquantized checkpoint runs as its per-channel, per-token checkpoint would; dummy
weights take the quantized layout."""

import json

import pytest
import torch
from fp8_checkpoints import Format, calibrate_input_scales, reference_model, write_fp8_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import Linear

NEW_TOKENS = 10
LOGITS_TOL = 1e-4


def random_prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 5, 37, 70)]


# (architecture, format): every weight and activation strategy, both layouts, biases (qwen2), q/k norms and tied
# embeddings (qwen3).
CASES = {
    "channel-token": ("llama", Format("channel", "token")),
    "tensor-static": ("qwen2", Format("tensor", "tensor")),
    "block-fp8": ("qwen3", Format("block", "group", (16, 32), layout="fp8")),
    "block-compressed-tensors": ("llama", Format("block", "group", (32, 16))),
    "weight-only": ("mistral", Format("channel", None, ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"))),
}


def write_case(tmp_path, checkpoints, name: str):
    arch, fmt = CASES[name]
    scales = calibrate_input_scales(checkpoints[arch], random_prompts(1)) if fmt.activations == "tensor" else None
    return write_fp8_checkpoint(checkpoints[arch], tmp_path / name, fmt, scales), fmt


def generate_with_logits(llm: LLM, prompts, monkeypatch) -> tuple[list[list[int]], torch.Tensor]:
    seen: list[torch.Tensor] = []
    compute_logits = llm.engine.runner.model.compute_logits
    monkeypatch.setattr(llm.engine.runner.model, "compute_logits",
                        lambda h: seen.append(compute_logits(h)) or seen[-1])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], seen[0]


def assert_matches_reference(tokens, first_logits, reference, prompts) -> None:
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = reference(ids).logits[0, -1]
        err = (first_logits[i] - want).norm() / want.norm()
        assert err < LOGITS_TOL, f"prompt {i}: logits differ by {err:.2e}"
        ref = reference.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert tokens[i] == ref[0, len(prompt):].tolist(), f"prompt {i}"


@pytest.mark.parametrize("name", list(CASES))
def test_checkpoint_matches_transformers_on_its_quantization(name, tmp_path, checkpoints, monkeypatch):
    ckpt, fmt = write_case(tmp_path, checkpoints, name)
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=512)
    model = llm.engine.runner.model
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.quant_method is not None]
    assert len(quantized) == 4 * 2 - (name == "weight-only")  # qkv, o, gate_up, down a layer; less the ignored
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in quantized)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    prompts = random_prompts()
    tokens, logits = generate_with_logits(llm, prompts, monkeypatch)
    assert_matches_reference(tokens, logits, reference_model(ckpt, fmt), prompts)
    # The activations' quantization matters: transformers without it differs.
    plain = reference_model(ckpt, Format(fmt.weights, None, fmt.block, fmt.layout, fmt.ignore))
    with torch.no_grad():
        unquantized_acts = plain(torch.tensor([prompts[3]])).logits[0, -1]
    if fmt.activations is not None:
        assert (logits[3] - unquantized_acts).norm() / unquantized_acts.norm() > 100 * LOGITS_TOL


def test_quantization_flag_quantizes_per_channel_and_token(tmp_path, checkpoints, monkeypatch):
    """`--quantization fp8` on an unquantized checkpoint runs exactly as its channel/token checkpoint does."""
    src = checkpoints["llama"]
    llm = LLM(str(src), quantization="fp8", num_kv_blocks=64, max_num_batched_tokens=512)
    assert "fp8 (quantized at load): weights per channel, activations dynamic per token" in \
        llm.engine.config.summary(64)
    prompts = random_prompts(2)
    tokens, logits = generate_with_logits(llm, prompts, monkeypatch)
    fmt = Format("channel", "token")
    assert_matches_reference(tokens, logits, reference_model(write_fp8_checkpoint(src, tmp_path / "q", fmt), fmt),
                             prompts)


@pytest.mark.parametrize("quantization_config", [None, CASES["block-fp8"][1].quantization_config()])
def test_dummy_weights_take_the_quantized_layout(quantization_config, tmp_path, checkpoints):
    """A config.json alone runs with random fp8 weights: a quantized config's, or an unquantized one's with
    --quantization fp8."""
    config = json.loads((checkpoints["qwen3"] / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    flag = None if quantization_config else "fp8"
    llm = LLM(str(tmp_path), tokenizer=str(checkpoints["qwen3"]), load_format="dummy", quantization=flag,
              num_kv_blocks=16)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    want = (qkv.weight.shape[0] // 16, qkv.weight.shape[1] // 32) if quantization_config else (qkv.weight.shape[0],)
    assert tuple(qkv.weight_scale.shape) == want
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
