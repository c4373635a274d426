"""The bundled model's calculator calls: <|python_start|>expression<|python_end|>, read as the function
`calculator` with arguments {"expression": ...}. Its chat template renders the call and a tool message with the
result back into the same tokens (<|output_start|>result<|output_end|>), so the calculator is an ordinary tool
of the chat API that the client runs.
"""

import json

from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser, call_id

START, END = "<|python_start|>", "<|python_end|>"
FUNCTION = "calculator"
# The tool as a client declares it (docs/server.md).
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": FUNCTION, "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class NanochatParser(ToolParser):
    name = "nanochat"
    section_marker = START
    needs_special_tokens = True
    markers = (START, END)
    strict_unsupported = ("the nanochat format writes a bare calculator expression, not JSON arguments, so no "
                          "schema can hold them")

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        start = self.section_start(text)
        if start is None:
            return ParsedReply(self.clean(text))
        expression, closed, _ = text[start + len(START):].partition(END)
        if not closed and not final:
            return ParsedReply(self.clean(text[:start]))
        if not expression.strip() or START in expression:
            return ParsedReply(self.clean(text))
        call = ToolCall(FUNCTION, json.dumps({"expression": self.scrub(expression).strip()}), call_id())
        return ParsedReply(self.clean(text[:start]), [call])
