"""Hermes-style tool calls (Qwen2.5, Qwen3, NousResearch Hermes, and more): each call is a JSON object between
<tool_call> and </tool_call>, possibly several, after optional text:

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from functools import lru_cache

from nanoserve.structured.tool_parsers.arguments import read_call, skip_ws
from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser, call_id
from nanoserve.structured.tool_parsers.grammar import calls_schema, json_rule, lark, text_without
from nanoserve.structured.tool_parsers.scan import SPACE, StreamFormat, json_head, lit, skip_to

START, END = "<tool_call>", "</tool_call>"
_HEAD = [SPACE, *json_head()]


class HermesParser(ToolParser):
    name = "hermes"
    section_marker = START
    markers = (START, END)
    # `<tool_call> {"name": "f", "arguments": ` ... `} </tool_call>`, any text, `<tool_call> {"name": ...`
    stream_formats = [StreamFormat([lit(START), *_HEAD], [SPACE, lit("}"), SPACE, lit(END), skip_to(START), *_HEAD],
                                   allow_string=True)]

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        """Each well-formed block is a call; a malformed one, and an unclosed last one that is not a call, stay in the
        content (an unclosed last block is read only once the reply is over: a model stopped by eos)."""
        calls, content, at, search = [], [], 0, 0
        while (start := text.find(START, search)) >= 0:
            block = _block(text, start, final)
            if block is not None:
                (name, arguments), end = block
                closed = text.startswith(END, end)
                if closed or final and end == len(text):
                    content.append(text[at:start])
                    calls.append(ToolCall(name, arguments, call_id()))
                    at = search = end + len(END) if closed else end
                    continue
            stop = text.find(END, start + len(START))
            if stop < 0:
                break
            search = stop + len(END)
        content.append(text[at:])
        return ParsedReply(self.clean("".join(content)) if calls else self.clean(text), calls)

    def strict_grammar(self, functions: list[tuple[str, dict]], parallel: bool, markers) -> str:
        call = f'call: head "\\n"? body "\\n"? {markers.ref(END)}'
        start = "start: call* prose" if parallel else "start: prose | call prose"
        return lark(start, call, *markers.prose(START), text_without([START]),
                    "body: " + json_rule(calls_schema(functions, "arguments")))


def _block(text: str, start: int, final: bool) -> tuple[tuple[str, str], int] | None:
    """The call of the block at text[start] ((name, arguments), where the text after its object's whitespace
    starts), or None. The usual block, up to the first END, is read once per distinct text (a stream reparses the
    same blocks at every step); one whose JSON holds END in a string is read from the whole text, and an unclosed one
    only once the reply is over."""
    stop = text.find(END, start + len(START))
    if stop >= 0:
        body = text[start + len(START):stop]
        call = _closed_block(body) if len(body) <= _CACHED else _read_block(body)
        if call is not None:
            return call, stop
    elif not final:
        return None
    read = read_call(text, start + len(START))
    if read is None:
        return None
    return (read[0].name, read[0].arguments), skip_ws(text, read[1])


def _read_block(body: str) -> tuple[str, str] | None:
    read = read_call(body, 0)
    if read is None or skip_ws(body, read[1]) != len(body):
        return None
    return read[0].name, read[0].arguments


_CACHED = 16384  # longer blocks are not kept
_closed_block = lru_cache(maxsize=256)(_read_block)
