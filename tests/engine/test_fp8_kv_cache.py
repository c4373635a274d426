"""kv_cache_dtype fp8 on the CPU engine (the PyTorch path; the kernels' fp8 paths are in
tests/kernels/test_fp8_kv_kernels.py and tests/gpu/test_fp8_kv_gpu.py): it agrees with the model-dtype cache within a
stated bound, fits twice the blocks, takes the checkpoint's scales, long-context mode and the CPU tier move its bytes,
and bad values are refused."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from nanoserve import LLM, EngineArgs, SamplingParams
from nanoserve.worker.kv_cache import num_blocks_for

# Teacher-forced log-probabilities of the prompts' tokens (the tiny random model, fp32): fp8's 3 mantissa bits cost
# a mean of ~0.12 nats and at most ~0.6 here; reading test_scales_from_the_checkpoint's cache without its scales
# missed by a mean of ~1.5 and up to ~7.4.
MEAN_BOUND, MAX_BOUND = 0.25, 1.0


def _prompts() -> list[list[int]]:
    return [torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 30, 70, 150)]


def _prompt_logprobs(llm: LLM) -> list[float]:
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [
        lp[t].logprob
        for o, p in zip(outs, _prompts(), strict=True)
        for lp, t in zip(o.prompt_logprobs, p, strict=True)
        if lp is not None
    ]


@pytest.fixture(scope="module")
def auto_logprobs(llama_dir) -> torch.Tensor:
    return torch.tensor(_prompt_logprobs(LLM(str(llama_dir), num_kv_blocks=64)))


def _assert_within_bound(llm: LLM, want: torch.Tensor) -> None:
    diff = (torch.tensor(_prompt_logprobs(llm)) - want).abs()
    assert diff.mean() < MEAN_BOUND and diff.max() < MAX_BOUND, (diff.mean(), diff.max())


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_fp8_cache_agrees_with_the_model_dtype(llama_dir, auto_logprobs, value):
    llm = LLM(str(llama_dir), num_kv_blocks=64, kv_cache_dtype=value)
    k_cache = llm.engine.runner.kv_cache[0][0]
    assert k_cache.dtype == torch.float8_e4m3fn
    _assert_within_bound(llm, auto_logprobs)


def test_twice_the_blocks_of_bf16_in_the_same_memory(llama_dir):
    blocks = {
        value: num_blocks_for(
            EngineArgs(str(llama_dir), dtype="bfloat16", kv_cache_dtype=value).create_config(), 1 << 24
        )
        for value in ("auto", "fp8")
    }
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_scales_from_the_checkpoint(llama_dir, auto_logprobs, tmp_path):
    """llm-compressor's, ModelOpt's and the older single names; a compressed-tensors kv_cache_scheme alone in the
    config. Scales far from 1 still agree with the unquantized cache: they are applied on the way in and out."""
    path = tmp_path / "fp8kv"
    shutil.copytree(llama_dir, path)
    save_file(
        {
            "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.02),
            "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([0.01]),
            "model.layers.1.self_attn.kv_scale": torch.tensor(4.0),
        },
        path / "kv_scales.safetensors",
    )
    fp8 = LLM(str(path), num_kv_blocks=64, kv_cache_dtype="fp8")
    layers = fp8.engine.runner.model.model.layers
    assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in layers] == [
        (pytest.approx(0.02), pytest.approx(0.01)),
        (4.0, 4.0),
    ]
    _assert_within_bound(fp8, auto_logprobs)
    auto = LLM(str(path), num_kv_blocks=64)  # a cache in the model's dtype skips them
    assert (
        auto.engine.runner.model.model.layers[1].self_attn.attn.k_scale,
        auto.engine.runner.kv_cache[0][0].dtype,
    ) == (1.0, torch.float32)

    save_file(
        {"model.layers.0.self_attn.k_scale": torch.tensor(2.0), "model.layers.0.self_attn.v_scale": torch.tensor(3.0)},
        path / "kv_scales.safetensors",
    )
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
    }
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), num_kv_blocks=16, kv_cache_dtype="fp8")
    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    assert (attn.k_scale, attn.v_scale, llm.engine.config.quantization) == (2.0, 3.0, None)


def test_long_context_and_the_cpu_tier_hold_fp8(llama_dir):
    """A prompt four times the GPU pool: its older blocks go to an fp8 CPU pool (half the bytes) and come back through
    the ring, giving the tokens of an fp8 run whose pool holds it."""
    prompt = torch.randint(2, 384, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(llama_dir), num_kv_blocks=64, kv_cache_dtype="fp8").generate([prompt], params, use_tqdm=False)
    llm = LLM(str(llama_dir), num_kv_blocks=6, kv_offload_gb=0.01, kv_cache_dtype="fp8")
    got = llm.generate([prompt], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.runner.offloader.cpu.dtype == torch.float8_e4m3fn
    assert llm.engine.block_manager.cpu.allocated > 0


def test_refused(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="^kv_cache_dtype: must be auto, fp8 or fp8_e4m3, got 'fp8_e5m2'"):
        LLM(str(llama_dir), kv_cache_dtype="fp8_e5m2")
    path = tmp_path / "per_head"
    shutil.copytree(llama_dir, path)
    save_file({"model.layers.0.self_attn.k_scale": torch.ones(2)}, path / "kv_scales.safetensors")
    with pytest.raises(
        ValueError, match="'model.layers.0.self_attn.k_scale' has shape \\(2,\\): only one KV cache scale per layer"
    ):
        LLM(str(path), num_kv_blocks=16, kv_cache_dtype="fp8")


def test_refused_on_gpus_without_fp8(monkeypatch):
    """Compute capability under 8.9 (an A100's 8.0) has no fp8 conversions: refused at start, as a GPU would see it."""
    from pathlib import Path

    from nanoserve import config

    monkeypatch.setattr(config, "resolve_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    model = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-0.6b"
    with pytest.raises(ValueError, match="^kv_cache_dtype: 'fp8' needs a GPU of compute capability 8.9 or later"):
        EngineArgs(str(model), load_format="dummy", kv_cache_dtype="fp8").create_config()
    assert EngineArgs(str(model), load_format="dummy").create_config().kv_dtype == torch.bfloat16
