"""On a GPU: draft-model speculative decoding with the Triton kernels and CUDA graphs (the target's, and the draft's
decode graphs) gives the greedy tokens of plain decoding (fp32, so kernels' rounding cannot flip a near tie); with the
target as its own draft nearly every draft is accepted, which a wrong draft step (a graph reading the wrong pool or
rows) would not allow."""

import pytest
import torch
from checkpoints import write_checkpoint

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-gpu")
    target = write_checkpoint(
        root / "target",
        "llama",
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_hidden_layers=3,
        initializer_range=0.06,
    )
    draft = write_checkpoint(
        root / "draft",
        "qwen2",
        seed=1,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
    )
    return target, draft


def prompts() -> list[list[int]]:
    """32 prompts of mixed lengths, every other one after a shared system prompt."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, 384, (48,), generator=g).tolist()
    return [
        (system if i % 2 else []) + torch.randint(2, 384, (n,), generator=g).tolist()
        for i, n in enumerate(torch.randint(4, 160, (32,), generator=g).tolist())
    ]


def run(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    return run(LLM(str(dirs[0]), device="cuda", dtype="float32", num_kv_blocks=4096))


@pytest.mark.parametrize("which", [0, 1])  # 0: the target as its own draft; 1: a smaller Qwen2 draft
def test_greedy_tokens_unchanged_under_graphs(dirs, reference, which):
    spec = LLM(
        str(dirs[0]),
        device="cuda",
        dtype="float32",
        num_kv_blocks=60,
        max_num_batched_tokens=512,
        speculative_config={"model": str(dirs[which]), "num_speculative_tokens": K},
    )
    draft = spec.engine.proposer.runner
    assert draft.graphs is not None
    replays = {"n": 0}
    original = draft.graphs.run

    def counted(*args):
        replays["n"] += 1
        return original(*args)

    draft.graphs.run = counted
    assert run(spec) == reference
    stats = spec.engine.spec_stats
    assert stats.num_draft_tokens > 0 and replays["n"] > 0
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.block_manager.prefix_hits > 0
    if which == 0:
        assert stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens, stats
        assert stats.mean_acceptance_length > K
