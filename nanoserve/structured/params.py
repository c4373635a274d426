"""StructuredOutputs: the constraint a request puts on its output (SamplingParams.structured_outputs).

Exactly one of json (a JSON schema, as a dict or its text), json_object (any JSON object), regex, choice (one of
these strings) or grammar (Lark, or llama.cpp's GBNF) is given, as in vLLM's `structured_outputs`. On construction
it is turned into llguidance's grammar text and checked (a bad schema, regex or grammar is a ValueError naming the
field, with the library's message), so a caller learns at once; the engine compiles it against its tokenizer
(structured/backend.py). Nothing here needs a tokenizer or the engine.
"""

import json
from dataclasses import dataclass, field, fields
from typing import Any

import llguidance

# Whitespace allowed between JSON tokens: nothing, one space, or one newline and an indent. Free whitespace lets a
# weak (or random-weight) model write "\r\t \n\n..." until max_tokens; these cover compact, `{"a": 1}` and
# pretty-printed JSON.
JSON_WHITESPACE = r"(?:\n[ \t]{0,16}| )?"
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    json: dict | str | None = None  # a JSON schema
    json_object: bool = False  # any JSON object (response_format {"type": "json_object"})
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (vLLM's flag)
    # llguidance's grammar text, built from the above on construction; what the engine compiles and caches by.
    compiled: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) or 'none'}")
        kind = given[0]
        self.compiled = self._grammar(kind)
        error = llguidance.LLMatcher.validate_grammar(self.compiled)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {_first_lines(error)}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.init}

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def _grammar(self, kind: str) -> str:
        options = ({"whitespace_flexible": False} if self.disable_any_whitespace
                   else {"whitespace_pattern": JSON_WHITESPACE})
        if kind == "json":
            schema = _json_schema(self.json)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex: must be a non-empty string, got {self.regex!r}")
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice: must be a list of non-empty strings, got {self.choice!r}")
            # Each choice as a Lark string literal (JSON's escaping is Lark's).
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError(f"structured_outputs.grammar: must be a non-empty string, got {self.grammar!r}")
        try:
            return llguidance.grammar_from("grammar", self.grammar)  # Lark as it is; GBNF converted to Lark
        except ValueError as exc:
            raise ValueError(f"structured_outputs.grammar: {_first_lines(str(exc))}") from None


def _json_schema(schema: Any) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json: a JSON schema must be an object, got {type(schema).__name__}")
    return schema


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance's messages, trimmed for an HTTP error (they can quote a whole grammar)."""
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + " ..."
