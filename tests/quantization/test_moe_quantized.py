"""Quantized mixture-of-experts checkpoints (quantization/moe_experts.py): FP8 and 4-bit experts written by the tests'
format writers from random weights, dequantized while loading. Every expert holds exactly the weight the writer
quantized to; weight-only checkpoints give transformers' greedy tokens on those weights; what cannot load is refused
naming the tensor."""

import collections
import json

import pytest
import torch
from fp8_checkpoints import Format, element_scale, write_fp8_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from w4_checkpoints import W4Format, write_w4_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.layers.linear import Linear
from nanoserve.layers.moe import FusedMoE

NEW_TOKENS = 8
# Everything but the experts left unquantized: the experts alone decide the tokens (fp8_checkpoints.py's writer and
# the engine both read "re:" entries as regular expressions matched at the module name's start).
EXPERTS_ONLY = ("re:^(?!.*experts).*",)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 40)]


def expert_weights(experts: FusedMoE, weights: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, ...]:
    """What w13 and w2 of `experts` must hold: the writer's dequantized weight of each expert projection."""
    e = range(experts.num_experts)
    w13 = torch.stack([torch.cat([weights[f"{prefix}.{i}.gate_proj"], weights[f"{prefix}.{i}.up_proj"]]) for i in e])
    return w13, torch.stack([weights[f"{prefix}.{i}.down_proj"] for i in e])


def assert_tokens_are_transformers(llm: LLM, dense) -> None:
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    for prompt, out in zip(prompts(), outs, strict=True):
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch, fmt", [("qwen3_moe", W4Format("gptq", 16, symmetric=False, act_order=True)),
                                       ("qwen2_moe", W4Format("awq", 16, symmetric=False))])
def test_4bit_experts_hold_their_weights_and_give_transformers_tokens(arch, fmt, checkpoints, tmp_path):
    ckpt, dense, weights = write_w4_checkpoint(checkpoints[arch], tmp_path, fmt)
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=512)
    assert "(routed experts dequantized while loading: float32)" in llm.engine.config.summary(64)
    model = llm.engine.runner.model
    block = model.model.layers[0].mlp
    w13, w2 = expert_weights(block.experts, weights, "model.layers.0.mlp.experts")
    assert torch.equal(block.experts.w13, w13) and torch.equal(block.experts.w2, w2)
    assert block.gate.quant_method is None  # the router stays unquantized, as the checkpoint holds it
    # Attention (and Qwen2-MoE's shared expert) are 4-bit linear layers as in a dense model.
    assert model.model.layers[0].self_attn.qkv_proj.quant_method is not None
    assert_tokens_are_transformers(llm, dense)


