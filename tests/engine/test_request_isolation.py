"""A failure that belongs to one request ends that request alone, with an error its caller sees; every
other request of the batch finishes with the tokens it would have had, and the engine goes on."""

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.runtime.engine_core import AddRequest, EngineCore, Stop
from nanoserve.runtime.streams import RequestFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), num_kv_blocks=64, async_scheduling=True)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def run_with_fault(llm: LLM, fault, params=GREEDY) -> dict[str, object]:
    """Run PROMPTS as requests r0..r3; after two steps, fault(engine, request r1). Returns each request's
    final output."""
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 2:
            fault(engine, engine.requests["r1"])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    return finals


def assert_isolated(finals: dict, reference: list[list[int]], message: str) -> None:
    failed = finals["r1"]
    assert failed.finished and failed.error is not None and message in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    for i in (0, 2, 3):
        assert finals[f"r{i}"].error is None
        assert finals[f"r{i}"].outputs[0].token_ids == reference[i]
        assert finals[f"r{i}"].outputs[0].finish_reason == "length"


def test_fault_while_sampling_one_request(llm, reference):
    class BrokenGenerator:  # the row's own noise source raises inside the batched sampler
        def __repr__(self) -> str:
            return "BrokenGenerator"

    def fault(engine, request):
        request.seqs[0].generator = BrokenGenerator()

    params = SamplingParams(temperature=1e-6, max_tokens=8, ignore_eos=True)  # sampled, yet as greedy
    finals = run_with_fault(llm, fault, params)
    failed = finals["r1"]
    assert failed.error is not None and [c.finish_reason for c in failed.outputs] == ["error"]
    for i in (0, 2, 3):
        assert finals[f"r{i}"].outputs[0].token_ids == reference[i]
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[0]


def test_fault_while_appending_one_requests_token(llm, reference):
    def fault(engine, request):
        def add_token(token):
            raise RuntimeError("detokenizer broke")
        request.seqs[0].detokenizer.add_token = add_token

    assert_isolated(run_with_fault(llm, fault), reference, "detokenizer broke")
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference[0]


def test_fault_while_adding_leaves_nothing_behind(llm, reference, monkeypatch):
    engine = llm.engine
    real = engine._new_sequence

    def new_sequence(request, index):
        if index == 1:  # the fork of an n=2 request: built with the request, so it fails when it is added
            raise RuntimeError("fork broke")
        return real(request, index)

    monkeypatch.setattr(engine, "_new_sequence", new_sequence)
    with pytest.raises(RuntimeError, match="fork broke"):
        engine.add_request("bad", PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=4))
    assert "bad" not in engine.requests and not engine.scheduler.waiting
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_engine_core_reports_a_failed_request_and_runs_on(llm, reference, monkeypatch):
    """Through the loop the server runs: the failed request's caller gets RequestFailedError, the others
    their outputs, and the loop keeps serving."""
    engine = llm.engine
    real = engine._new_sequence

    def new_sequence(request, index):
        if request.request_id == "bad":
            raise KeyError("no such thing")  # not a ValueError: an engine-side failure, not a refusal
        return real(request, index)

    monkeypatch.setattr(engine, "_new_sequence", new_sequence)
    commands = [[AddRequest("bad", PROMPTS[0], GREEDY), AddRequest("good", PROMPTS[2], GREEDY)]]
    published = []

    def receive(block: bool):
        return commands.pop(0) if commands else []

    def publish(outputs, errors, stats):
        published.append((outputs, errors))
        if any(o.request_id == "good" and o.finished for o in outputs):
            commands.append([Stop()])

    assert EngineCore(engine, receive, publish).run() is None  # stopped, not dead
    errors = [e for _, errs in published for e in errs]
    assert len(errors) == 1 and errors[0][0] == "bad" and isinstance(errors[0][1], RequestFailedError)
    good = [o for outs, _ in published for o in outs if o.request_id == "good" and o.finished]
    assert good[0].outputs[0].token_ids == reference[2]


@pytest.mark.parametrize("bias", [100, -100])
def test_logit_bias_moves_greedy_choice(llm, reference, bias):
    first = reference[0][0]
    target = first if bias < 0 else (first + 1) % llm.engine.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={target: bias})
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    if bias > 0:
        assert out == [target] * 3  # +100 dwarfs every random logit
    else:
        assert target not in out and out[0] != first


def test_logit_bias_token_out_of_vocabulary_is_refused(llm):
    vocab = llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}), use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_k=2**63), "top_k"), (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=2**63 - 1, n=2), "seed"), (dict(n=True), "n"), (dict(max_tokens=2**64), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=float("inf")), "top_p"),
    (dict(logprobs=21), "logprobs"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={3: 100.5}), "logit_bias"), (dict(logit_bias={-2: 1}), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_sampling_params_ranges_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [2**63 - 2, -(2**63)])
def test_seeds_at_the_edges_run(llm, seed):
    params = SamplingParams(n=2, seed=seed, max_tokens=3, ignore_eos=True)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
