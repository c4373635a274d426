"""On a GPU: n-gram speculative decoding with the Triton kernels and CUDA graphs gives the greedy tokens of plain
decoding (fp32, so kernels' rounding cannot flip a near tie), with drafts accepted, prefix hits and preemption; decode
steps without drafts replay decode graphs and verify steps the prefill graphs."""

import pytest
import torch
from call_counts import count_calls
from checkpoints import write_checkpoint

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # initializer_range 0.06: greedy outputs fall into loops, which drafts catch (tests/engine/test_spec_decode.py).
    return write_checkpoint(tmp_path_factory.mktemp("spec-gpu") / "llama", "llama", hidden_size=128,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_hidden_layers=3,
                            initializer_range=0.06)


def prompts() -> list[list[int]]:
    """48 prompts of mixed lengths repeating a stretch of themselves, every other one after a shared system prompt."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, 384, (48,), generator=g).tolist()
    out = []
    for i, n in enumerate(torch.randint(4, 160, (48,), generator=g).tolist()):
        body = (system if i % 2 else []) + torch.randint(2, 384, (n,), generator=g).tolist()
        out.append(body + body[-8:])
    return out


def run(llm: LLM, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


def test_greedy_tokens_unchanged_under_graphs(ckpt):
    reference = run(LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=4096))
    spec = LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=60, max_num_batched_tokens=512,
               speculative_config=NGRAM)
    runner = spec.engine.runner
    assert runner.graphs is not None and runner.prefill_graphs is not None
    replays = {"decode": 0, "prefill": 0}
    count_calls(runner.graphs, "run", replays, "decode")
    count_calls(runner.prefill_graphs, "run", replays, "prefill")
    assert run(spec) == reference
    stats = spec.engine.spec_stats
    assert stats.num_accepted_tokens > 0, stats
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.block_manager.prefix_hits > 0
    assert replays["decode"] > 0 and replays["prefill"] > 0
    assert spec.engine.block_manager.num_free_blocks == 60


def test_bf16_sampling_with_seeds_is_reproducible(ckpt):
    # No prefix cache: the second run computes what the first did, in the same shapes (bf16 GEMMs round by shape).
    spec = LLM(str(ckpt), device="cuda", dtype="bfloat16", num_kv_blocks=4096, enable_prefix_caching=False,
               speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=32, ignore_eos=True)
    first = run(spec, params)
    assert run(spec, params) == first
    assert spec.engine.spec_stats.num_drafts > 0