def test_fp8_experts_hold_their_weights_and_give_transformers_tokens(checkpoints, tmp_path):
    """Weight-only per-channel FP8 experts, the rest unquantized: transformers on the dequantized experts."""
    fmt = Format("channel", None, ignore=EXPERTS_ONLY)
    ckpt = write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path / "fp8", fmt)
    tensors = load_file(ckpt / "model.safetensors")
    dense, weights = {}, {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            module = key.removesuffix(".weight")
            t = weights[module] = t.float() * element_scale(tensors[f"{module}.weight_scale"].float(),
                                                            tuple(t.shape), fmt)
        dense[key] = t
    assert len(weights) == 8 * 3  # every expert projection of the sparse layer, nothing else
    (tmp_path / "dense").mkdir()
    for f in ckpt.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (tmp_path / "dense" / f.name).write_bytes(f.read_bytes())
    save_file(dense, tmp_path / "dense" / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=512)
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    w13, w2 = expert_weights(experts, weights, "model.layers.0.mlp.experts")
    assert torch.equal(experts.w13, w13) and torch.equal(experts.w2, w2)
    assert not any(isinstance(m, Linear) and m.quant_method is not None for m in llm.engine.runner.model.modules())
    assert_tokens_are_transformers(llm, tmp_path / "dense")


def test_block_fp8_experts_beside_w8a8_layers(checkpoints, tmp_path):
    """A Qwen3-FP8-style checkpoint (quant_method fp8, 16x16 blocks, dynamic activations): the experts hold exactly
    their dequantized weights, the router stays 16-bit, the attention runs W8A8, and it generates."""
    fmt = Format("block", "group", (16, 16), layout="fp8")
    ckpt = write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path, fmt)
    tensors = load_file(ckpt / "model.safetensors")
    llm = LLM(str(ckpt), num_kv_blocks=64)
    layer = llm.engine.runner.model.model.layers[0]
    for i in (0, 5):
        for proj, rows in (("gate_proj", slice(0, 32)), ("up_proj", slice(32, 64)), ("down_proj", None)):
            q = tensors[f"model.layers.0.mlp.experts.{i}.{proj}.weight"]
            want = q.float() * element_scale(tensors[f"model.layers.0.mlp.experts.{i}.{proj}.weight_scale_inv"],
                                             tuple(q.shape), fmt)
            got = layer.mlp.experts.w2[i] if rows is None else layer.mlp.experts.w13[i, rows]
            assert torch.equal(got, want), (i, proj)
    assert layer.mlp.gate.weight.dtype == torch.float32 and layer.mlp.gate.quant_method is None
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_what_cannot_load_is_refused(checkpoints, tmp_path):
    ckpt, _, _ = write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path / "w4", W4Format("gptq", 32))
    tensors = load_file(ckpt / "model.safetensors")
    # One expert projection's scales missing: named, rather than a weight left unwritten.
    del tensors["model.layers.0.mlp.experts.3.up_proj.scales"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts expert projection up:3 lacks scales"):
        LLM(str(ckpt), num_kv_blocks=16)
    # Quantized expert tensors with no quantization_config to read them by.
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.\w+' is a quantized expert tensor"):
        LLM(str(ckpt), num_kv_blocks=16)
    # An ignore list naming some experts only: nanoserve runs a layer's experts as one.
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.experts.2.gate_proj"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names some of the experts of model.layers.0.mlp.experts"):
        LLM(str(ckpt), load_format="dummy", num_kv_blocks=16)


def test_an_expert_with_only_its_input_scale_is_refused(checkpoints, tmp_path):
    """A static W8A8 checkpoint's input_scale is read and dropped; the loader counts the projection as read at it, so
    an expert projection whose weight and scale are absent must still be named, not left unwritten."""
    scales = collections.defaultdict(lambda: torch.tensor([0.02]))
    ckpt = write_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path, Format("tensor", "tensor"), scales)
    tensors = load_file(ckpt / "model.safetensors")
    for part in ("weight", "weight_scale"):
        del tensors[f"model.layers.0.mlp.experts.3.up_proj.{part}"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"expert projection up:3 lacks weight, weight_scale"):
        LLM(str(ckpt), num_kv_blocks=16)


def test_shared_expert_columns_must_be_whole_groups(checkpoints, tmp_path):
    """Qwen2-MoE's shared expert is a linear layer of its own width (48 here), checked like down_proj."""
    ckpt, _, _ = write_w4_checkpoint(checkpoints["qwen2_moe"], tmp_path, W4Format("awq", 32))
    with pytest.raises(ValueError, match="group_size: 32 does not divide the model's shared_expert down_proj columns "
                                         "48"):
        LLM(str(ckpt), load_format="dummy", num_kv_blocks=16)


@pytest.mark.usefixtures("one_thread_per_rank")
def test_two_ranks_equal_one(checkpoints, tmp_path):
    """Each rank takes its share of every dequantized expert (half of each expert's intermediate rows): TP=2 on gloo
    generates TP=1's tokens."""
    ckpt, _, _ = write_w4_checkpoint(checkpoints["qwen3_moe"], tmp_path, W4Format("gptq", 16, symmetric=False))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(ckpt), num_kv_blocks=32).generate(prompts(), params,
                                                                                        use_tqdm=False)]
    llm = LLM(str(ckpt), tensor_parallel_size=2, num_kv_blocks=32)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)] == want
    finally:
        llm.shutdown()
