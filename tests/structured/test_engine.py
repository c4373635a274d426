"""Structured output through LLM.generate on a random-weight model, with async scheduling: every constrained
completion is valid, and unconstrained requests in the same batches are untouched."""

import json
import re

import jsonschema
import pytest
from structured_cases import SCHEMAS

from nanoserve import SamplingParams
from nanoserve.structured.params import StructuredOutputs

PROMPTS = ["Hello", "The quick brown fox", "Numbers: 0 1 2", "nanoserve serves"]


def constrained(schema: dict, **kwargs) -> SamplingParams:
    return SamplingParams(**({"max_tokens": 200} | kwargs), structured_outputs=StructuredOutputs(json=schema))


def test_json_schema_completions_validate(llm):
    """Every schema at once, in one batch: sampled at temperature 1 with n=2, with top-p and top-k, and greedy.
    Every sample parses and validates."""
    prompts, params, schemas = [], [], []
    for i, schema in enumerate(SCHEMAS.values()):
        for p in (constrained(schema, temperature=1.0, n=2, seed=7), constrained(schema, temperature=0),
                  constrained(schema, temperature=0.8, top_p=0.9, top_k=20)):
            prompts.append(PROMPTS[(i + len(params)) % len(PROMPTS)])
            params.append(p)
            schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(len(o.outputs) for o in outs) == 4 * len(SCHEMAS)
    for out, schema in zip(outs, schemas, strict=True):
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm):
    """The same unconstrained requests, alone and mixed into batches with constrained ones (whose masks apply to
    other rows of the same logits), give the same tokens: greedy and seeded."""
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, n=2)]
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:], plain + [constrained(SCHEMAS["order"], temperature=1.0, n=2),
                                                             constrained(SCHEMAS["flags"], temperature=0)],
                         use_tqdm=False)
    for a, m in zip(alone, mixed[:2], strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in m.outputs]
    for o in mixed[2:]:
        for c in o.outputs:
            json.loads(c.text)


def test_constraint_holds_under_ignore_eos(llm):
    """With ignore_eos the sample runs to max_tokens: after the object the grammar allows only eos, so the text is
    still exactly the object."""
    out = llm.generate(["Hello"], constrained(SCHEMAS["person"], temperature=1.0, seed=1, ignore_eos=True,
                                              max_tokens=120), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 120
    jsonschema.validate(json.loads(out.text), SCHEMAS["person"])


def test_regex_choice_and_grammar(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}(\.[a-z]{2})?"
    choices = ["yes", "no", "maybe later"]
    lark = 'start: "(" num (" " op " " num)* ")"\nnum: /[1-9][0-9]?/\nop: "+" | "*"'
    gbnf = 'root ::= "answer: " ("left" | "right")'
    params = [SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=40, structured_outputs={"regex": regex}),
              SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=30, structured_outputs={"choice": choices}),
              SamplingParams(temperature=1.0, n=2, seed=5, max_tokens=60, structured_outputs={"grammar": lark}),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs={"grammar": gbnf})]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(re.fullmatch(regex, c.text) for c in outs[0].outputs), [c.text for c in outs[0].outputs]
    assert all(c.text in choices for c in outs[1].outputs), [c.text for c in outs[1].outputs]
    assert all(re.fullmatch(r"\([1-9][0-9]?( [+*] [1-9][0-9]?)*\)", c.text) for c in outs[2].outputs), \
        [c.text for c in outs[2].outputs]
    assert outs[3].outputs[0].text in ("answer: left", "answer: right")
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs), [c for o in outs for c in o.outputs]


def test_json_object_and_compact_whitespace(llm):
    outs = llm.generate(PROMPTS[:2], [
        SamplingParams(temperature=1.0, seed=2, max_tokens=200, structured_outputs={"json_object": True}),
        SamplingParams(temperature=1.0, seed=2, max_tokens=200,
                       structured_outputs={"json": SCHEMAS["flags"], "disable_any_whitespace": True})],
        use_tqdm=False)
    obj = outs[0].outputs[0]
    if obj.finish_reason == "stop":  # an open-ended object may still be writing a free-form string at max_tokens
        assert isinstance(json.loads(obj.text), dict)
    compact = outs[1].outputs[0].text
    assert json.dumps(json.loads(compact), separators=(",", ":"), ensure_ascii=False) == compact


