"""Each tool-call parser on replies written by hand from its model family's published format, malformed ones
included (they come back as content), and streamed: the deltas join to the unstreamed message, and the arguments
of hermes, llama3_json, mistral and the tool_choice-forced replies come in pieces as they are written. The
canonical arguments text and its reader."""

import json
from dataclasses import dataclass, field

import pytest

from nanoserve.structured.tool_parsers import PARSERS
from nanoserve.structured.tool_parsers.arguments import ArgumentsReader, canonical_arguments
from nanoserve.structured.tools import ToolCallStream, forced_parser

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


def _pieces(reply: str, size: int) -> list[str]:
    """`reply` cut into pieces of `size` characters, as tokens bring them: special tokens whole, and text pieces end
    where one begins."""
    pieces, at = [], 0
    while at < len(reply):
        special = next((s for s in SPECIAL if reply.startswith(s, at)), None)
        step = len(special) if special else size
        if not special:
            step = min([step] + [i - at for s in SPECIAL if at < (i := reply.find(s, at)) < at + step])
        pieces.append(reply[at:at + step])
        at += step
    return pieces


@dataclass
class Streamed:
    content: str = ""
    calls: list[dict] = field(default_factory=list)  # by index: id, name, arguments, pieces (argument deltas)
    open_calls: int = 0  # calls whose first delta came before the reply ended
    matched: list[int] = field(default_factory=list)  # the index of each call of the message

    def message_calls(self) -> list[tuple[str, str]]:
        return [(self.calls[i]["name"], self.calls[i]["arguments"]) for i in self.matched]


def _stream(parser, pieces: list[str]) -> Streamed:
    """Feed `pieces` to a ToolCallStream and join its deltas as a client does, checking their shape: a call's first
    delta has index, id, type and name, the later ones index and arguments only."""
    stream, out, text = ToolCallStream(parser), Streamed(), ""
    for i, piece in enumerate(pieces):
        text += piece
        final = i == len(pieces) - 1
        content, deltas = stream.update(text, final=final)
        out.content += content
        assert [d["index"] for d in deltas] == sorted({d["index"] for d in deltas})
        for d in deltas:
            if d["index"] == len(out.calls):
                assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function" and d["id"]
                out.calls.append({"name": d["function"]["name"], "arguments": "", "pieces": 0})
                out.open_calls += not final
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            call = out.calls[d["index"]]
            call["arguments"] += d["function"]["arguments"]
            call["pieces"] += bool(d["function"]["arguments"])
    out.matched = stream.matched
    return out


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(("name", "reply", "content", "calls"), CASES)
def test_streamed_deltas_join_to_the_message(name, reply, content, calls, size):
    """Fed a character at a time, a few, or whole: the deltas join to exactly the unstreamed message (but for a
    malformed call that began to stream: see the test after next)."""
    whole = PARSERS[name](SPECIAL).parse(reply)
    streamed = _stream(PARSERS[name](SPECIAL), _pieces(reply, size))
    assert (streamed.content or None) == content == whole.content
    assert streamed.message_calls() == [(c.name, c.arguments) for c in whole.tool_calls]
    assert len(streamed.calls) == len(whole.tool_calls) or not whole.tool_calls
    assert _calls(whole.tool_calls) == calls


LONG = {"city": "Paris", "days": 3, "note": "x" * 40 + ' "quoted" \\ \u00e9\u65e5 \\n', "tags": ["a", "b"],
        "deep": {"k": [1, -2.5e3, True, False, None, {}]}}
STREAMING = [  # a long call (and a short one) in each format whose arguments stream
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(LONG, indent=1) +
     '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC+1"}}\n</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(json.dumps(LONG)) + '}</tool_call>'
               'then <tool_call>{"name": "get_time", "parameters": "{\\"zone\\": \\"UTC+1\\"}"}</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(LONG) +
     '}; {"name": "get_time", "parameters": {"zone": "UTC+1"}}<|eom_id|>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(LONG, separators=(",", ":")) +
     '}, {"name": "get_time", "arguments": {"zone": "UTC+1"}}]</s>'),
    ("mistral", 'Ok. [TOOL_CALLS]get_weather[ARGS]' + json.dumps(LONG, indent=2) +
     '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC+1"}</s>'),
]


@pytest.mark.parametrize(("name", "reply"), STREAMING)
def test_arguments_stream_in_pieces(name, reply):
    """Token by token (here: character by character), each call's first delta comes as soon as its arguments begin,
    then the arguments in many pieces, before the reply ends; joined they are exactly the unstreamed message's."""
    parser = PARSERS[name](SPECIAL + ["<|eom_id|>"])
    whole = parser.parse(reply)
    assert _calls(whole.tool_calls)[0] == ("get_weather", LONG) and len(whole.tool_calls) == 2
    streamed = _stream(parser, _pieces(reply, 1))
    assert streamed.open_calls == 2 and streamed.calls[0]["pieces"] > 20
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert streamed.matched == [0, 1]
    assert (streamed.content or None) == whole.content


