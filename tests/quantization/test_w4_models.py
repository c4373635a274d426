"""4-bit checkpoints of each format (tests/w4_checkpoints.py writes them from random weights) run by the engine on
the CPU (fp32): every quantized layer's weight, dequantized, is exactly the weight the writer quantized to, and the
greedy tokens are transformers' on the dense checkpoint of those weights; a config.json alone runs with random
weights in the 4-bit layout."""

import json

import pytest
import torch
from w4_checkpoints import W4Format, write_w4_checkpoint

from nanoserve import LLM, SamplingParams
from nanoserve.kernels.w4a16_reference import dequantize_w4
from nanoserve.layers.linear import Linear
from nanoserve.quantization.w4_linear import W4LinearMethod

NEW_TOKENS = 8
STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

# (architecture, format): each format, symmetric and not, act-order, one group per row, GPTQ's two zero encodings,
# biases (qwen2), q/k norms and tied embeddings (qwen3), ignore lists. Greedy tokens are compared for one case a format
# (a model's generate costs seconds on 2 cores); every case's weights are compared.
CASES = {
    "gptq-asym-act-order": ("qwen2", W4Format("gptq", symmetric=False, act_order=True)),
    "awq": ("qwen3", W4Format("awq", symmetric=False, ignore=("layers.1.mlp.down_proj",))),
    "compressed-tensors": ("mistral", W4Format("compressed-tensors", 64)),
    "compressed-tensors-asym-act-order": ("llama", W4Format("compressed-tensors", 16, symmetric=False,
                                                            act_order=True)),
    "gptq": ("llama", W4Format("gptq")),
    "gptq_v2-per-row": ("mistral", W4Format("gptq", -1, symmetric=False, gptq_format="gptq_v2")),
}
TOKEN_CASES = ["gptq-asym-act-order", "awq", "compressed-tensors-asym-act-order"]


@pytest.fixture(scope="module")
def written(checkpoints, tmp_path_factory) -> dict:
    """name -> (4-bit checkpoint, dense checkpoint, module -> dequantized weight), written on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            arch, fmt = CASES[name]
            cache[name] = write_w4_checkpoint(checkpoints[arch], tmp_path_factory.mktemp(name), fmt)
        return cache[name]
    return get


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (1, 9, 40)]


def layer_weight(layer: Linear) -> torch.Tensor:
    """The layer's weight [N, K] as it multiplies x: dequantized, its rows back in the checkpoint's column order."""
    w = dequantize_w4(layer.qweight, layer.scales, layer.zeros, layer.group_size)
    if layer.perm is not None:
        w = torch.empty_like(w).index_copy_(0, layer.perm.long(), w)
    return w.t()


@pytest.mark.parametrize("name", list(CASES))
def test_layers_hold_the_quantized_weights_exactly(name, written):
    ckpt, _, weights = written(name)
    fmt = CASES[name][1]
    model = LLM(str(ckpt), num_kv_blocks=8).engine.runner.model
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.quant_method is not None}
    assert len(quantized) == 8 - len(fmt.ignore)
    for module, layer in quantized.items():
        base, _, last = module.rpartition(".")
        want = torch.cat([weights[f"{base}.{part}"] for part in STACKED.get(last, (last,))])
        assert torch.equal(layer_weight(layer), want), module
        assert layer.qweight.dtype == torch.int32 and not hasattr(layer, "weight")
    assert all((layer.perm is not None) == fmt.act_order for layer in quantized.values())
    assert all((layer.zeros is None) == fmt.symmetric for layer in quantized.values())


@pytest.mark.parametrize("name", TOKEN_CASES)
def test_greedy_tokens_are_transformers_on_the_dequantized_weights(name, written):
    ckpt, dense, _ = written(name)
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=512)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    for prompt, out in zip(prompts(), outs, strict=True):
        ids = torch.tensor([prompt])
        ref = reference.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_kernel_forward_gives_the_reference_tokens(written, monkeypatch):
    """The layers' CUDA forward (kernels/w4a16_gemm.py, here under the Triton interpreter, fp32) generates the CPU
    path's tokens: one prompt alone decodes through the GEMV, several through the GEMM (act-order and zero points
    on)."""
    ckpt, _, _ = written("gptq-asym-act-order")
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run() -> list[list[int]]:
        alone = llm.generate(prompts()[1:2], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in alone + llm.generate(prompts()[:2], params, use_tqdm=False)]
    want = run()
    calls = []
    kernel = W4LinearMethod.apply_kernel
    monkeypatch.setattr(W4LinearMethod, "apply", lambda self, layer, x: calls.append(1) or kernel(self, layer, x))
    assert run() == want
    assert calls


@pytest.mark.parametrize("fmt", [W4Format("awq", 64, symmetric=False),
                                 W4Format("gptq", act_order=True), W4Format("compressed-tensors", symmetric=False)])
def test_dummy_weights_take_the_4bit_layout(fmt, tmp_path, checkpoints):
    """A config.json alone runs with random 4-bit weights (how the benchmarks run quantized models); the start-up
    line (and /v1/models, /metrics, which show the same description) says what runs."""
    config = json.loads((checkpoints["llama"] / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config()
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), tokenizer=str(checkpoints["llama"]), load_format="dummy", num_kv_blocks=16)
    kind = "symmetric" if fmt.symmetric else "asymmetric"
    assert f"w4a16 ({fmt.method}): int4 weights, {kind}, groups of {fmt.group_size}" in llm.engine.config.summary(16)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    groups = 64 // fmt.group_size if fmt.group_size > 0 else 1
    assert qkv.qweight.shape == (64 // 8, 128) and qkv.scales.shape == (groups, 128)
    assert (qkv.zeros is None) == fmt.symmetric
    w = dequantize_w4(qkv.qweight, qkv.scales, qkv.zeros, qkv.group_size)
    assert 0.005 < w.abs().mean() < 0.05 and len(w.unique()) >= 16
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
