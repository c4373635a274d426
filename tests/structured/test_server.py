"""Structured output and tools through the OpenAI server on a random-weight model (async scheduling on), with the
official openai client: response_format, vLLM's structured_outputs on both endpoints, 400s that say what is wrong,
tool_choice "required" and named, strict tools under "auto", tool messages through the template, streamed tool-call
deltas (arguments in pieces), and client.beta.chat.completions.parse with a pydantic model."""

import importlib.util
import json
from pathlib import Path

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from structured_cases import SCHEMAS, TOOLS, WEATHER, strict


def _start_server():
    """tests/server/conftest.py's start_server (a conftest module cannot be imported by name beside another)."""
    path = Path(__file__).parents[1] / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("server_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.start_server


start_server = _start_server()

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(hermes_dir, tmp_path_factory):
    s = start_server(hermes_dir, tmp_path_factory.mktemp("logs"), "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes")
    s.model = hermes_dir.name
    yield s
    s.stop()


def test_response_format_json_schema_and_json_object(server):
    client = server.client()
    schema = SCHEMAS["order"]
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, n=3, temperature=1.0, seed=1,
                                       max_tokens=200, response_format={"type": "json_schema", "json_schema": {
                                           "name": "order", "schema": schema, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0, seed=2,
                                            max_tokens=200, stream=True, response_format={
                                                "type": "json_schema", "json_schema": {"name": "flags",
                                                                                       "schema": SCHEMAS["flags"]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["flags"])
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=0, max_tokens=60,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": None})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_structured_outputs_on_completions(server):
    client = server.client()
    r = client.completions.create(model=server.model, prompt=["Hi", "Yo"], n=2, temperature=1.0, seed=3,
                                  max_tokens=20, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert sorted({c.text for c in r.choices} | {"alpha", "beta"}) == ["alpha", "beta"] and len(r.choices) == 4
    stream = client.completions.create(model=server.model, prompt="Hi", temperature=1.0, seed=3, max_tokens=40,
                                       stream=True, extra_body={"structured_outputs": {"regex": r"[a-c]{2}-[0-9]{3}"}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert len(text) == 6 and text[2] == "-" and text[3:].isdigit()
    r = client.completions.create(model=server.model, prompt="Hi", temperature=0, max_tokens=200,
                                  extra_body={"structured_outputs": {"json": SCHEMAS["person"]}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS["person"])


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema", "Invalid type: objekt"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": 'start: "a" | b'}}, "structured_outputs.grammar", 'unknown name: "b"'),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": strict(TOOLS), "response_format": {"type": "json_object"}}, "tools.0.function.strict",
     "cannot go with response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools", "Invalid type: objekt"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5, extra_body=body)
    error = info.value.body
    assert error["param"] == param and says in error["message"], error


def _check_calls(calls, allowed: list[dict]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_tool_choice_required_and_named(server):
    client = server.client()
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       n=2, temperature=1.0, seed=4, max_tokens=600)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls, TOOLS)
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=200)
    assert len(r.choices[0].message.tool_calls) == 1
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=6,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=100)
    assert r.choices[0].finish_reason == "stop"  # as OpenAI, for a named function
    _check_calls(r.choices[0].message.tool_calls, [WEATHER])
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_join_to_the_message(server, tool_choice):
    client = server.client()
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
                  seed=8, max_tokens=300, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls, whole
    calls, finish, pieces = _joined_stream(client, **kwargs)
    assert finish == whole.finish_reason and pieces > 3  # the arguments come as they are written
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]


def test_tool_messages_go_through_the_template_and_auto_is_parsed(server):
    """A conversation with an assistant's tool call and the tool's result renders (the template gets tools= and
    the messages); "auto" leaves the random model free and its reply is content unless it wrote a call."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tokens = server.client().post("/../tokenize", cast_to=object, body={"messages": messages})
    assert tokens["count"] > 0
    r = server.client().chat.completions.create(model=server.model, messages=messages, tools=TOOLS, temperature=0,
                                                max_tokens=16)
    message = r.choices[0].message
    assert (message.content is not None) or message.tool_calls


def test_openai_client_parse_with_a_pydantic_model(server):
    class Item(BaseModel):
        sku: str = Field(pattern="^[A-Z][0-9]$")
        qty: int = Field(ge=1, le=9)

    class Order(BaseModel):
        items: list[Item] = Field(min_length=1, max_length=2)
        paid: bool

    r = server.client().beta.chat.completions.parse(model=server.model, messages=MESSAGES, response_format=Order,
                                                   temperature=1.0, seed=9, max_tokens=200)
    order = r.choices[0].message.parsed
    assert isinstance(order, Order) and 1 <= len(order.items) <= 2


# The test tokenizer's <tool_call> token (conftest.py), favoured so that a random model writes calls.
TOOL_CALL_BIAS = {"382": 3}


def _joined_stream(client, **kwargs) -> tuple[dict, str | None, int]:
    """A streamed reply's tool-call deltas joined as a client does: ({index: {"name", "arguments"}}, finish_reason,
    how many chunks carried argument pieces)."""
    calls, finish, pieces = {}, None, 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                pieces += bool(delta.function.arguments)
    return calls, finish, pieces


def test_strict_tools_under_auto_give_prose_or_valid_calls(server):
    """tool_choice "auto" with strict tools: over several seeds every reply is prose, or calls (in the model's Hermes
    format, read back by the parser) whose arguments validate; a reply that has calls ends with "tool_calls" unless
    max_tokens cut the prose after them."""
    client = server.client()
    calls = prose = 0
    for seed, parallel, bias in [(1, True, None), (2, True, TOOL_CALL_BIAS), (3, False, TOOL_CALL_BIAS),
                                 (4, True, TOOL_CALL_BIAS), (5, False, None)]:
        r = client.chat.completions.create(model=server.model, messages=MESSAGES, tools=strict(TOOLS),
                                           parallel_tool_calls=parallel, temperature=1.0, seed=seed, max_tokens=150,
                                           n=2, logit_bias=bias, extra_body={"tool_choice": "auto"})
        for choice in r.choices:
            message = choice.message
            if message.tool_calls:
                _check_calls(message.tool_calls, TOOLS)
                assert choice.finish_reason in ("tool_calls", "length") and (parallel or len(message.tool_calls) == 1)
                calls += 1
            else:
                assert "<tool_call>" not in message.content or choice.finish_reason == "length", message.content
                prose += "<tool_call>" not in message.content
    assert calls and prose


def test_strict_auto_streams_arguments_in_pieces_joined_as_unstreamed(server):
    client = server.client()
    kwargs = dict(model=server.model, messages=MESSAGES, tools=strict(TOOLS), temperature=1.0, seed=2,
                  max_tokens=150, logit_bias=TOOL_CALL_BIAS, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls, whole
    calls, finish, pieces = _joined_stream(client, **kwargs)
    assert finish == whole.finish_reason and pieces > 3
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls]
