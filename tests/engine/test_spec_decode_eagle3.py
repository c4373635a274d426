"""EAGLE-3 speculative decoding: the head's drafts are those of a plain PyTorch reference of its forward
(tests/eagle3_reference.py, over the target's hidden states from transformers), and greedy tokens equal plain
decoding's through prefix hits, chunked prefill, preemption and n > 1; the head's refusals."""

import pytest
import torch
from checkpoints import write_checkpoint, write_eagle3_head
from eagle3_reference import ReferenceHead

from nanoserve import LLM, SamplingParams
from nanoserve.worker import eagle3 as eagle3_module

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
K = 3


def prompts() -> list[list[int]]:
    """Mixed lengths, the first two sharing a 40-token prefix (prefix hits)."""
    g = torch.Generator().manual_seed(6)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [
        system + torch.randint(2, 384, (5,), generator=g).tolist(),
        system + torch.randint(2, 384, (19,), generator=g).tolist(),
        torch.randint(2, 384, (27,), generator=g).tolist(),
    ]


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    # Four layers: the head reads the hidden states entering layers 2, 2 and 1 (2, L // 2, L - 3).
    target = write_checkpoint(root / "target", "llama", num_hidden_layers=4, initializer_range=0.06)
    return target, write_eagle3_head(root / "head", seed=1)


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    return run(LLM(str(dirs[0]), enable_prefix_caching=False, num_kv_blocks=64), prompts())


def eagle3(head, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def test_drafts_equal_the_reference_heads(dirs, reference, monkeypatch):
    """Every proposal of a greedy run (the first after the prompt, the later ones after verify steps) is what the
    reference drafts from the same tokens. The engine is handed the true continuation with its last token wrong in
    place of the head's drafts (a random head's are all rejected), so that verify steps accept all but one: the head
    catches up on several positions of a verify step's hidden states, and the rejected position's are written over.
    Its drafts must not depend on which drafts the engine verified. Each sample's hidden states are copied into one
    tensor at every step (as a sample never proposed for has them after 64 steps)."""
    monkeypatch.setattr(eagle3_module, "_MAX_PIECES", 1)
    spec = LLM(str(dirs[0]), num_kv_blocks=64, speculative_config=eagle3(dirs[1]))
    proposer, seen = spec.engine.proposer, []
    propose = proposer.propose
    future = prompts()[2] + reference[2]

    def oracle(rows, caps):
        out = propose(rows, caps)
        seen.extend((list(r.token_ids), d) for r, d in zip(rows, out, strict=True))
        true = [future[len(r.token_ids) : len(r.token_ids) + len(d)] for r, d in zip(rows, out, strict=True)]
        return [t[:-1] + [(t[-1] + 1) % 384] if t else t for t in true]

    proposer.propose = oracle
    assert run(spec, prompts()[2:]) == reference[2:]
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(seen) >= 3
    ref = ReferenceHead(dirs[1], dirs[0])
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts))


def test_greedy_through_prefix_hits_chunks_preemption_and_n(dirs, reference):
    # 9 blocks of 16 hold about two of these sequences; 24 tokens a step chunk the prompts and cap the drafts.
    spec = LLM(str(dirs[0]), num_kv_blocks=9, max_num_batched_tokens=24, speculative_config=eagle3(dirs[1]))
    assert run(spec, prompts()) == reference
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.proposer.tables == {} and engine.proposer.hidden == {}  # all given back
    assert len(engine.proposer.free) == 9
    out = spec.generate(
        prompts()[2], SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3


def test_refusals(dirs, tmp_path):
    narrow = write_eagle3_head(tmp_path / "narrow", hidden_size=32)
    with pytest.raises(ValueError, match="the EAGLE-3 head's hidden_size 32 differs from the target's 64"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(narrow))
    wide = write_eagle3_head(tmp_path / "wide", vocab_size=400)
    with pytest.raises(ValueError, match="the EAGLE-3 head's vocab_size 400 differs from the target's 384"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(wide))
    with pytest.raises(ValueError, match="'LlamaForCausalLM' is not an EAGLE-3 head"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(dirs[0]))
    # vLLM's reading: id j is the hidden state entering layer j, so a 4-layer target has ids 0..3.
    late = write_eagle3_head(tmp_path / "late", eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids must be three layers .* got \[1, 2, 4\]"):
        LLM(str(dirs[0]), num_kv_blocks=16, speculative_config=eagle3(late))
    with pytest.raises(ValueError, match="kv_offload_gb"):
        LLM(str(dirs[0]), kv_offload_gb=1, speculative_config=eagle3(dirs[1]))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(str(dirs[0]), tensor_parallel_size=2, speculative_config=eagle3(dirs[1]))
    with pytest.raises(ValueError, match="speculative_config.model: a draft model's directory is required"):
        LLM(str(dirs[0]), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
