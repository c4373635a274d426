"""Sampler: filters never emit a disallowed token, seeds reproduce, penalties follow their definitions."""

from types import SimpleNamespace

import torch

from nanoserve.layers.sampler import Sampler
from nanoserve.sampling_params import SamplingParams

VOCAB = 50


def fake_seq(params: SamplingParams, prompt=(1, 2), output=(), seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    ids = list(prompt) + list(output)
    return SimpleNamespace(params=params, token_ids=ids, output_token_ids=list(output),
                           num_output_tokens=len(output), generator=gen)


def sampler() -> Sampler:
    return Sampler(torch.device("cpu"), eos_token_ids=[0], seed=0)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def allowed_set(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens each filter admits, computed the slow obvious way."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:p.top_k] if p.top_k > 0 else order
    kept = probs[keep] / probs[keep].sum()
    mass, top_p_keep = 0.0, []
    for tok, q in zip(keep, kept.tolist(), strict=True):
        top_p_keep.append(tok)
        mass += q
        if mass >= p.top_p:
            break
    best = probs[top_p_keep].max()
    return {t for t in top_p_keep if probs[t] >= p.min_p * best} | {order[0]}


def test_filters_never_emit_outside_allowed_set():
    s = sampler()
    cases = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=2.0, top_p=0.5),
             SamplingParams(temperature=1.5, min_p=0.2), SamplingParams(temperature=1.0, top_k=10, top_p=0.7),
             SamplingParams(temperature=0.7, top_k=5, min_p=0.3)]
    for trial in range(40):
        logits = random_logits(len(cases), seed=trial)
        seqs = [fake_seq(p) for p in cases]
        tokens = s(logits, seqs).token_ids
        for row, (tok, p) in enumerate(zip(tokens, cases, strict=True)):
            assert tok in allowed_set(logits[row], p), (trial, row, p)


def test_sampling_is_not_degenerate():
    s = sampler()
    logits = random_logits(1).repeat(200, 1) / 6
    tokens = s(logits, [fake_seq(SamplingParams(temperature=1.0)) for _ in range(200)]).token_ids
    assert len(set(tokens)) > 5


def test_greedy_is_argmax():
    s = sampler()
    logits = random_logits(4)
    tokens = s(logits, [fake_seq(SamplingParams(temperature=0)) for _ in range(4)]).token_ids
    assert tokens == logits.argmax(-1).tolist()


def test_seed_reproduces_whatever_the_batch():
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    row = random_logits(1, seed=5)
    alone = [sampler()(row, [fake_seq(p, seed=7)]).token_ids[0] for _ in range(3)]
    batch = torch.cat([random_logits(3, seed=9), row])
    other = SamplingParams(temperature=1.0)
    in_batch = sampler()(batch, [fake_seq(other), fake_seq(other), fake_seq(other), fake_seq(p, seed=7)])
    assert in_batch.token_ids[3] == alone[0] == alone[1] == alone[2]


def test_presence_and_frequency_penalties():
    s = sampler()
    logits = random_logits(1)
    output = [4, 4, 4, 9]
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    out = logits.clone()
    s._apply_penalties(out[0], fake_seq(p, prompt=(7,), output=output))
    expected = logits.clone()
    expected[0, 4] -= 0.5 + 3 * 0.25
    expected[0, 9] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(out, expected)  # prompt token 7 untouched


def test_repetition_penalty_over_prompt_and_output():
    s = sampler()
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    out = logits.clone()
    s._apply_penalties(out[0], fake_seq(p, prompt=(0,), output=(1,)))
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.0, 1.0, -1.0, 0.5]]))


def test_min_tokens_masks_eos_and_stop_ids():
    s = sampler()
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 100.0  # eos
    logits[0, 5] = 90.0  # a stop token id
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    assert s(logits, [fake_seq(p, output=(8,))]).token_ids[0] not in (0, 5)
    assert s(logits, [fake_seq(p, output=(8, 8, 8))]).token_ids[0] == 0


def test_logprobs_are_raw_model_logprobs():
    s = sampler()
    logits = random_logits(1)
    p = SamplingParams(temperature=0, logprobs=3)
    out = s(logits, [fake_seq(p)])
    top_ids, top_values, chosen, rank = out.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert top_ids == ref.topk(3).indices.tolist() and rank == 1
    assert abs(chosen - ref.max().item()) < 1e-6
