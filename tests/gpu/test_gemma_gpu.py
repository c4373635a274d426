"""On a GPU: Gemma 2 (soft-capped attention and logits, alternating windows) and Gemma 3 (q/k norms with 1 + w, local
rope, 2:1 windows here) through the Triton kernels with CUDA graphs, at head_dim 64, 128 and 256, give the eager
PyTorch path's greedy tokens in fp32 (chunked prefill, prefix hits, preemption, the fused rope decode on and off), and
in bf16 mostly the same first tokens."""

import pytest
import torch
from checkpoints import write_checkpoint
from prompts import mixed_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.layers.attention import TorchBackend, TritonBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {
    64: dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2),
    128: dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
    256: dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1),
}


@pytest.fixture(
    scope="module",
    params=[(arch, d) for arch in ("gemma2", "gemma3") for d in (64, 128, 256)],
    ids=lambda p: f"{p[0]}-d{p[1]}",
)
def ckpt(request, tmp_path_factory):
    arch, head_dim = request.param
    # Windows of 40 on 3 layers (Gemma 2: windowed, global, windowed; Gemma 3: two windowed, one global).
    return write_checkpoint(
        tmp_path_factory.mktemp("gpu") / arch,
        arch,
        head_dim=head_dim,
        num_hidden_layers=3,
        sliding_window=40,
        **SHAPES[head_dim],
    )


def _run(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(384, 48, 200), params, use_tqdm=False)]


def _reference(ckpt, dtype: str) -> list[list[int]]:
    llm = LLM(str(ckpt), device="cuda", dtype=dtype, enforce_eager=True, num_kv_blocks=4096)
    for layer in llm.engine.runner.attn_layers:
        layer.backend = TorchBackend
    return _run(llm)


@pytest.mark.parametrize("fused_rope_decode", ["off", "on"])
def test_fp32_graphs_match_eager_torch(ckpt, fused_rope_decode):
    want = _reference(ckpt, "float32")
    fast = LLM(
        str(ckpt),
        device="cuda",
        dtype="float32",
        num_kv_blocks=60,
        max_num_batched_tokens=512,
        fused_rope_decode=fused_rope_decode,
    )
    assert fast.engine.runner.graphs is not None
    assert all(layer.backend is TritonBackend for layer in fast.engine.runner.attn_layers)
    assert _run(fast) == want
    assert fast.engine.scheduler.num_preemptions > 0 and fast.engine.block_manager.prefix_hits > 0


def test_bf16_graphs_mostly_agree(ckpt):
    # bf16 rounding differs between kernels, so only the first tokens must agree (tests/gpu/test_engine_gpu.py).
    want = _reference(ckpt, "bfloat16")
    got = _run(LLM(str(ckpt), device="cuda", dtype="bfloat16", num_kv_blocks=2048))
    assert sum(x[0] == y[0] for x, y in zip(got, want, strict=True)) >= 60
