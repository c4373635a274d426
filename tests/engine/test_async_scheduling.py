"""Async scheduling (step N+1 planned before step N's tokens are read) gives exactly what the
synchronous engine gives, on every engine path. On the CPU it is off by default; here it is forced on,
so each decode reads its input token from the previous step's device tensor."""

import pytest
import torch

from nanoserve import LLM, SamplingParams


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    system = torch.randint(2, 384, (40,), generator=g).tolist()
    return [system + torch.randint(2, 384, (n,), generator=g).tolist() for n in (3, 11, 29, 50, 1, 70)]


def summary(outputs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text, c.logprobs) for c in o.outputs] +
            [o.prompt_logprobs] for o in outputs]


# (engine kwargs, sampling kwargs): chunked prefill, preemption with the prefix cache, n > 1 forks,
# seeded sampling with logprobs, per-request max_tokens, penalties (which read tokens on the host).
CASES = {
    "plain": ({}, dict(temperature=0, max_tokens=12, ignore_eos=True)),
    "chunked": (dict(max_num_batched_tokens=7), dict(temperature=0, max_tokens=9, ignore_eos=True)),
    "preempt": (dict(num_kv_blocks=12, max_num_batched_tokens=24), dict(temperature=0, max_tokens=20,
                                                                        ignore_eos=True)),
    "n4": ({}, dict(n=4, temperature=1.0, seed=11, max_tokens=7, ignore_eos=True)),
    "logprobs": ({}, dict(temperature=0.8, seed=3, logprobs=3, max_tokens=6, ignore_eos=True)),
    "one_token": ({}, dict(temperature=0, max_tokens=1, ignore_eos=True)),
    "penalties": ({}, dict(temperature=0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5,
                           ignore_eos=True)),
    "prompt_logprobs": (dict(max_num_batched_tokens=16), dict(temperature=0, max_tokens=4, prompt_logprobs=2,
                                                              ignore_eos=True)),
    "min_tokens": ({}, dict(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=list(range(0, 384, 3)))),
}


@pytest.mark.parametrize("case", CASES)
def test_async_equals_sync(llama_dir, case):
    engine_kwargs, sampling = CASES[case]
    engine_kwargs = dict(num_kv_blocks=128) | engine_kwargs
    params = SamplingParams(**sampling)
    sync = LLM(str(llama_dir), async_scheduling=False, **engine_kwargs)
    overlap = LLM(str(llama_dir), async_scheduling=True, **engine_kwargs)
    want = summary(sync.generate(prompts(), params, use_tqdm=False))
    assert summary(overlap.generate(prompts(), params, use_tqdm=False)) == want
    engine = overlap.engine
    assert engine.in_flight is None and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    if case == "preempt":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("penalty", [0.0, 0.3])
def test_stops_mid_flight_drop_the_extra_token(llama_dir, penalty):
    """A sample that stops at step N was already scheduled for step N+1: that token must not appear. With
    penalties the tokens are read before the next step is scheduled, so the stopped sample is not in it (at
    749541c they were read after, and the next step's inputs read the stopped sample's freed blocks: IndexError)."""
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=penalty)
    sync = LLM(str(llama_dir), async_scheduling=False, num_kv_blocks=128)
    free_run = [o.outputs[0].token_ids for o in sync.generate(prompts(), base, use_tqdm=False)]
    # Stop each prompt at the 4th token it generates freely.
    stop_ids = sorted({ids[3] for ids in free_run})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=stop_ids,
                            presence_penalty=penalty)
    want = summary(sync.generate(prompts(), params, use_tqdm=False))
    overlap = LLM(str(llama_dir), async_scheduling=True, num_kv_blocks=128)
    got = summary(overlap.generate(prompts(), params, use_tqdm=False))
    assert got == want
    assert all(len(o[0][0]) <= 4 and o[0][1] == "stop" for o in got)
    assert overlap.engine.block_manager.num_free_blocks == 128


def test_next_step_is_launched_before_tokens_are_read(llama_dir):
    llm = LLM(str(llama_dir), async_scheduling=True, num_kv_blocks=128)
    engine = llm.engine
    engine.add_request("r", prompts()[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; nothing read yet
    seq = engine.requests["r"].seqs[0]
    assert seq.num_pending == 1 and seq.output_token_ids == []
    outputs = engine.step()  # the first decode is launched, then the prefill's token is read
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] and seq.num_pending == 1
    steps = 2
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps == 6 and len(seq.output_token_ids) == 5  # no step scheduled past max_tokens


def test_abort_with_a_step_in_flight(llama_dir):
    llm = LLM(str(llama_dir), async_scheduling=True, num_kv_blocks=128)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", prompts()[0], params)
    engine.add_request("b", prompts()[1], params)
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["b"] and len(done[0].outputs[0].token_ids) == 50
    assert engine.block_manager.num_free_blocks == 128


def test_tool_loop_forces_over_an_in_flight_token():
    """The calculator's output is forced after <|python_end|>, while the token sampled after that one is
    already in flight: it must be dropped, and the result must equal the synchronous engine's."""
    from nanoserve.chat_engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for mode in (False, True):
            llm = LLM(async_scheduling=mode)
            prompt = llm.apply_chat_template([{"role": "user", "content": "What is 123*456?"}])
            tokens, masks = Engine(llm).generate_batch(prompt, num_samples=3, temperature=0.7, seed=1,
                                                       max_tokens=48)
            results[mode] = (tokens, masks)
        assert results[True] == results[False]
        assert all(0 in m[len(prompt):] for m in results[True][1])  # every sample called the tool
    finally:
        torch.set_num_threads(threads)


def test_stop_strings_mid_flight(llama_dir):
    """A stop string found in step N's token ends the sample though step N+1 already sampled after it."""
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sync = LLM(str(llama_dir), async_scheduling=False, num_kv_blocks=128)
    texts = [o.outputs[0].text for o in sync.generate(prompts(), base, use_tqdm=False)]
    stops = sorted({t[len(t) // 3:len(t) // 3 + 2] for t in texts if len(t) >= 6})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stops)
    want = summary(sync.generate(prompts(), params, use_tqdm=False))
    overlap = LLM(str(llama_dir), async_scheduling=True, num_kv_blocks=128)
    got = summary(overlap.generate(prompts(), params, use_tqdm=False))
    assert got == want
    assert sum(o[0][1] == "stop" for o in got) >= 3  # most samples stopped on a string
