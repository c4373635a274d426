"""The GPU MoE tests' reference engine and workload (tests/gpu/test_moe_gpu.py, test_mxfp4_gpu.py,
test_fp8_moe_gpu.py, test_w4_moe_gpu.py): the eager PyTorch path, attention and experts both (a quantized layer's
reference path dequantizes its weights), against which the Triton kernels in CUDA graphs must give the same greedy
tokens."""

from prompts import mixed_prompts

from nanoserve import LLM, SamplingParams
from nanoserve.layers.attention import TorchBackend
from nanoserve.layers.moe import FusedMoE


def run(llm: LLM, num: int = 64) -> list[list[int]]:
    """Greedy tokens of mixed-length prompts that share prefixes (tests/prompts.py)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(mixed_prompts(384, 48, 200, num=num), params,
                                                         use_tqdm=False)]


def eager_torch(ckpt, dtype: str = "float32") -> LLM:
    llm = LLM(str(ckpt), device="cuda", dtype=dtype, enforce_eager=True, num_kv_blocks=4096)
    for layer in llm.engine.runner.attn_layers:
        layer.backend = TorchBackend
    for module in llm.engine.runner.model.modules():
        if isinstance(module, FusedMoE):
            module.use_kernel = False
    return llm


def check_kept_experts(ckpt, monkeypatch) -> tuple[FusedMoE, list[list[int]]]:
    """A checkpoint whose experts the engine keeps quantized (FP8, MXFP4, W4): its kernels in CUDA graphs give
    eager_torch's greedy tokens through preemption and prefix hits, and a sequence alone decodes through the GEMVs,
    handed the scales. Returns the first layer's experts (for the format's own checks) and the reference tokens."""
    from nanoserve.kernels import moe_gemv

    calls = []
    original = moe_gemv.moe_gemv
    monkeypatch.setattr(moe_gemv, "moe_gemv", lambda *a, **kw: calls.append(kw["w13_scale"]) or original(*a, **kw))
    reference = eager_torch(ckpt)
    fast = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=60, max_num_batched_tokens=512)
    want = run(reference)
    assert run(fast) == want
    assert fast.engine.scheduler.num_preemptions > 0 and fast.engine.block_manager.prefix_hits > 0
    assert run(fast, num=1) == run(reference, num=1)
    assert calls and all(scale is not None for scale in calls)
    return fast.engine.runner.model.model.layers[0].mlp.experts, want
