"""Mistral tool calls, after the [TOOL_CALLS] special token, in either of Mistral's formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (tokenizers before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}  (v11 and later)

Mistral's chat templates want call ids of 9 alphanumeric characters.
"""

import json

from nanoserve.structured.tool_parsers.arguments import WS, canonical_arguments, read_call_list
from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser, mistral_call_id
from nanoserve.structured.tool_parsers.grammar import calls_schema, json_rule, lark, text_without
from nanoserve.structured.tool_parsers.scan import SPACE, StreamFormat, json_head, lit, raw_name

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    section_marker = BOT
    needs_special_tokens = True
    markers = (BOT, ARGS)
    stream_formats = [
        StreamFormat([lit(BOT), SPACE, lit("["), SPACE, *json_head()],
                     [SPACE, lit("}"), SPACE, lit(","), SPACE, *json_head()], allow_string=True),
        StreamFormat([lit(BOT), raw_name(ARGS, BOT)], [SPACE, lit(BOT), raw_name(ARGS, BOT)])]

    def new_id(self) -> str:
        return mistral_call_id()

    def stream_text(self, text: str) -> str:
        return self.scrub(text)

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        """Calls only once the reply is over (neither format says where its last call ends before that); a
        malformed section leaves the whole reply as content."""
        start = self.section_start(text)
        if start is None or not final:
            return ParsedReply(self.clean(text[:start] if start is not None else text))
        section = self.scrub(text[start:])
        body = section[len(BOT):].lstrip(WS)
        calls = read_call_list(body, 0) if body.startswith("[") else _args_form(section)
        if not calls:
            return ParsedReply(self.clean(text))
        for call in calls:
            call.id = self.new_id()
        return ParsedReply(self.clean(text[:start]), calls)

    def strict_grammar(self, functions: list[tuple[str, dict]], parallel: bool, markers) -> str:
        if markers.is_token(ARGS):  # v11: name[ARGS]{...} after each [TOOL_CALLS]
            calls = f"calls: head fn ({markers.ref(BOT)} fn)*" if parallel else "calls: head fn"
            fn = "fn: " + " | ".join(f"{json.dumps(name)} {markers.ref(ARGS)} {json_rule(parameters)}"
                                     for name, parameters in functions)
        else:
            array = {"type": "array", "items": calls_schema(functions, "arguments"), "minItems": 1}
            calls, fn = "calls: head fn", "fn: " + json_rule(array | ({} if parallel else {"maxItems": 1}))
        return lark("start: prose | calls", calls, fn, *markers.prose(BOT), text_without([BOT]))


def _args_form(section: str) -> list[ToolCall] | None:
    calls = []
    for part in section.split(BOT)[1:]:
        name, sep, args = part.partition(ARGS)
        arguments = canonical_arguments(args) if sep else None
        if not name.strip() or arguments is None:
            return None
        calls.append(ToolCall(name.strip(), arguments))
    return calls
