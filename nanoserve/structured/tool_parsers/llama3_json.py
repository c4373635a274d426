"""Llama 3.1 / 3.2 JSON tool calls: the reply is one or more JSON objects, separated by ";", optionally after the
<|python_tag|> token, and nothing else:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
"""

import json

from nanoserve.structured.tool_parsers.base import ParsedReply, ToolParser, call_from_json, held_back

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def may_start(self, text: str) -> int:
        # A reply is calls only if it starts with one: hold back leading whitespace and a partial tag.
        stripped = text.lstrip()
        if not stripped or held_back(stripped, PYTHON_TAG) == len(stripped):
            return len(text)
        return 0

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        """All calls or none: anything that is not a call (text after them, a malformed object) makes the whole
        reply content, as vLLM does; so no call is known before the end."""
        start = self.section_start(text)
        if start is None or not final:
            return ParsedReply(self.clean(text) if start is None else None)
        body = self.scrub(text[start:]).strip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                break
            call = call_from_json(obj)
            if call is None:
                break
            rest = body[end:].lstrip()
            calls.append(call)
            if not rest:
                return ParsedReply(None, calls)
            if not rest.startswith(";"):
                break
            at = len(body) - len(rest) + 1
            while at < len(body) and body[at].isspace():
                at += 1
        return ParsedReply(self.clean(text))
