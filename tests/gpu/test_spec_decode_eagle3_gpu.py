"""On a GPU: EAGLE-3 speculative decoding with the Triton kernels and CUDA graphs (the target's, which write the
hidden states the head reads, and the head's decode graphs, which read its input buffer) gives the greedy tokens of
plain decoding (fp32), and the head's drafts are the PyTorch reference's (tests/eagle3_reference.py) but for a rare
near tie: a graph reading the wrong rows, or stale hidden states, would match almost none."""

import pytest
import torch
from call_counts import count_calls
from checkpoints import write_checkpoint, write_eagle3_head
from eagle3_reference import ReferenceHead

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

K = 4
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-gpu")
    target = write_checkpoint(
        root / "target", "llama", head_dim=64, num_hidden_layers=4, initializer_range=0.06, **SHAPE
    )
    return target, write_eagle3_head(root / "head", seed=1, **SHAPE)


def prompts() -> list[list[int]]:
    """32 prompts of mixed lengths, every other one after a shared system prompt."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(2, 384, (48,), generator=g).tolist()
    return [
        (system if i % 2 else []) + torch.randint(2, 384, (n,), generator=g).tolist()
        for i, n in enumerate(torch.randint(4, 160, (32,), generator=g).tolist())
    ]


def run(llm: LLM, which=None) -> list[list[int]]:
    chosen = prompts() if which is None else [prompts()[i] for i in which]
    return [o.outputs[0].token_ids for o in llm.generate(chosen, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    return run(LLM(str(dirs[0]), device="cuda", dtype="float32", num_kv_blocks=4096))


def spec_llm(dirs, **kw) -> LLM:
    spec = LLM(
        str(dirs[0]),
        device="cuda",
        dtype="float32",
        speculative_config={"method": "eagle3", "model": str(dirs[1]), "num_speculative_tokens": K},
        **kw,
    )
    assert spec.engine.runner.graphs is not None and spec.engine.proposer.runner.graphs is not None
    return spec


def count_replays(runner) -> dict:
    replays, original = {"n": 0}, runner.graphs.run

    def counted(*args):
        replays["n"] += 1
        return original(*args)

    runner.graphs.run = counted
    return replays


def test_greedy_tokens_unchanged_under_graphs(dirs, reference):
    spec = spec_llm(dirs, num_kv_blocks=60, max_num_batched_tokens=512)
    replays = count_replays(spec.engine.proposer.runner)
    assert run(spec) == reference
    stats = spec.engine.spec_stats
    assert stats.num_draft_tokens > 0 and replays["n"] > 0
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.block_manager.prefix_hits > 0


def test_drafts_under_graphs_are_the_references(dirs, reference):
    """The engine verifies the true continuation with its last token wrong (a random head's drafts are all
    rejected), so verify steps accept all but one and the head catches up on several positions; the head's own
    drafts, from its graphs, are compared with the reference's."""
    spec = spec_llm(dirs, num_kv_blocks=4096)
    replays = count_replays(spec.engine.proposer.runner)
    catch_ups = {"n": 0}  # the head's catch-ups on several positions replay its prefill graphs
    count_calls(spec.engine.proposer.runner.prefill_graphs, "run", catch_ups, "n")
    which = [0, 1, 2, 3, 5]  # 1, 3 and 5 share a system prompt: prefix hits
    futures = {tuple(prompts()[i]): prompts()[i] + reference[i] for i in which}
    proposer, seen = spec.engine.proposer, []
    propose = proposer.propose

    def oracle(rows, caps):
        out = propose(rows, caps)
        given = []
        for row, drafts in zip(rows, out, strict=True):
            tokens = list(row.token_ids)
            seen.append((tokens, drafts))
            future = next(f for p, f in futures.items() if tokens[: len(p)] == list(p))
            true = future[len(tokens) : len(tokens) + len(drafts)]
            given.append(true[:-1] + [(true[-1] + 1) % 384] if true else true)
        return given

    proposer.propose = oracle
    for i in which:  # one at a time: the later ones find the system prompt cached
        assert run(spec, [i]) == [reference[i]]
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and replays["n"] > 0 and catch_ups["n"] > 0
    assert spec.engine.block_manager.prefix_hits > 0
    ref = ReferenceHead(dirs[1], dirs[0])
    matches = sum(drafts == ref.drafts(tokens, len(drafts)) for tokens, drafts in seen)
    assert matches >= 0.9 * len(seen), (matches, len(seen))
