"""Each tool-call parser on replies written by hand from its model family's published format, malformed ones
included (they come back as content), and streamed: the deltas join to the unstreamed message."""

import json

import pytest

from nanoserve.structured.tool_parsers import PARSERS
from nanoserve.structured.tools import ToolCallStream

W = {"city": "Paris", "days": 3}
T = {"zone": "UTC+1"}

# (parser, reply, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     None, [("get_weather", W)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}}\n</tool_call>',
     "Let me check.\n\n", [("get_weather", W), ("get_time", T)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC+1\\"}"}\n</tool_call>',
     None, [("get_time", T)]),  # arguments as a JSON string (some Qwen fine-tunes)
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}}', None, [("get_time", T)]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>', []),
    ("hermes", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", W)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC+1"}}', None,
     [("get_weather", W), ("get_time", T)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "get_weather", '
                    '"parameters": {"city": "Paris"', []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC+1"}} and then some text',
     '{"name": "get_time", "parameters": {"zone": "UTC+1"}} and then some text', []),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC+1"}}]</s>', None,
     [("get_weather", W), ("get_time", T)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "UTC+1"}</s>', "Sure. ", [("get_weather", W), ("get_time", T)]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": </s>',
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ', []),
    ("mistral", "No tools needed.</s>", "No tools needed.", []),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(zone="UTC+1")]', None,
     [("get_weather", W), ("get_time", T)]),
    ("pythonic", '<|python_start|>[get_time(zone="UTC+1")]<|python_end|>', None, [("get_time", T)]),
    ("pythonic", '[get_weather(city="Paris", days=3), __import__("os").system("x")]',
     '[get_weather(city="Paris", days=3), __import__("os").system("x")]', []),
    ("pythonic", '[get_weather(city=open("x"))]', '[get_weather(city=open("x"))]', []),
    ("pythonic", "[get_weather(city='Paris'", "[get_weather(city='Paris'", []),
    ("pythonic", "Paris is sunny.", "Paris is sunny.", []),
    ("nanochat", "<|python_start|>12*34<|python_end|>", None, [("calculator", {"expression": "12*34"})]),
    ("nanochat", "Let me compute. <|python_start|>2+2<|python_end|>", "Let me compute. ",
     [("calculator", {"expression": "2+2"})]),
    ("nanochat", "<|python_start|><|python_end|>", "<|python_start|><|python_end|>", []),
    ("nanochat", "12*34 = 408.<|assistant_end|>", "12*34 = 408.", []),
]
SPECIAL = ["</s>", "<s>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|assistant_end|>", "<|python_start|>",
           "<|python_end|>"]


def _calls(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_parse(name, reply, content, calls):
    parsed = PARSERS[name](SPECIAL).parse(reply)
    assert parsed.content == content
    assert _calls(parsed.tool_calls) == calls
    assert all(c.id for c in parsed.tool_calls)
    if name == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in parsed.tool_calls)


@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_streamed_deltas_join_to_the_message(name, reply, content, calls):
    """Fed a few characters at a time (special tokens whole, as a token brings them)."""
    stream = ToolCallStream(PARSERS[name](SPECIAL))
    pieces, at = [], 0
    while at < len(reply):
        special = next((s for s in SPECIAL if reply.startswith(s, at)), None)
        step = len(special) if special else 3
        if not special:  # text pieces end where a special token begins
            step = min([step] + [i - at for s in SPECIAL if at < (i := reply.find(s, at)) < at + step])
        pieces.append(reply[at:at + step])
        at += step
    text, streamed, got = "", "", []
    for i, piece in enumerate(pieces):
        text += piece
        delta, new = stream.update(text, final=i == len(pieces) - 1)
        streamed += delta
        got += new
    assert (streamed or None) == content
    assert _calls(got) == calls


def test_hermes_streams_each_call_once_it_closes():
    stream = ToolCallStream(PARSERS["hermes"]([]))
    first = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}}\n</tool_call>'
    assert stream.update(first[:-3], final=False) == ("", [])
    _, calls = stream.update(first + "\n<tool_call>\n{", final=False)
    assert _calls(calls) == [("get_time", T)]


def test_parser_choices_match_the_flag():
    import argparse

    from nanoserve.args import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    action = next(a for a in p._actions if a.dest == "tool_call_parser")
    assert sorted(action.choices) == sorted(PARSERS)
