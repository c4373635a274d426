"""FP8 under tensor parallelism on the CPU (gloo): each rank reads its share of the fp8 weights and of their scales
(blocks of rows of the stacked q/k/v and gate/up shards, blocks of columns of o_proj and down_proj; per-channel
scales quantized at load take each row's largest magnitude over all ranks): a block checkpoint at TP=2 generates
TP=1's tokens, which are transformers' on the same quantization (test_fp8_models.py). One TP engine per test, as
they are slow to start."""


import pytest
import torch
from fp8_checkpoints import Format, write_fp8_checkpoint

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = dict(num_kv_blocks=32, max_num_batched_tokens=32)  # 32-token steps: prompts prefill in chunks
LOGITS_BOUND = 0.2


# On 2 cores, ranks each running torch's default thread count oversubscribe them (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_thread_per_rank")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 384, (n,), generator=g).tolist() for n in (3, 20, 45)]


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def test_block_checkpoint_two_ranks_equal_one(tmp_path, checkpoints):
    """qwen3: 2 kv heads of 32 rows, one a rank; o_proj's 128 columns, 64 a rank; blocks of 16 x 32."""
    model = str(write_fp8_checkpoint(checkpoints["qwen3"], tmp_path / "q",
                                     Format("block", "group", (16, 32), layout="fp8")))
    want = generate(LLM(model, **ENGINE))
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    try:
        assert generate(llm) == want
    finally:
        llm.shutdown()


def first_logits(llm: LLM, monkeypatch) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    compute_logits = llm.engine.runner.model.compute_logits
    monkeypatch.setattr(llm.engine.runner.model, "compute_logits",
                        lambda h: seen.append(compute_logits(h)) or seen[-1])
    llm.generate(prompts()[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return seen[0]


def test_quantized_at_load_two_ranks(checkpoints, monkeypatch):
    """Each o_proj and down_proj row's weight scale is its largest magnitude over all ranks' columns: rank 0 holds
    TP=1's fp8 columns and scales. Tokens are not compared: a row-parallel layer's input is quantized per token over
    its rank's columns (the scale of each rank's share of the row, as vLLM does; one more all-reduce a layer to share
    the row's amax would cost more than it gains at batch 1), a finer quantization than TP=1's, so the logits agree
    only within LOGITS_BOUND (these random models magnify every change; measured 0.08-0.1)."""
    one = LLM(str(checkpoints["llama"]), quantization="fp8", **ENGINE)
    two = LLM(str(checkpoints["llama"]), quantization="fp8", tensor_parallel_size=2, **ENGINE)
    try:
        for name in ("o_proj", "down_proj"):
            for layer in range(2):
                path = f"model.layers.{layer}.{'self_attn' if name == 'o_proj' else 'mlp'}.{name}"
                whole, share = one.engine.runner.model.get_submodule(path), two.engine.runner.model.get_submodule(path)
                assert torch.equal(share.weight_scale, whole.weight_scale)
                columns = share.weight.shape[1]
                assert torch.equal(share.weight.view(torch.uint8), whole.weight[:, :columns].view(torch.uint8))
        want, got = first_logits(one, monkeypatch), first_logits(two, monkeypatch)
        assert (got - want).norm() / want.norm() < LOGITS_BOUND
    finally:
        two.shutdown()
