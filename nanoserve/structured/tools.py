"""Tools in the chat API: the constraint tool_choice (or a strict tool) puts on a reply, reading a reply back as
calls, and the streaming state of a reply read so.

tool_choice "required" and a named function are enforced by a grammar, in vLLM's shapes, whatever the model's own
format: "required" makes the reply a JSON array of {"name", "parameters"} objects (one item without
parallel_tool_calls), each function's parameters valid against its schema; a named function makes the reply that
function's arguments object. So even a random-weight model returns a valid call. "auto" leaves the model free and
its reply goes through the tool-call parser (tool_parsers/); if a tool is marked `strict`, "auto" is enforced too:
the reply is free text or calls in the parser's own format, every call to a listed function and each strict one's
arguments valid against its schema (the parser's strict_grammar); a parser whose format cannot hold that refuses.
"""

from dataclasses import dataclass, field

from nanoserve.structured.params import StructuredOutputs
from nanoserve.structured.tool_parsers.arguments import canonical_arguments, read_call_list
from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser, call_id
from nanoserve.structured.tool_parsers.grammar import Markers
from nanoserve.structured.tool_parsers.scan import SPACE, CallScanner, StreamFormat, fixed_name, json_head, lit

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


def strict_auto_constraint(tools: list[dict], parser: ToolParser, parallel_tool_calls: bool,
                           markers: Markers) -> StructuredOutputs | None:
    """The grammar for tool_choice "auto" when a tool has `function.strict` true (None when none has): the reply is
    free text or calls in the parser's format, to listed functions only, a strict function's arguments valid against
    its schema (another's any object), at most one call without parallel_tool_calls. Raises ValueError naming the
    first strict tool's `strict` if the parser's format cannot hold that, or `tools` for a bad schema."""
    strict = [i for i, t in enumerate(tools) if function_of(t).get("strict")]
    if not strict:
        return None
    if parser.strict_unsupported:
        raise ValueError(f"tools.{strict[0]}.function.strict: strict tools under tool_choice \"auto\" are not "
                         f"supported with the {parser.name} tool-call parser: {parser.strict_unsupported}; send "
                         f"strict: false, or tool_choice \"required\" or a named function (always enforced)")
    functions = []
    for i, tool in enumerate(tools):
        parameters = function_of(tool).get("parameters") or ANY_OBJECT
        if i in strict:
            _constraint(parameters)  # a bad schema is a 400 naming tools, with the library's message
        functions.append((function_of(tool)["name"], parameters if i in strict else ANY_OBJECT))
    try:
        return StructuredOutputs(grammar=parser.strict_grammar(functions, parallel_tool_calls, markers))
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured_outputs.grammar", "tools", 1)) from None


