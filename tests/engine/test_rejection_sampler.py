"""Rejection sampling keeps the target's distribution (chi-square, fixed seeds: deterministic); n-gram lookup; the
speculative config's checks."""

from types import SimpleNamespace

import pytest
import torch

from nanoserve.layers.sampler import Sampler
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.ngram import NgramProposer, ngram_lookup
from nanoserve.spec_decode.rejection import queue_verify, rejection_sample, verify

VOCAB = 6
# The 99.9 % quantile of chi-square with VOCAB - 1 = 5 degrees of freedom.
CHI2_999 = 20.52


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * len(tokens)
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def target() -> torch.Tensor:
    return torch.softmax(torch.randn(VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5, 0)


@pytest.mark.parametrize("draft", [0, 1, 2, 3, -1])  # every token drafted in turn; -1: a bonus row
def test_rejection_sampling_keeps_the_target_distribution(draft):
    p = target()
    n = 100_000
    g = torch.Generator().manual_seed(draft + 10)
    probs = p.repeat(n, 1)
    drafts = torch.full((n,), draft)
    accepted, replacement = rejection_sample(probs, drafts, torch.rand(n, generator=g, dtype=torch.float64),
                                             torch.empty_like(probs).exponential_(generator=g))
    emitted = torch.where(accepted, drafts, replacement)
    assert chi_square(emitted, p) < CHI2_999
    if draft >= 0:  # accepted as often as its probability says
        assert abs(accepted.double().mean().item() - p[draft].item()) < 5 * (p[draft] * (1 - p[draft]) / n) ** 0.5
        assert not (replacement[~accepted] == draft).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_with_a_draft_distribution_keeps_the_target(seed):
    """Drafts drawn from a real q (a draft model's): accepted with min(1, p/q), else redrawn from max(p - q, 0); the
    emitted tokens follow p, and drafts are accepted at the rate sum(min(p, q)). q = 0 on a token p favours, and
    q > 0 on one p excludes, so both sides of the rule are exercised."""
    p = target()
    g = torch.Generator().manual_seed(seed + 20)
    q = torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, 0)
    q[int(p.argmax())] = 0
    p = p.clone()
    p[int(q.argmax())] = 0
    p, q = p / p.sum(), q / q.sum()
    n = 100_000
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    accepted, replacement = rejection_sample(p.repeat(n, 1), drafts, torch.rand(n, generator=g, dtype=torch.float64),
                                             torch.empty(n, VOCAB, dtype=torch.float64).exponential_(generator=g),
                                             q.repeat(n, 1))
    emitted = torch.where(accepted, drafts, replacement)
    assert chi_square(emitted, p) < CHI2_999
    rate = torch.minimum(p, q).sum().item()
    assert abs(accepted.double().mean().item() - rate) < 5 * (rate * (1 - rate) / n) ** 0.5
    assert not accepted[drafts == int(q.argmax())].any()  # p = 0 there: never accepted
    # A bonus row (no draft, q = 0) draws from p itself.
    bonus_accepted, bonus = rejection_sample(p.repeat(n, 1), torch.full((n,), -1), torch.rand(n, generator=g),
                                             torch.empty(n, VOCAB, dtype=torch.float64).exponential_(generator=g),
                                             torch.zeros(n, VOCAB, dtype=torch.float64))
    assert not bonus_accepted.any() and chi_square(bonus, p) < CHI2_999


def fake_seq(params: SamplingParams, seed: int | None = None, output=()):
    return SimpleNamespace(params=params, token_ids=[2, 3, *output], output_token_ids=list(output),
                           num_output_tokens=len(output),
                           generator=torch.Generator().manual_seed(seed) if seed is not None else None)


