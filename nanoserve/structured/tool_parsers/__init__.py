"""Tool-call parsers by name (`--tool-call-parser NAME`), one module per model family's format."""

from nanoserve.structured.tool_parsers.base import ParsedReply, ToolCall, ToolParser
from nanoserve.structured.tool_parsers.hermes import HermesParser
from nanoserve.structured.tool_parsers.llama3_json import Llama3JsonParser
from nanoserve.structured.tool_parsers.mistral import MistralParser
from nanoserve.structured.tool_parsers.nanochat import NanochatParser
from nanoserve.structured.tool_parsers.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser,
                                                           PythonicParser, NanochatParser)}

__all__ = ["PARSERS", "ParsedReply", "ToolCall", "ToolParser"]
