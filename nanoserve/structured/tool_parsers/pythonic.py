"""Pythonic tool calls (Llama 3.2 and Llama 4 in their pythonic templates, and others): the reply is a Python list of
calls with keyword arguments of literal values, optionally between <|python_start|> and <|python_end|>:

    [get_weather(city="Paris", days=3), get_time()]

Read with `ast` (literals only: nothing is evaluated).
"""

import ast
import json

from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser, call_id, held_back

START, END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = (START, END)
    strict_unsupported = ("the pythonic format writes arguments as Python literals, which a JSON schema cannot "
                          "hold")

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("[", START)) else None

    def may_start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or held_back(stripped, START) == len(stripped):
            return len(text)
        return 0

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        start = self.section_start(text)
        if start is None or not final:
            return ParsedReply(None if start is not None else self.clean(text))
        body = self.scrub(text[start:]).strip()
        body = body.removeprefix(START).removesuffix(END).strip()
        calls = _calls(body)
        return ParsedReply(None, calls) if calls else ParsedReply(self.clean(text))


def _calls(body: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(node.keywords):
            return None  # **kwargs
        try:
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False), call_id()))
        except TypeError:  # a set, bytes ...: not JSON
            return None
    return calls