@pytest.mark.parametrize(("tool_choice", "reply"), [
    ("required", '[{"name": "get_weather", "parameters": ' + json.dumps(LONG) + '},\n {"name": "get_time", '
                 '"parameters": {"zone": "UTC+1"}}]'),
    ({"type": "function", "function": {"name": "get_weather"}}, json.dumps(LONG, indent=2)),
])
def test_forced_replies_stream_in_pieces(tool_choice, reply):
    parser = forced_parser(tool_choice)
    whole = parser.parse(reply)
    assert _calls(whole.tool_calls)[0] == ("get_weather", LONG)
    streamed = _stream(parser, _pieces(reply, 1))
    assert streamed.open_calls == len(whole.tool_calls) and streamed.calls[0]["pieces"] > 20
    assert [(c["name"], c["arguments"]) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    assert streamed.content == ""
    cut = forced_parser(tool_choice).parse(reply[:50])  # cut short by max_tokens: content
    assert cut.content == reply[:50] and not cut.tool_calls


@pytest.mark.parametrize("reply", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "da',  # cut by max_tokens
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}} junk</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}</tool_call>',
])
def test_a_call_found_malformed_after_it_began_comes_back_as_content(reply):
    """Its first delta and pieces went out (they cannot be taken back), and the text comes as content, as in the
    unstreamed message."""
    whole = PARSERS["hermes"]([]).parse(reply)
    assert whole.content == reply and not whole.tool_calls
    streamed = _stream(PARSERS["hermes"]([]), _pieces(reply, 1))
    assert streamed.content == reply and streamed.calls[0]["name"] == "get_weather"


def test_calls_the_scanner_cannot_stream_come_whole_once_closed():
    """A call whose object starts with another key than "name" (or a malformed block) comes whole when the parser
    knows it complete; the calls after it come whole too, and all join to the message."""
    reply = ('<tool_call>{"arguments": {"zone": "UTC+1"}, "name": "get_time"}</tool_call><tool_call>oops</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    stream, got = ToolCallStream(PARSERS["hermes"]([])), []
    first = reply.index("</tool_call>") + len("</tool_call>")
    for i in range(1, len(reply) + 1):
        _, deltas = stream.update(reply[:i], final=i == len(reply))
        got += [(i, d) for d in deltas]
    assert got[0][0] == first and got[0][1]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC+1"}'}
    assert [d["function"]["name"] for _, d in got] == ["get_time", "get_weather"]


@pytest.mark.parametrize("text", [
    '{"a": 1}', ' {\n  "a" : [1, 2.5, -0.03, true, false, null],\n  "b": {"c": {}} , "d": []\n} ',
    '{"s": "tab\\there \\"q\\" \\\\ \\/ \\u00e9 \\ud83d\\ude00 \\ud800 x \\u001f"}', '{"日本": "語", "e": "😀"}',
    '{"dup": 1, "dup": 2}', '{"n": 1.50, "m": 10E+2, "z": -0}',
])
def test_arguments_are_canonical_and_read_the_same_in_any_pieces(text):
    whole = canonical_arguments(text)
    assert whole is not None and json.loads(whole) == json.loads(text)
    if '"dup"' not in text and "1.50" not in text:  # else: the keys and numbers as the model wrote them
        assert whole == json.dumps(json.loads(text), ensure_ascii=False).replace("\ud800", "\\ud800")
    for size in (1, 2, 5):
        reader = ArgumentsReader()
        assert "".join(reader.feed(text[i:i + size]) for i in range(0, len(text), size)) == whole
        assert reader.done
    wrapped = ArgumentsReader(allow_string=True)
    assert "".join(wrapped.feed(c) for c in json.dumps(text)) == whole and wrapped.done


@pytest.mark.parametrize("text", ['{"a": 1,}', "{'a': 1}", '{"a": NaN}', '{"a": 01}', '{"a": "x\ny"}', "[1]",
                                  '{"a": 1} 2', '{"a" 1}', '{"a": tru}', '{"a": 1.}', '"{\\"a\\": 1}"', "",
                                  '{"a": "\\x"}'])
def test_arguments_that_are_not_one_json_object_are_refused(text):
    assert canonical_arguments(text) is None


def test_parser_choices_match_the_flag():
    import argparse

    from nanoserve.args import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    action = next(a for a in p._actions if a.dest == "tool_call_parser")
    assert sorted(action.choices) == sorted(PARSERS)
