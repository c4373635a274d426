"""Outputs as deltas (the engine process's wire format): rebuilt on the other side, every step's outputs
equal the engine's own, tool-loop outputs and all, and an output already handed out never changes."""

import copy
import dataclasses
import pickle

import pytest
import torch

from nanoserve.chat_engine import ToolLoop
from nanoserve.config import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import ToolCompletionOutput
from nanoserve.runtime.output_delta import DeltaEncoder, OutputAssembler
from nanoserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a small shared CPU: one thread is fastest
    # Prefill chunks of 16 tokens: prompt logprobs then arrive over several steps.
    engine = LLMEngine(EngineArgs(num_kv_blocks=64, max_num_batched_tokens=16, async_scheduling=True).create_config())
    ToolLoop.attach(engine, "tool-")
    yield engine
    torch.set_num_threads(threads)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]], abort_after: int | None = None):
    """Step `engine` to the end; check each step's outputs against the ones rebuilt from pickled deltas.
    Returns every rebuilt output, with a deep copy of each taken when it was made."""
    encoder = DeltaEncoder()
    assemblers = {}
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params)
        assemblers[request_id] = OutputAssembler(request_id, ids)
    seen = []
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        if steps == abort_after:
            outputs += [engine.abort_request(request_id) for request_id, _, _ in requests
                        if request_id in engine.requests]
        deltas = pickle.loads(pickle.dumps(encoder.encode(outputs)))
        rebuilt = [assemblers[d[0]].apply(d) for d in deltas]
        assert rebuilt == [dataclasses.replace(out, prompt=None) for out in outputs]
        # Not the metrics: one object per request, updated in place, as the engine's own outputs share it.
        seen += [(out, copy.deepcopy(dataclasses.replace(out, metrics=None))) for out in rebuilt]
    assert not encoder._sent  # finished requests are forgotten
    return seen


def test_rebuilt_outputs_equal_the_engines(engine):
    tok = engine.tokenizer
    chat = engine.apply_chat_template([{"role": "user", "content": "What is 12*34?"}])
    long_prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    requests = [
        ("tool-0", chat, SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False)),
        ("tool-1", chat, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, logprobs=2)),
        ("plain-0", long_prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=2,
                                                ignore_eos=True)),
        ("plain-1", long_prompt, SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=10, stop=["e", "o"])),
    ]
    seen = _run(engine, requests)
    # The outputs handed out earlier still show what they had when they were made.
    assert all(dataclasses.replace(out, metrics=None) == snapshot for out, snapshot in seen)
    finals = {out.request_id: out for out, _ in seen if out.finished}
    assert set(finals) == {r[0] for r in requests}
    assert all(isinstance(c, ToolCompletionOutput) for c in finals["tool-1"].outputs)
    assert len(finals["plain-1"].outputs) == 3 and len(finals["plain-0"].prompt_logprobs) == len(long_prompt)
    # The greedy tool request called the calculator: its forced tokens came in an output of their own.
    forced = [out for out, _ in seen if out.request_id == "tool-0" and 0 in out.outputs[0].token_masks]
    assert forced and "408" in finals["tool-0"].outputs[0].text


def test_aborted_requests_end_with_their_last_delta(engine):
    requests = [(f"plain-{i}", [5, 6, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(2)]
    seen = _run(engine, requests, abort_after=3)
    finals = [out for out, _ in seen if out.finished]
    assert [c.finish_reason for out in finals for c in out.outputs] == ["abort", "abort"]