def test_bad_constraints_name_the_field():
    cases = [({"json": {"type": "objekt"}}, "structured_outputs.json: Invalid type"),
             ({"regex": "[a-"}, "structured_outputs.regex"),
             ({"grammar": 'start: "a" | b'}, "structured_outputs.grammar"),
             ({"choice": []}, "structured_outputs.choice: must be a list"),
             ({"regex": "a", "choice": ["a"]}, "structured_outputs: give exactly one"),
             ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
             ({"jsn": {}}, "structured_outputs: unknown fields")]
    for spec, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(structured_outputs=spec)


def test_grammar_compiles_once_per_schema(llm):
    structured = llm.engine.structured
    llm.generate(["Hello"], constrained(SCHEMAS["person"], temperature=0), use_tqdm=False)
    cached = len(structured.compiler.cache)
    llm.generate(["Hi"] * 3, constrained(SCHEMAS["person"], temperature=1.0, n=2), use_tqdm=False)
    assert len(structured.compiler.cache) == cached and not structured.compiling


def test_chat_engine_generate_takes_a_constraint(llm):
    """The nanochat-style Engine passes SamplingParams through LLM: a constrained request there too."""
    out = llm.chat([{"role": "user", "content": "Pick one"}],
                   SamplingParams(temperature=1.0, seed=4, max_tokens=10,
                                  structured_outputs={"choice": ["red", "green"]}), use_tqdm=False)
    assert out[0].outputs[0].text in ("red", "green")


def test_sampling_waits_for_masks_filled_beside_the_engine(llm):
    """A step with constrained rows leaves its sampling for later (the masks are filled on a thread beside the
    engine's); a step where a row's sampling reads its history (min_tokens) samples at once. Both finish valid."""
    engine = llm.engine
    deferred = []
    for i, extra in enumerate(({}, {"min_tokens": 2})):
        engine.add_request(f"defer-{i}", PROMPTS[0], constrained(SCHEMAS["flags"], temperature=0, **extra))
        seen, finished = [], None
        while finished is None:
            for out in engine.step():
                finished = out if out.finished else finished
            if engine.in_flight is not None:
                seen.append(engine.in_flight.deferred_sample is not None)
        deferred.append(any(seen))
        json.loads(finished.outputs[0].text)
    assert deferred == [True, False]


def test_a_grammar_is_not_stepped_while_its_mask_is_filled(llm):
    """GrammarState.advance waits for a fill that uses its matcher: the token is taken only after it ends."""
    import threading
    from concurrent.futures import Future

    from nanoserve.structured.backend import GrammarState

    compiler = llm.engine.structured.compiler
    state = GrammarState(compiler.compile(StructuredOutputs(regex="[ab]+").compiled))
    fill = state.filling = Future()
    token = llm.engine.tokenizer.encode("a", add_special_tokens=False)[0]
    stepped = threading.Event()
    thread = threading.Thread(target=lambda: (state.advance([token], 0), stepped.set()))
    thread.start()
    assert not stepped.wait(0.2) and state.num_consumed == 0
    fill.set_result(None)
    thread.join(timeout=10)
    assert stepped.is_set() and state.num_consumed == 1


