"""Speculative decoding (n-gram) changes no token: greedy outputs equal those without it through every engine path,
with drafts accepted (asserted, so no test passes with speculation idle)."""

import pytest
import torch
from checkpoints import write_checkpoint

from nanoserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def repeating_prompts() -> list[list[int]]:
    """Mixed lengths, each repeating a stretch of itself, the first two sharing a 40-token prefix (prefix hits)."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    prompts = []
    for n in (3, 17, 30):
        body = system + torch.randint(2, 384, (n,), generator=g).tolist() if n != 30 else \
            torch.randint(2, 384, (n,), generator=g).tolist()
        prompts.append(body + body[-12:] + body[-12:-6])
    return prompts


def run(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def accepted(llm: LLM) -> int:
    return llm.engine.spec_stats.num_accepted_tokens


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """Random Llama weights at initializer_range 0.06: greedy outputs fall into loops now and then, which the n-gram
    drafts catch (at 0.2 they accept next to nothing), so drafts are accepted, partly and wholly, and rejected."""
    return write_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama", initializer_range=0.06)


@pytest.fixture(scope="module")
def plain(llama_dir) -> LLM:
    return LLM(str(llama_dir), enable_prefix_caching=False, num_kv_blocks=128)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return run(plain, repeating_prompts())


def test_bundled_model_greedy_is_unchanged():
    text = "The quick brown fox jumps over the lazy dog. " * 2
    prompts = [text + "Again: " + text]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = LLM(speculative_config=NGRAM)
    got = run(spec, prompts, params)
    assert accepted(spec) > 0
    assert got == run(LLM(), prompts, params)


def test_n_samples_from_a_prompt_whose_last_chunk_is_one_token():
    # 33 prompt tokens at 32 a step: the second step holds the prompt's last token alone, where the n samples fork.
    # A draft for it used to make the verify entry one sample's rows for two samples (a shape error: engine dead).
    prompt = ([11, 12, 13, 14, 15, 16, 17, 18] * 8)[:33]
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=64, enable_prefix_caching=False)
    spec = LLM(speculative_config=NGRAM, **kwargs)
    got = [c.token_ids for c in spec.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert got == [c.token_ids for c in LLM(**kwargs).generate(prompt, params, use_tqdm=False)[0].outputs]
    assert accepted(spec) > 0


def test_random_checkpoint_through_prefix_hits_chunks_and_preemption(llama_dir, reference):
    # 12 blocks of 16 hold about two of these sequences; 24 tokens a step chunk the prompts and cap the drafts.
    spec = LLM(str(llama_dir), num_kv_blocks=12, max_num_batched_tokens=24, speculative_config=NGRAM)
    assert run(spec, repeating_prompts()) == reference
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.block_manager.prefix_hits > 0
    assert accepted(spec) > 0
    assert spec.engine.block_manager.num_free_blocks == 12  # every lookahead block given back
    assert spec.engine.proposer.tokens == {}  # what it kept of each sequence, dropped when it finished
    again = spec.generate(repeating_prompts()[1], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reference[1]


@pytest.fixture(scope="module")
def spec(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=128, speculative_config=NGRAM)


def test_n_samples_and_penalties(spec, plain, reference):
    prompt = repeating_prompts()[2]
    out = spec.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [reference[2]] * 3
    # A penalty at a drafted position counts the drafts before it.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2,
                            frequency_penalty=0.3, logit_bias={7: 2.0})
    before = accepted(spec)
    assert run(spec, repeating_prompts(), params) == run(plain, repeating_prompts(), params)
    assert accepted(spec) > before


def test_max_tokens_stops_and_eos_mid_draft(spec, plain, reference):
    prompt = repeating_prompts()[2]
    cut = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in range(1, 13)]
    assert run(spec, [prompt] * len(cut), cut) == [reference[2][:m] for m in range(1, 13)]
    # Stop at tokens met late in the output: whatever a draft accepts past them is not emitted.
    late = reference[2][8:14]
    stops = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[t]) for t in late]
    spec_out = spec.generate([prompt] * len(stops), stops, use_tqdm=False)
    plain_out = plain.generate([prompt] * len(stops), stops, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in spec_out] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain_out]
    assert all(o.outputs[0].finish_reason == "stop" for o in spec_out)


def test_stop_strings_and_logprobs(spec, plain):
    prompt = repeating_prompts()[0]
    text = plain.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[i:i + 3]])
              for i in range(6, min(len(text) - 3, 30), 4)]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2))
    got = spec.generate([prompt] * len(params), params, use_tqdm=False)
    want = plain.generate([prompt] * len(params), params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert (g.outputs[0].text, g.outputs[0].token_ids, g.outputs[0].finish_reason) == \
            (w.outputs[0].text, w.outputs[0].token_ids, w.outputs[0].finish_reason)
    for g_step, w_step in zip(got[-1].outputs[0].logprobs, want[-1].outputs[0].logprobs, strict=True):
        assert g_step.keys() == w_step.keys()
        for t in g_step:
            assert g_step[t].rank == w_step[t].rank
            assert g_step[t].logprob == pytest.approx(w_step[t].logprob, abs=1e-4)


def test_seeded_sampling_is_reproducible(spec):
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True,
                            presence_penalty=0.2)
    prompts = repeating_prompts()
    first = run(spec, prompts, params)
    # Alone or beside other requests (whose drafts differ), its own generator gives the same draws.
    assert run(spec, prompts[:1], params) == first[:1]


def test_metrics_reach_prometheus_under_vllm_names(spec):
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from nanoserve.runtime.engine_core import EngineStats
    from nanoserve.server.metrics import ServerMetrics

    run(spec, repeating_prompts())  # greedy: drafts are accepted
    counts = spec.engine.spec_stats
    assert counts.num_accepted_tokens == sum(counts.accepted_per_pos) <= counts.num_draft_tokens
    assert counts.accepted_per_pos == sorted(counts.accepted_per_pos, reverse=True)  # a prefix of the drafts
    assert 1 < counts.mean_acceptance_length <= 1 + 4
    engine = spec.engine
    stats = EngineStats.of(engine, 0)
    client = SimpleNamespace(stats=stats, replica_stats=[stats], num_waiting_in=lambda s: 0, engine=engine)
    text = ServerMetrics(client, "m").render().decode()
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("vllm:spec")}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == counts.num_drafts > 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == counts.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == counts.num_accepted_tokens > 0
    assert [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p))] for p in range(4)] == \
        counts.accepted_per_pos
    from nanoserve.server.engine_view import snapshot

    assert snapshot(client, stats, "ok")["spec_mean_acceptance_length"] == counts.mean_acceptance_length > 1
    engine.spec_stats.observe(1, 1)  # the snapshot is a copy: later counts do not change it
    assert stats.spec_decode.num_drafts == counts.num_drafts - 1


def test_constrained_requests_beside_drafted_ones(spec, reference):
    """A sample under a grammar is not drafted for; its mask still reaches its own row of a verify step."""
    from nanoserve.structured.params import StructuredOutputs

    choice = SamplingParams(temperature=0, max_tokens=12,
                            structured_outputs=StructuredOutputs(choice=["alpha", "beta"]))
    before = accepted(spec)
    outs = spec.generate(repeating_prompts() + ["Hello"], [GREEDY] * 3 + [choice], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == reference
    assert outs[3].outputs[0].text in ("alpha", "beta") and outs[3].outputs[0].finish_reason == "stop"
    assert accepted(spec) > before


def test_bench_serve_reads_acceptance_from_metrics(spec):
    from types import SimpleNamespace

    from nanoserve.bench.serve import spec_counts_in
    from nanoserve.runtime.engine_core import EngineStats
    from nanoserve.server.metrics import ServerMetrics

    engine = spec.engine
    stats = EngineStats.of(engine, 0)
    client = SimpleNamespace(stats=stats, replica_stats=[stats], num_waiting_in=lambda s: 0, engine=engine)
    counts = engine.spec_stats
    assert spec_counts_in(ServerMetrics(client, "m").render().decode()) == \
        (counts.num_drafts, counts.num_accepted_tokens)
    plain = SimpleNamespace(stats=EngineStats(), replica_stats=[EngineStats()], num_waiting_in=lambda s: 0,
                            engine=engine)
    assert spec_counts_in(ServerMetrics(plain, "m").render().decode()) is None
