"""Mistral tool calls, after the [TOOL_CALLS] special token, in either of Mistral's formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]      (tokenizers before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}  (v11 and later)

Mistral's chat templates want call ids of 9 alphanumeric characters.
"""

import json

from nanoserve.structured.tool_parsers.base import (
    ParsedReply,
    ToolCall,
    ToolParser,
    arguments_text,
    call_from_json,
    mistral_call_id,
)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    section_marker = BOT
    needs_special_tokens = True
    markers = (BOT, ARGS)

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        """Calls only once the reply is over (neither format says where its last call ends before that); a
        malformed section leaves the whole reply as content."""
        start = self.section_start(text)
        if start is None or not final:
            return ParsedReply(self.clean(text[:start] if start is not None else text))
        section = self.scrub(text[start:])
        body = section[len(BOT):].strip()
        calls = _array_form(body) if body.startswith("[") else _args_form(section)
        if not calls:
            return ParsedReply(self.clean(text))
        for call in calls:
            call.id = mistral_call_id()
        return ParsedReply(self.clean(text[:start]), calls)


def _array_form(body: str) -> list[ToolCall] | None:
    try:
        items = json.loads(body)
    except json.JSONDecodeError:
        return None
    calls = [call_from_json(item) for item in items] if isinstance(items, list) else [None]
    return None if not calls or None in calls else calls


def _args_form(section: str) -> list[ToolCall] | None:
    calls = []
    for part in section.split(BOT)[1:]:
        name, sep, args = part.partition(ARGS)
        arguments = arguments_text(args.strip()) if sep else None
        if not name.strip() or arguments is None:
            return None
        calls.append(ToolCall(name.strip(), arguments))
    return calls