def test_verify_samples_each_position_from_the_filtered_target():
    """Through the sampler's own filters (temperature, top-k), both verified positions and the bonus: the first
    emitted token follows row 0's filtered distribution, the second (when the first draft is accepted) row 1's."""
    sampler = Sampler(torch.device("cpu"), eos_token_ids=[0], seed=3)
    params = SamplingParams(temperature=0.7, top_k=4)
    n = 20_000
    base = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    draft = int(base[0].argmax())  # likely accepted, so the second position is reached often
    out = verify(sampler, base.repeat(n, 1), [fake_seq(params) for _ in range(n)], [[draft]] * n)
    firsts, seconds, at = [], [], 0
    for count in out.counts:
        firsts.append(out.token_ids[at])
        if count == 2:
            seconds.append(out.token_ids[at + 1])
        at += count
    rows = [fake_seq(params), fake_seq(params)]
    expected = sampler.filtered_probs(sampler.processed(base, rows, [params] * 2, None, {})[0], [0.7] * 2, [4] * 2,
                                      [1.0] * 2, [0.0] * 2).double()
    assert chi_square(torch.tensor(firsts), expected[0]) < CHI2_999
    assert chi_square(torch.tensor(seconds), expected[1]) < CHI2_999
    assert all(t == draft for t, c in zip(firsts, out.counts, strict=True) if c == 2)


def test_verify_with_draft_distributions_samples_from_the_filtered_target():
    """A draft model's drafts come with q: through the sampler's filters, the first emitted token follows row 0's
    filtered distribution whatever q is, and the acceptance rate is sum(min(p, q))."""
    sampler = Sampler(torch.device("cpu"), eos_token_ids=[0], seed=5)
    params = SamplingParams(temperature=0.7, top_k=4)
    n = 20_000
    g = torch.Generator().manual_seed(6)
    base = torch.randn(2, VOCAB, generator=g) * 2
    q = torch.softmax(torch.randn(VOCAB, generator=g), 0)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    out = verify(sampler, base.repeat(n, 1), [fake_seq(params) for _ in range(n)], [[d] for d in drafts], None,
                 [q[None]] * n)
    firsts = torch.tensor([out.token_ids[a] for a in out.offsets[:-1]])
    rows = [fake_seq(params), fake_seq(params)]
    expected = sampler.filtered_probs(sampler.processed(base, rows, [params] * 2, None, {})[0], [0.7] * 2, [4] * 2,
                                      [1.0] * 2, [0.0] * 2).double()
    assert chi_square(firsts, expected[0]) < CHI2_999
    rate = torch.minimum(expected[0], q.double()).sum().item()
    accepted = sum(c == 2 for c in out.counts) / n
    assert abs(accepted - rate) < 5 * (rate * (1 - rate) / n) ** 0.5


def test_verify_greedy_accepts_while_drafts_are_the_argmax():
    sampler = Sampler(torch.device("cpu"), eos_token_ids=[0], seed=0)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(4))
    best = logits.argmax(-1).tolist()
    wrong = (best[5] + 1) % VOCAB
    greedy = SamplingParams(temperature=0)
    # Sequence 0: 3 drafts, all right, bonus from row 3. Sequence 1: the 2nd of 2 drafts wrong. Sequence 2: none.
    out = verify(sampler, logits, [fake_seq(greedy)] * 3, [best[0:3], [best[4], wrong], []])
    assert out.counts == [4, 2, 1]
    assert out.token_ids == best[0:4] + [best[4], best[5], best[7]]


def test_verify_greedy_fast_path_matches_the_general_path():
    """An all-greedy batch is checked on the host (_verify_greedy); asking for logprobs takes the general path on the
    device. Random drafts, a few of them the argmax: both emit the same tokens."""
    g = torch.Generator().manual_seed(5)
    drafts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 3, 1, 0, 2, 3)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=g)
    best = logits.argmax(-1).tolist()
    drafts[0] = best[0:2] + [(best[2] + 1) % VOCAB]  # the third draft rejected
    drafts[1] = best[4:7]  # all accepted
    outs = [verify(Sampler(torch.device("cpu"), eos_token_ids=[0], seed=0), logits,
                   [fake_seq(SamplingParams(temperature=0, logprobs=n)) for _ in drafts], drafts)
            for n in (None, 0)]
    assert outs[0].offsets == outs[1].offsets and outs[0].counts[:2] == [3, 4]
    assert outs[0].token_ids == outs[1].token_ids


