"""The Gumbel-max sampling kernel against its PyTorch reference, its draws against softmax(logits / T),
and the Sampler's choice of it."""

from types import SimpleNamespace

import pytest
import torch

from nanoserve.kernels.sampling import gumbel_max_sample, gumbel_max_sample_ref, gumbel_noise_ref
from nanoserve.layers.sampler import Sampler
from nanoserve.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [50, 4096, 10_001])
def test_kernel_matches_reference(device, gen, dtype, vocab):
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(device, dtype)
    temps = torch.tensor([0.0, 0.6, 1.0, 1.7, 0.0, 0.3], device=device)
    for key in (0, 7, 0xFFFFFFFF, 123456789):
        tokens = gumbel_max_sample(logits, temps, key)
        torch.testing.assert_close(tokens, gumbel_max_sample_ref(logits, temps, key))
    # Temperature 0 is the argmax, and the noise changes with the key.
    greedy = logits.float().argmax(dim=1)
    assert tokens[0] == greedy[0] and tokens[4] == greedy[4]
    assert not torch.equal(gumbel_noise_ref(2, vocab, 1), gumbel_noise_ref(2, vocab, 2))


def test_ties_go_to_the_first_column(device):
    logits = torch.zeros(2, 9000, device=device)
    logits[:, [5, 4100, 8999]] = 1.0  # maxima in three different parts
    assert gumbel_max_sample(logits, torch.zeros(2, device=device), 0).tolist() == [5, 5]


def test_draws_follow_softmax_over_temperature():
    """The reference's noise (which the kernel reproduces exactly) gives the right distribution."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temp = 0.7
    counts = torch.zeros(6)
    draws = 6000
    for key in range(draws):
        counts[gumbel_max_sample_ref(logits, torch.tensor([temp]), key)] += 1
    expected = torch.softmax(logits[0] / temp, dim=0)
    # Binomial standard error is at most ~0.0065 at 6,000 draws: 4 sigma.
    torch.testing.assert_close(counts / draws, expected, atol=0.026, rtol=0)


def _seq(params: SamplingParams, seed: int | None = None, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    return SimpleNamespace(params=params, token_ids=[1, 2], output_token_ids=[], num_output_tokens=0,
                           generator=gen)


def test_sampler_takes_the_kernel_only_for_plain_batches(device, monkeypatch):
    sampler = Sampler(torch.device(device), eos_token_ids=[0], seed=0)
    sampler.fused = True  # as on CUDA
    calls = []
    monkeypatch.setattr(sampler, "_sample_fused", lambda *a: calls.append(a) or Sampler._sample_fused(sampler, *a))
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(device) * 3
    plain = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
    out = sampler(logits, [_seq(p) for p in plain])
    assert len(calls) == 1 and out.token_ids[1] == logits[1].argmax().item()
    for special in (SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=3),
                    SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=1.0, presence_penalty=1)):
        sampler(logits, [_seq(plain[0]), _seq(special), _seq(plain[1])])
        assert len(calls) == 1, special
    sampler(logits[:2], [_seq(plain[0]), _seq(SamplingParams(temperature=1.0, seed=3), seed=3, device=device)])
    assert len(calls) == 1


def test_sampler_kernel_path_keeps_logprobs_and_min_tokens(device):
    sampler = Sampler(torch.device(device), eos_token_ids=[0], seed=0)
    sampler.fused = True
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(2)).to(device)
    logits[:, 0] = 50.0  # EOS would win every draw
    before = logits.clone()
    p = SamplingParams(temperature=1.0, min_tokens=2, logprobs=2)
    out = sampler(logits, [_seq(p), _seq(SamplingParams(temperature=0, logprobs=1))])
    assert out.token_ids[0] != 0 and out.token_ids[1] == 0
    assert torch.equal(logits, before)  # masked on a copy
    top_ids, top_lps, chosen, rank = out.logprobs[0]
    assert top_ids[0] == 0 and len(top_ids) == 2 and rank > 1  # raw logprobs: taken before the mask
    assert out.logprobs[1][3] == 1


@pytest.mark.parametrize("fused", [True, False])
def test_another_rank_draws_the_same_tokens(device, fused):
    """Tensor parallelism: a rank holding the same logits draws rank 0's tokens itself (sample_replica) for the
    batches replicable() admits (on CUDA the fused kernel's, on the CPU greedy ones), with a sampler of its own."""
    rank0, other = (Sampler(torch.device(device), eos_token_ids=[0], seed=5) for _ in range(2))
    rank0.fused = other.fused = fused
    plain = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(temperature=1.3)]
    greedy = [SamplingParams(temperature=0)] * 3
    for step in range(4):
        logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(step)).to(device)
        seqs = [_seq(p) for p in (plain if fused else greedy)]
        assert rank0.replicable(seqs, None)
        call = rank0.num_calls + 1
        want = rank0.sample(logits, seqs).token_ids
        temps = [s.params.temperature for s in seqs] if fused else []
        assert torch.equal(other.sample_replica(logits, temps, call), want)
    if fused:
        assert len(set(want.tolist())) > 1  # not all argmax: the draws did use the noise
    refused = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0, presence_penalty=1.0),
               SamplingParams(temperature=0, logit_bias={3: 1.0}), SamplingParams(temperature=0, min_tokens=2),
               SamplingParams(temperature=0.7, seed=1)]
    for p in refused:
        seed = p.seed
        assert not rank0.replicable([_seq(plain[1]), _seq(p, seed=seed, device=device)], None), p
    assert not rank0.replicable([_seq(plain[1])], masks=object())
    assert rank0.replicable([_seq(plain[0])], None) is fused  # a sampled row needs the fused kernel's key
