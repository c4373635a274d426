"""Strict tools under tool_choice "auto": the grammar each parser builds leaves prose free and holds every call in
its format to the tools' schemas, with the markers as added tokens (the test checkpoint's tokenizer) and as text (a
tokenizer without them); and a random-weight model sampled under it only ever writes prose or valid calls."""

import json

import jsonschema
import pytest
from checkpoints import write_tokenizer
from structured_cases import TIME, TOOLS, WEATHER, strict
from transformers import AutoTokenizer

from nanoserve import SamplingParams
from nanoserve.structured.backend import GrammarCompiler, GrammarState
from nanoserve.structured.tool_parsers import PARSERS
from nanoserve.structured.tool_parsers.grammar import Markers
from nanoserve.structured.tools import strict_auto_constraint

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
BAD = '{"name": "get_weather", "arguments": {"city": "Berlin", "days": 3}}'
T = '{"name": "get_time", "parameters": {"zone": "UTC+1"}}'
# (parser, reply, allowed with the markers as tokens, allowed with the markers as text)
CASES = [
    ("hermes", "Just prose, <tool, </tool_call>.", True, True),
    ("hermes", f"Let me look.<tool_call>\n{W}\n</tool_call>", True, True),
    ("hermes", f"<tool_call>{W}</tool_call> and <tool_call>{T.replace('parameters', 'arguments')}</tool_call>.",
     True, True),
    ("hermes", f"<tool_call>{BAD}</tool_call>", False, False),
    ("hermes", "<tool_call>oops</tool_call>", False, False),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}, "x": 1}</tool_call>',
     False, False),
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', False, False),
    ("hermes", "<tool_call>{\n\n\n", False, False),  # whitespace is bounded as in structured output
    ("llama3_json", "Prose.", True, True),
    ("llama3_json", f"<|python_tag|>{T}; {T.replace('+1', '-2')}", True, True),
    ("llama3_json", T, True, True),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}', False, False),
    ("llama3_json", ' {"name": "get_time"', False, False),  # prose may not start like a call
    ("llama3_json", "  <|python_tag|>hi", False, False),
    ("mistral", "Prose [TOOL", True, True),
    ("mistral", 'Ok.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "UTC+1"}', True, False),  # v11 where [ARGS] is a token
    ("mistral", f"Ok.[TOOL_CALLS][{W}, {T.replace('parameters', 'arguments')}]", False, True),  # else the array
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}', False, False),
    ("mistral", f"[TOOL_CALLS][{BAD}]", False, False),
]


@pytest.fixture(scope="module")
def tokenizers(hermes_dir, tmp_path_factory):
    """The test checkpoint's tokenizer (markers as added tokens) and one without them."""
    plain = tmp_path_factory.mktemp("plain-tokenizer")
    write_tokenizer(plain)
    return {"tokens": AutoTokenizer.from_pretrained(hermes_dir), "text": AutoTokenizer.from_pretrained(plain)}


def _markers(tokenizer) -> Markers:
    return Markers({t.content: i for i, t in tokenizer.added_tokens_decoder.items()}, [tokenizer.eos_token_id])


@pytest.mark.parametrize("kind", ["tokens", "text"])
def test_strict_grammar_leaves_prose_free_and_holds_every_call(tokenizers, kind):
    tokenizer = tokenizers[kind]
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    for name, reply, with_tokens, with_text in CASES:
        spec = strict_auto_constraint(strict(TOOLS), PARSERS[name]([]), True, _markers(tokenizer))
        state = GrammarState(compiler.compile(spec.compiled))
        ids = tokenizer.encode(reply, add_special_tokens=False)
        accepted = all(state.matcher.consume_token(t) for t in ids) and state.matcher.is_accepting()
        assert accepted == (with_tokens if kind == "tokens" else with_text), (name, reply)


def test_parallel_tool_calls_false_allows_one_call(tokenizers):
    tokenizer = tokenizers["text"]
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    for name, one, two in [("hermes", f"<tool_call>{W}</tool_call> ok", f"<tool_call>{W}</tool_call><tool_call>"),
                           ("llama3_json", T, f"{T};"),
                           ("mistral", f"[TOOL_CALLS][{W}]", f"[TOOL_CALLS][{W}, ")]:
        spec = strict_auto_constraint(strict(TOOLS), PARSERS[name]([]), False, Markers())
        for reply, allowed in ((one, True), (two, False)):
            state = GrammarState(compiler.compile(spec.compiled))
            ids = tokenizer.encode(reply, add_special_tokens=False)
            assert all(state.matcher.consume_token(t) for t in ids) == allowed, (name, reply)


def test_only_strict_tools_are_held_to_their_schema():
    """Without a strict tool "auto" stays free; beside a strict one a non-strict tool's arguments are any object
    (its name must still be listed)."""
    assert strict_auto_constraint(TOOLS, PARSERS["hermes"]([]), True, Markers()) is None
    grammar = strict_auto_constraint([WEATHER, *strict([TIME])], PARSERS["hermes"]([]), True, Markers()).compiled
    assert '"get_weather", "arguments": {"type": "object"}' in grammar.replace('{"const": ', "").replace("}, ", ", ")


@pytest.mark.parametrize("name", ["pythonic", "nanochat"])
def test_formats_that_cannot_hold_a_schema_refuse_strict_tools(name):
    with pytest.raises(ValueError, match=r"^tools\.1\.function\.strict: strict tools under tool_choice \"auto\" "
                                         rf"are not supported with the {name} tool-call parser"):
        strict_auto_constraint([WEATHER, *strict([TIME])], PARSERS[name]([]), True, Markers())


def test_a_bad_schema_in_a_strict_tool_names_tools():
    bad = strict([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}])
    with pytest.raises(ValueError, match="^tools: Invalid type"):
        strict_auto_constraint(bad, PARSERS["hermes"]([]), True, Markers())


SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize(("name", "trigger", "bias", "forms"), [
    ("hermes", "<tool_call>", 3.0, None),
    ("llama3_json", "<|python_tag|>", 12.0, None),  # only the first token decides
    ("mistral", "[TOOL_CALLS]", 3.0, "v11"),
    ("mistral", "[TOOL_CALLS]", 3.0, "array"),  # a tokenizer without [ARGS]
])
def test_a_random_model_under_strict_auto_writes_prose_or_valid_calls(llm, name, trigger, bias, forms):
    """Sampled over several seeds, with the call's marker token favoured so that calls come: every reply the parser
    reads is prose (no call section at all) or calls to listed tools with valid arguments; only a reply cut by
    max_tokens may hold an unfinished call."""
    tokenizer = llm.engine.tokenizer
    markers = _markers(tokenizer)
    if forms == "array":
        del markers.added["[ARGS]"]
    parser = PARSERS[name](tokenizer.all_special_tokens)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=160, skip_special_tokens=False,
                             logit_bias={markers.added[trigger]: bias} if seed else None,
                             structured_outputs=strict_auto_constraint(strict(TOOLS), parser, parallel, markers))
              for seed, parallel in [(0, True), (11, True), (22, False), (33, False), (44, True), (55, False)]]
    outs = llm.generate(["Hello", "Call a tool", "What is the weather?", "Hi", "Time?", "Go"], params,
                        use_tqdm=False)
    calls = prose = 0
    for out in outs:
        c = out.outputs[0]
        reply = parser.parse(c.text)
        for call in reply.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        calls += len(reply.tool_calls)
        if not reply.tool_calls:
            section = parser.section_start(parser.scrub(c.text))
            assert section is None or c.finish_reason == "length", c.text
            prose += section is None
    assert calls and prose
