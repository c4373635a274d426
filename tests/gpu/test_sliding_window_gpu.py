"""On a GPU: a sliding window and attention sinks through the Triton kernels with CUDA graphs (prefill maps with
key splits, decode splits, the fused decode) give the greedy tokens of the eager PyTorch path, with chunked
prefill, prefix hits and preemption. Sinks are put on a Mistral checkpoint's layers here (gpt-oss has them; its
own tests are the model's). A Gemma 3 checkpoint (windowed and global layers) runs with the window layers' own KV
pool, which frees blocks out of the window, and gives the tokens of one pool."""

import functools
import shutil

import pytest
import torch
from checkpoints import write_checkpoint
from prompts import mixed_prompts
from safetensors.torch import load_file, save_file

from nanoserve import LLM, SamplingParams
from nanoserve.layers.attention import Attention, TorchBackend, TritonBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

WINDOW = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gpu") / "mistral", "mistral", hidden_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=3,
                            sliding_window=WINDOW)


@pytest.fixture(scope="module")
def ckpt_sinks(tmp_path_factory, ckpt):
    """The same checkpoint with a sink logit per head in each layer, under the name the layers load it by."""
    path = tmp_path_factory.mktemp("gpu_sinks") / "mistral"
    shutil.copytree(ckpt, path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for i in range(3):
        # Near the log of a row's key count, so that the sink takes a real share of the weight.
        tensors[f"model.layers.{i}.self_attn.attn.sinks"] = torch.randn(4, generator=g) + 5
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(384, 48, 200), params, use_tqdm=False)]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("fused_rope_decode", ["off", "on"])
def test_window_and_sinks_match_eager_torch(ckpt, ckpt_sinks, sinks, fused_rope_decode, monkeypatch):
    if sinks:
        # Every layer built with sinks, which the checkpoint holds.
        from nanoserve.model import llama

        monkeypatch.setattr(llama, "Attention", functools.partial(Attention, sinks=True))
        ckpt = ckpt_sinks
    reference = LLM(str(ckpt), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=4096)
    for layer in reference.engine.runner.attn_layers:
        layer.backend = TorchBackend
    assert all(layer.sliding_window == WINDOW for layer in reference.engine.runner.attn_layers)
    want = _run(reference)
    del reference
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=60, max_num_batched_tokens=512,
               fused_rope_decode=fused_rope_decode)
    assert fast.engine.runner.graphs is not None
    assert all(layer.backend is TritonBackend for layer in fast.engine.runner.attn_layers)
    assert _run(fast) == want
    assert fast.engine.scheduler.num_preemptions > 0 and fast.engine.block_manager.prefix_hits > 0


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Two windowed layers and one global (the window pool of worker/kv_cache.py), long enough for 1,500 tokens."""
    return write_checkpoint(tmp_path_factory.mktemp("gpu_gemma3") / "gemma3", "gemma3", hidden_size=256,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_hidden_layers=3,
                            sliding_window=WINDOW, max_position_embeddings=2048)


def _run_long(llm: LLM) -> list[list[int]]:
    """The mixed batch and a prompt of 37 windows, whose decode splits and prefill tiles cross many null blocks."""
    g = torch.Generator().manual_seed(9)
    prompts = mixed_prompts(384, 48, 200, num=32) + [torch.randint(2, 384, (1500,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("fused_rope_decode", ["off", "on"])
def test_window_pool_in_graphs_matches_one_pool(gemma3, fused_rope_decode):
    """Out-of-window blocks freed (their table entries on the zeroed null block), through the Triton kernels in CUDA
    graphs with their static local tables: the tokens of one pool on the eager PyTorch path, in fp32."""
    reference = LLM(str(gemma3), device="cuda", dtype="float32", enforce_eager=True, num_kv_blocks=4096,
                    disable_hybrid_kv_cache_manager=True)
    for layer in reference.engine.runner.attn_layers:
        layer.backend = TorchBackend
    want = _run_long(reference)
    del reference
    fast = LLM(str(gemma3), device="cuda", dtype="float32", num_kv_blocks=120, max_num_batched_tokens=512,
               fused_rope_decode=fused_rope_decode)
    runner = fast.engine.runner
    assert runner.kv_groups is not None and runner.graphs is not None and runner.graphs.local is not None
    assert _run_long(fast) == want
    assert fast.engine.scheduler.num_preemptions > 0 and fast.engine.block_manager.prefix_hits > 0
    for layer in runner.attn_layers:
        if layer.local:  # nothing ever wrote the null block
            assert not layer.k_cache[0].any() and not layer.v_cache[0].any()


def test_window_pool_bf16_mostly_agrees(gemma3):
    want = _run_long(LLM(str(gemma3), device="cuda", dtype="bfloat16", num_kv_blocks=4096,
                         disable_hybrid_kv_cache_manager=True))
    got = _run_long(LLM(str(gemma3), device="cuda", dtype="bfloat16", num_kv_blocks=4096))
    # bf16 rounding is the same kernels' on the same values: the first tokens agree (tests/gpu/test_gemma_gpu.py).
    assert sum(x[0] == y[0] for x, y in zip(got, want, strict=True)) >= 31