def _constraint(schema: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs(json=schema)
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured_outputs.json", "tools", 1)) from None


class NamedReply(ToolParser):
    """Reads a reply a named tool_choice constrained: the function's arguments object. Only a reply cut short (by
    max_tokens, a stop string) is not one: it is then content."""

    name = "named"

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function
        self.stream_formats = [StreamFormat([fixed_name(function)], None)]

    def section_start(self, text: str) -> int | None:
        return 0

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        arguments = canonical_arguments(text) if final else None
        if arguments is None:
            return ParsedReply(text or None if final else None)
        return ParsedReply(None, [ToolCall(self.function, arguments, call_id())])


class RequiredReply(ToolParser):
    """Reads a reply tool_choice "required" constrained: [{"name": ..., "parameters": {...}}, ...]."""

    name = "required"
    stream_formats = [StreamFormat([SPACE, lit("["), SPACE, *json_head(("parameters",))],
                                   [SPACE, lit("}"), SPACE, lit(","), SPACE, *json_head(("parameters",))])]

    def section_start(self, text: str) -> int | None:
        return 0

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        calls = read_call_list(text, 0, ("parameters",)) if final else None
        return ParsedReply(None, calls) if calls else ParsedReply(text or None if final else None)


def forced_parser(tool_choice: str | dict) -> ToolParser:
    """The reader of a reply that "required" or a named function ({"type": "function", "function": {"name"}})
    constrained."""
    return NamedReply(tool_choice["function"]["name"]) if isinstance(tool_choice, dict) else RequiredReply()


@dataclass
class _SentCall:
    name: str
    arguments: str = ""  # sent so far


@dataclass
class ToolCallStream:
    """One choice of a stream whose reply a parser reads: content deltas until the tool-call section starts (holding
    back what could be the start of its marker); then each call's first delta (index, id, type, name, and the start
    of its arguments) as soon as its arguments begin, and argument pieces as the tokens bring them, where the
    parser's format allows (stream_formats); else each call whole once the parser knows it complete.

    The deltas join to the message the reply gets unstreamed (`reply`, set by the final update): the same parse of
    the same text, and arguments read by the same reader. A call found malformed after it began (a reply cut by
    max_tokens inside it, say) cannot be taken back: the stream keeps what it sent of it, and its text comes as
    content at the end, as in the unstreamed message, which has no such call."""

    parser: ToolParser
    sent_content: str = ""
    calls: list[_SentCall] = field(default_factory=list)  # by index
    matched: list[int] = field(default_factory=list)  # the stream's index of each call the parser has completed
    scanner: CallScanner | None = None
    reply: ParsedReply | None = None

    def update(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) for the reply's text so far: each delta is one element of a chunk's
        `tool_calls` ({"index", "id", "type", "function": {"name", "arguments"}} first, then {"index", "function":
        {"arguments"}}), one per call that moved."""
        deltas: dict[int, dict] = {}
        start = self.parser.section_start(text)
        if final:
            parsed = self.reply = self.parser.parse(text, final=True)
            content = parsed.content or ""
        elif start is None:
            parsed, content = None, self.parser.scrub(text[:len(text) - self.parser.may_start(text)])
        else:
            parsed, content = self.parser.parse(text, final=False), self.parser.scrub(text[:start])
        if not final and not content.strip():
            content = ""  # whitespace alone is held: a reply of calls only has no content
        delta = content[len(self.sent_content):] if content.startswith(self.sent_content) else ""
        self.sent_content += delta
        if start is not None or final:
            self._scan(text, final, deltas)
        for call in parsed.tool_calls[len(self.matched):] if parsed is not None else []:
            self._complete(call, deltas)
        return delta, [deltas[i] for i in sorted(deltas)]

    def _scan(self, text: str, final: bool, deltas: dict[int, dict]) -> None:
        if self.scanner is None and not self.parser.stream_formats:
            return
        scanned = self.parser.stream_text(text)
        if self.scanner is None:
            start = self.parser.section_start(scanned)
            if start is None:
                return
            self.scanner = CallScanner(self.parser.stream_formats, start)
        for index, name, piece in self.scanner.advance(scanned, final):
            if name is not None:
                self._new(name, self.parser.new_id(), piece, deltas)
            else:
                self._more(index, piece, deltas)

    def _complete(self, call: ToolCall, deltas: dict[int, dict]) -> None:
        """A call the parser has read whole: the rest of the one streamed for it, or all of it."""
        index = self.matched[-1] + 1 if self.matched else 0
        sent = self.calls[index] if index < len(self.calls) else None
        if sent is not None and sent.name == call.name and call.arguments.startswith(sent.arguments):
            self._more(index, call.arguments[len(sent.arguments):], deltas)
        else:
            # The scanner missed this call (a layout it does not stream) or read another (one the parser found
            # malformed): calls from here on come whole, after those sent.
            if self.scanner is not None:
                self.scanner.stop()
            index = len(self.calls)
            self._new(call.name, call.id, call.arguments, deltas)
        self.matched.append(index)

    def _new(self, name: str, call_id_: str, arguments: str, deltas: dict[int, dict]) -> None:
        index = len(self.calls)
        self.calls.append(_SentCall(name, arguments))
        deltas[index] = {"index": index, "id": call_id_, "type": "function",
                         "function": {"name": name, "arguments": arguments}}

    def _more(self, index: int, piece: str, deltas: dict[int, dict]) -> None:
        if not piece:
            return
        self.calls[index].arguments += piece
        if index in deltas:
            deltas[index]["function"]["arguments"] += piece
        else:
            deltas[index] = {"index": index, "function": {"arguments": piece}}
