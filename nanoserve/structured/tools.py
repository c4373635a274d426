"""Tools in the chat API: the constraint tool_choice puts on a reply, reading a constrained reply back as calls, and
the streaming state of a reply read by a tool-call parser.

tool_choice "required" and a named function are enforced by a grammar, in vLLM's shapes, whatever the model's own
format: "required" makes the reply a JSON array of {"name", "parameters"} objects (one item without
parallel_tool_calls), each function's parameters valid against its schema; a named function makes the reply that
function's arguments object. So even a random-weight model returns a valid call. "auto" leaves the model free and
its reply goes through the tool-call parser (tool_parsers/).
"""

import json

from nanoserve.structured.params import StructuredOutputs
from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser, call_id

ANY_OBJECT = {"type": "object"}


def function_of(tool: dict) -> dict:
    return tool["function"]


def tool_choice_constraint(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool
                           ) -> StructuredOutputs | None:
    """The grammar for "required" or a named function ({"type": "function", "function": {"name"}}); None for
    "auto" and "none". Raises ValueError naming `tools` if a function's parameters are not a valid schema."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next(function_of(t) for t in tools if function_of(t)["name"] == name)
        return _constraint(function.get("parameters") or ANY_OBJECT)
    if tool_choice != "required":
        return None
    items = [{"type": "object", "properties": {"name": {"const": function_of(t)["name"]},
                                               "parameters": function_of(t).get("parameters") or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return _constraint(schema)


def _constraint(schema: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema)
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured_outputs.json", "tools", 1)) from None


def forced_reply(text: str, tool_choice: str | dict) -> ParsedReply:
    """The calls in a reply that "required" or a named function constrained. Only a reply cut short (max_tokens, a
    stop string) fails to parse: it is then content."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return ParsedReply(text or None)
    if isinstance(tool_choice, dict):
        return ParsedReply(None, [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False),
                                           call_id())])
    return ParsedReply(None, [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False), call_id())
                              for item in value])


class ToolCallStream:
    """One choice of a stream whose reply a tool-call parser reads: content deltas until the tool-call section
    starts (holding back what could be the start of its marker), then each call once the parser knows it complete.
    The deltas join to the message the reply gets unstreamed (the parser's contract, tool_parsers/base.py)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = ""
        self.num_calls = 0

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, calls new since the last update) for the reply's text so far."""
        parsed = None
        if final:
            parsed = self.parser.parse(text, final=True)
            content = parsed.content or ""
        else:
            start = self.parser.section_start(text)
            if start is None:
                content = self.parser.scrub(text[:len(text) - self.parser.may_start(text)])
            else:
                content = self.parser.scrub(text[:start])
                parsed = self.parser.parse(text, final=False)
            if not content.strip():
                content = ""  # whitespace alone is held: a reply of calls only has no content
        delta = content[len(self.sent_content):] if content.startswith(self.sent_content) else ""
        self.sent_content += delta
        calls = parsed.tool_calls[self.num_calls:] if parsed is not None else []
        self.num_calls += len(calls)
        return delta, calls