def test_queued_verify_gives_accepted_counts_and_row_tokens_on_the_device():
    """What an early proposal drafts from before the host reads the step: each sequence's accepted count, and at its
    rows the tokens it emits (accepted drafts, then the token after them), on both paths."""
    g = torch.Generator().manual_seed(7)
    drafts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 3, 1, 0, 2)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), VOCAB, generator=g)
    best = logits.argmax(-1).tolist()
    drafts[0] = best[0:2] + [(best[2] + 1) % VOCAB]
    drafts[1] = best[4:7]
    for logprobs in (None, 0):  # the host's greedy check, the device's general path
        step = queue_verify(Sampler(torch.device("cpu"), eos_token_ids=[0], seed=0), logits,
                            [fake_seq(SamplingParams(temperature=0, logprobs=logprobs)) for _ in drafts], drafts)
        out = step.result()
        assert step.num_accepted().tolist() == [c - 1 for c in out.counts]
        rows = step.row_tokens.tolist()
        for i, start in enumerate(step.first_row):
            assert rows[start:start + out.counts[i]] == out.token_ids[out.offsets[i]:out.offsets[i + 1]]


def test_ngram_lookup():
    t = torch.tensor([1, 2, 3, 4, 5, 9, 1, 2, 3]).numpy()
    assert ngram_lookup(t, 3, 1, 2) == [4, 5]  # the 3-gram (1, 2, 3) matched
    assert ngram_lookup(t, 3, 1, 9) == [4, 5, 9, 1, 2, 3]  # to the end, no further
    assert ngram_lookup(torch.tensor([7, 7, 7, 7, 7]).numpy(), 2, 1, 3) == [7, 7, 7]  # a repeat: a full draft
    assert ngram_lookup(torch.tensor([1, 2, 8]).numpy(), 3, 1, 2) == []
    assert ngram_lookup(torch.tensor([4, 8, 1, 2, 8, 4, 8]).numpy(), 2, 2, 1) == [1]  # not the 1-gram's later hit


def test_ngram_proposer_keeps_each_sequence_in_step():
    """The proposer grows its copy of a sequence's tokens as they come: it drafts as a fresh lookup would."""
    proposer = NgramProposer(3, 3, 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (10,), generator=g).tolist()
    for step in range(60):
        drafts = proposer.propose([SimpleNamespace(seq_id=7, token_ids=ids)], [2 if step % 5 == 0 else 3])[0]
        assert drafts == ngram_lookup(torch.tensor(ids).numpy(), 3, 1, 2 if step % 5 == 0 else 3)
        ids = ids + torch.randint(0, 5, (1 + step % 3,), generator=g).tolist()
    proposer.release(7)
    assert proposer.tokens == {}


@pytest.mark.parametrize("raw, message", [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, "'eagle' is not supported yet"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "model: a draft model's directory is required"),
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max: only for method 'ngram'"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model: a draft model's directory is required"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "'medusa' is not supported yet"),
    ({"method": "ngrams", "num_speculative_tokens": 3}, "method: must be 'ngram', 'draft_model' or 'eagle3'"),
    ({"method": "ngram"}, "num_speculative_tokens: required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: must be in"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens: must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}, "prompt_lookup_min: must be >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
     "prompt_lookup_max: must be >= prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "unknown key 'lookahead'"),
    ("ngram", "must be a dict"),
])
def test_config_refusals_name_the_key(raw, message):
    with pytest.raises(ValueError, match="speculative_config") as info:
        SpeculativeConfig.from_dict(raw)
    assert message in str(info.value)


def test_config_defaults_follow_vllm():
    both = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (both.prompt_lookup_max, both.prompt_lookup_min) == (5, 5)
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_max, one.prompt_lookup_min) == (4, 4)


def test_command_line_flag_takes_json():
    import argparse

    from nanoserve.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser, serving=False)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_args_from(ns).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[3]"])
