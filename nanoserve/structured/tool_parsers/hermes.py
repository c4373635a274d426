"""Hermes-style tool calls (Qwen2.5, Qwen3, NousResearch Hermes, and more): each call is a JSON object between
<tool_call> and </tool_call>, possibly several, after optional text:

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

import json
import re

from nanoserve.structured.tool_parsers.base import ParsedReply, ToolParser, call_from_json

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    section_marker = START

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        """Each well-formed block is a call; a malformed one, and an unclosed last one that is not valid JSON, stay in
        the content (an unclosed last block is read only once the reply is over: a model stopped by eos)."""
        calls, content, at = [], [], 0
        for match in _BLOCK.finditer(text):
            call = _call(match.group(1))
            if call is None:
                continue
            content.append(text[at:match.start()])
            calls.append(call)
            at = match.end()
        rest = text[at:]
        tail = rest.find(START)
        if final and tail >= 0 and END not in rest[tail:] and (call := _call(rest[tail + len(START):])) is not None:
            calls.append(call)
            rest = rest[:tail]
        content.append(rest)
        return ParsedReply(self.clean("".join(content)) if calls else self.clean(text), calls)


def _call(body: str):
    try:
        return call_from_json(json.loads(body))
    except json.JSONDecodeError:
        return None
