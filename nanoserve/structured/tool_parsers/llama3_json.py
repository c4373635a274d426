"""Llama 3.1 / 3.2 JSON tool calls: the reply is one or more JSON objects, separated by ";", optionally after the
<|python_tag|> token, and nothing else:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
"""

from nanoserve.structured.tool_parsers.arguments import WS, read_call, skip_ws
from nanoserve.structured.tool_parsers.base import ParsedReply, ToolParser, held_back
from nanoserve.structured.tool_parsers.grammar import calls_schema, json_rule, lark, regex_escape
from nanoserve.structured.tool_parsers.scan import SPACE, StreamFormat, json_head, lit, opt

PYTHON_TAG = "<|python_tag|>"
# What str.lstrip() strips (section_start reads a reply as calls after it), for the grammar's prose.
_SPACES = "".join(f"\\x{{{ord(c):x}}}" for c in map(chr, range(0x3001)) if c.isspace())


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    stream_formats = [StreamFormat([opt(PYTHON_TAG), SPACE, *json_head()],
                                   [SPACE, lit("}"), SPACE, lit(";"), SPACE, *json_head()], allow_string=True)]

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

    def stream_text(self, text: str) -> str:
        return self.scrub(text)

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        """All calls or none: anything that is not a call (text after them, a malformed object) makes the whole
        reply content, as vLLM does; so no call is known before the end."""
        body = self.scrub(text)
        start = self.section_start(body)
        if start is None or not final:
            return ParsedReply(self.clean(text) if start is None else None)
        at = start + len(PYTHON_TAG) if body.startswith(PYTHON_TAG, start) else start
        calls = []
        while (read := read_call(body, at)) is not None:
            calls.append(read[0])
            at = skip_ws(body, read[1])
            if not body[at:].strip(WS):
                return ParsedReply(None, calls)
            if not body.startswith(";", at):
                break
            at += 1
        return ParsedReply(self.clean(text))

    def strict_grammar(self, functions: list[tuple[str, dict]], parallel: bool, markers) -> str:
        # Prose may not start (after whitespace) with what section_start reads as calls: "{" or the tag's text.
        calls = 'calls: body (";" " "? body)*' if parallel else "calls: body"
        return lark(f"start: PROSE | {markers.ref(PYTHON_TAG)} calls | calls", calls,
                    f"PROSE: /(?s:.*)/ & ~/[{_SPACES}]*(\\{{|{regex_escape(PYTHON_TAG)})(?s:.*)/",
                    "body: " + json_rule(calls_schema(functions, "parameters")))
