"""EAGLE-3 speculative decoding: the head's drafts are those of a plain PyTorch reference of its forward
(tests/eagle3_reference.py, over the target's hidden states from transformers), and greedy tokens equal plain
decoding's through prefix hits, chunked prefill, preemption and n > 1; the head's refusals."""

import pytest
import torch
from checkpoints import write_checkpoint, write_eagle3_head
from eagle3_reference import ReferenceHead
from prompts import three_prompts as prompts

from nanoserve import LLM, SamplingParams
from nanoserve.worker.step_inputs import StepInputs

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
K = 3


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    # Four layers: the head reads the hidden states entering layers 1, 2 and 2 (2, L // 2, L - 3 in layer order).
    target = write_checkpoint(root / "target", "llama", num_hidden_layers=4, initializer_range=0.06)
    return target, write_eagle3_head(root / "head", seed=1)


@pytest.fixture(scope="module")
def reference(dirs) -> list[list[int]]:
    return run(LLM(str(dirs[0]), enable_prefix_caching=False, num_kv_blocks=64), prompts())


def eagle3(head, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def test_drafts_equal_the_reference_heads(dirs, reference):
    """Every proposal of a greedy run (the first after a prompt, the later ones after verify steps) is what the
    reference drafts from the same tokens, prompts whose prefixes are cached included (the head reads the target's
    hidden states there from the pool beside the KV). The engine is handed the true continuation with its last token
    wrong in place of the head's drafts (a random head's are all rejected), so verify steps accept all but one: the
    head catches up on several positions of a verify step's hidden states. Its drafts must not depend on which drafts
    the engine verified."""
    spec = LLM(str(dirs[0]), num_kv_blocks=64, speculative_config=eagle3(dirs[1]))
    # Seeded sampling first: every draw from the request's own generator, and drafts that depend on the tokens alone
    # (not on the batch, nor on the prefix cache, which the first run filled), so the same tokens again.
    params = SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=0.3, seed=3, max_tokens=12, ignore_eos=True)
    first = run(spec, prompts(), params)
    assert run(spec, prompts()[1:2], params) == first[1:2]
    proposer, seen = spec.engine.proposer, []
    propose = proposer.propose
    futures = [p + r for p, r in zip(prompts(), reference, strict=True)]

    def oracle(rows, caps):
        out = propose(rows, caps)
        given = []
        for row, drafts in zip(rows, out, strict=True):
            tokens = list(row.token_ids)
            seen.append((tokens, drafts))
            future = next((f for f in futures if f[: len(tokens)] == tokens), tokens + drafts + [0])
            true = future[len(tokens) : len(tokens) + len(drafts)]
            given.append(true[:-1] + [(true[-1] + 1) % 384] if true else true)
        return given

    proposer.propose = oracle
    take_hidden, copies = proposer.take_hidden, []

    def counting(step, aux):
        copies.extend(step.block_copies)
        take_hidden(step, aux)

    spec.engine.runner.aux_hidden_sink = counting
    hits = spec.engine.block_manager.prefix_hits
    for i in (0, 1, 2):  # one at a time: their prefixes are cached (the second's by the first)
        assert run(spec, prompts()[i : i + 1]) == reference[i : i + 1]
    assert spec.engine.block_manager.prefix_hits > hits
    # n > 1 on a new prompt: the samples' first proposals read its hidden states from the blocks they share (its last,
    # partial one is copied when they write to it). No reference: the engine verifies the head's own drafts.
    fresh = prompts()[2][::-1]
    out = spec.generate(fresh, SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == out[0].outputs[1].token_ids and copies
    stats = spec.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    ref = ReferenceHead(dirs[1], dirs[0])
    assert len(seen) >= 6
    for tokens, drafts in seen:
        assert drafts == ref.drafts(tokens, len(drafts))


def test_a_proposal_builds_host_inputs_once_and_reads_its_drafts_once(dirs, reference, monkeypatch):
    """The host does not wait for the device between a proposal's k head passes: it builds the inputs of the
    catch-up pass alone (each single-token pass's are made on the device from the pass before) and reads the drafted
    tokens back once, at the end. On the CPU nothing waits, so the reads of int64 tensors (token ids) stand in."""
    spec = LLM(str(dirs[0]), num_kv_blocks=64, speculative_config=eagle3(dirs[1]))
    builds, reads, proposals = [], [], []
    build, tolist = StepInputs.build.__func__, torch.Tensor.tolist

    def counting_build(cls, *args, **kwargs):
        builds.append(1)
        return build(cls, *args, **kwargs)

    def counting_tolist(tensor):
        if tensor.dtype == torch.int64:
            reads.append(1)
        return tolist(tensor)

    monkeypatch.setattr(StepInputs, "build", classmethod(counting_build))
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    proposer = spec.engine.proposer
    propose = proposer.propose

    def counted(rows, caps):
        before = len(builds), len(reads)
        out = propose(rows, caps)
        proposals.append((len(builds) - before[0], len(reads) - before[1], max(len(d) for d in out)))
        return out

    proposer.propose = counted
    assert run(spec, prompts()) == reference
    assert any(most == K for _, _, most in proposals)
    assert all((b, r) == (1, 1) for b, r, _ in proposals), proposals


def test_greedy_through_prefix_hits_chunks_preemption_and_n(dirs, reference):
    # 9 blocks of 16 hold about two of these sequences; 24 tokens a step chunk the prompts and cap the drafts.
    spec = LLM(str(dirs[0]), num_kv_blocks=9, max_num_batched_tokens=24, speculative_config=eagle3(dirs[1]))
    assert run(spec, prompts()) == reference
    engine = spec.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0
    assert engine.spec_stats.num_draft_tokens > 0
    assert engine.proposer.tables == {} and engine.proposer.done == {}  # all given back
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
    with pytest.raises(ValueError, match="speculative_config.model: a draft model's directory is required"):
        LLM(str(dirs[0]), speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