def test_the_engine_thread_does_not_wait_for_a_fill_to_append_a_token(llm, monkeypatch):
    """While a step's masks are filled, the engine's thread appends the previous step's tokens, which the grammars
    took early: it must not wait for the fill there (at 8459f98 it did, at every token: on an H100 the steps then
    took the device's time plus the masks', as before the fill had a thread of its own). Fills are slowed here so
    that each is still running when the engine appends."""
    import time

    from nanoserve.structured.backend import GrammarState

    params = constrained(SCHEMAS["flags"], temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # compiles the grammar (and the compiler)
    compiler = llm.engine.structured.compiler
    fill = compiler.fill
    monkeypatch.setattr(compiler, "fill", lambda states, bits: (time.sleep(0.05), fill(states, bits)))
    waits = []
    settle = GrammarState.settle

    def watched(self):
        if self.filling is not None and not self.filling.done():
            waits.append(self)
        settle(self)

    monkeypatch.setattr(GrammarState, "settle", watched)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert waits == []


def test_logit_masks_leave_the_pending_token_to_the_mask_thread(llm):
    """logit_masks returns before the previous step's samples are read: the mask thread reads the pending token,
    and the grammar takes it there before the fill (the engine's thread read it and stepped
    every grammar itself, at 749541c). The token then counts as taken when the engine appends it."""
    import threading
    from types import SimpleNamespace

    from nanoserve.layers.sampler import SamplerOutput
    from nanoserve.structured.backend import GrammarState

    manager = llm.engine.structured
    manager.compiler = manager.compiler or manager.make_compiler()
    state = GrammarState(manager.compiler.compile(StructuredOutputs(regex="ab").compiled))
    a, b = (llm.engine.tokenizer.encode(t, add_special_tokens=False)[0] for t in "ab")
    seq = SimpleNamespace(grammar=state, seq_id=7, num_pending=1, token_ids=[1, 2], num_prompt_tokens=2)
    released = threading.Event()

    class Prev:
        rows = {7: 0}

        def result(self) -> SamplerOutput:
            assert released.wait(10)
            return SamplerOutput([a], [None])

    masks = manager.logit_masks([seq], Prev())
    assert state.num_consumed == 1 and not state.filling.done()  # counted, not yet taken: the thread waits
    released.set()
    masks.wait()
    assert masks.failed == {}
    allowed = [t for t in (a, b) if masks.bits[0, t // 32].item() >> (t % 32) & 1]
    assert allowed == [b]  # "a" was taken: only "b" may follow
    seq.token_ids.append(a)
    state.advance(seq.token_ids, seq.num_prompt_tokens)  # the engine appends it: nothing more to take
    assert state.num_consumed == 1 and state.matcher.consume_token(b)


def test_the_mask_thread_gets_the_gil_within_a_millisecond(llm, hermes_dir):
    """While a mask thread runs, the process hands the GIL over every 1 ms at most (5 ms by default, most of a
    step). The interval is the process's: with two engines it stays low until both have shut down their mask
    threads, then the process's own comes back; a later request lowers it again."""
    import sys

    from nanoserve import LLM

    other = LLM(model=str(hermes_dir), num_kv_blocks=64, seed=0, async_scheduling=True)
    engines = [llm.engine.structured, other.engine.structured]
    llm.engine.structured.shutdown()
    original = sys.getswitchinterval()  # engines of other tests may have lowered it
    sys.setswitchinterval(0.005)
    params = constrained(SCHEMAS["flags"], temperature=0, max_tokens=8)
    try:
        for engine in (llm, other):
            engine.generate(PROMPTS[:1], params, use_tqdm=False)
            assert sys.getswitchinterval() <= 0.001
        engines[0].shutdown()
        assert sys.getswitchinterval() <= 0.001  # the other's mask thread still runs
        engines[1].shutdown()
        assert sys.getswitchinterval() == 0.005
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert sys.getswitchinterval() <= 0.001
    finally:
        other.shutdown()
        llm.engine.structured.shutdown()
        sys.setswitchinterval(original)


def test_a_grammar_in_error_fails_its_request_alone(llm):
    """A token forced against the grammar leaves its matcher in error: at the next mask the request fails with an
    error its caller sees, and the unconstrained request beside it finishes (at 8459f98 the mask thread raised on
    the failed row instead, and the whole step with it)."""
    engine = llm.engine
    engine.add_request("in-error", PROMPTS[0], constrained(SCHEMAS["flags"], temperature=0, max_tokens=30))
    engine.add_request("beside", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    with pytest.raises(ValueError, match="grammar"):
        engine.force_tokens("in-error", 0, engine.tokenizer.encode("zzz", add_special_tokens=False)[:1])
    finished = {}
    for _ in range(60):
        finished |= {out.request_id: out for out in engine.step() if out.finished}
        if not engine.has_unfinished_requests():
            break
    assert finished["in-error"].error is not None
    assert finished["beside"].outputs[0].finish_reason == "length"
