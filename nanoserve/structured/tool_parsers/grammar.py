"""Pieces of the llguidance (Lark) grammars that hold strict tools under tool_choice "auto": free text, and calls in
the parser's format whose JSON follows the tools' schemas (each parser's `strict_grammar` puts them together).

A marker that starts the calls (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`) is written either as one added
token of the tokenizer (llguidance takes every added token as a special token, which no text lexeme can produce:
the grammar names it `<[id]>`), or, where the tokenizer has no such token, as text, behind a lazy lexeme: the text
before it ends at the marker's first occurrence, and what follows is held to the grammar (llguidance's "tool
calling" construction, docs/syntax.md). Either way the free text may not contain the marker's characters, so a model
cannot spell out a call the grammar does not hold. The tokenizer's other added tokens may come in the free text
(between text lexemes), but eos, which ends the reply wherever the grammar is complete.
"""

import json

from nanoserve.structured.params import JSON_WHITESPACE

_REGEX_SPECIAL = set("\\.+*?()|[]{}^$/-&~#")


def regex_escape(text: str) -> str:
    """`text` as a literal inside a Lark /regex/ (Rust's regex syntax, which takes a backslash before punctuation)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


class Markers:
    """How a format's markers are written in a grammar for one tokenizer: `added` maps the text of each added token
    to its id; `eos` are the end-of-sequence ids (which end a reply, never part of it)."""

    def __init__(self, added: dict[str, int] | None = None, eos: list[int] | tuple[int, ...] = ()) -> None:
        self.added = dict(added or {})
        self.eos = set(eos)

    def is_token(self, marker: str) -> bool:
        return marker in self.added

    def ref(self, marker: str) -> str:
        return f"<[{self.added[marker]}]>" if marker in self.added else json.dumps(marker)

    def prose(self, trigger: str) -> list[str]:
        """Rules `prose` (free text, and the tokenizer's other added tokens: a reasoning model's <think>, say) and
        `head` (prose up to and including `trigger`, the marker that starts calls; text lexemes before a marker
        that is text are lazy, so they end at its first occurrence)."""
        ids = sorted(i for text, i in self.added.items() if text != trigger and i not in self.eos)
        if not ids:
            rules = ["prose: TEXT", "head: trigger"]
        else:
            rules = ["prose: TEXT (other TEXT)*", "head: (TEXT other)* trigger", f"other: <[{_ranges(ids)}]>"]
        lazy = "" if self.is_token(trigger) else "[lazy]"
        return [*rules, f"trigger{lazy}: TEXT {self.ref(trigger)}"]


def _ranges(ids: list[int]) -> str:
    """Sorted token ids as llguidance's list of ranges: 3,7-9."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def text_without(markers: list[str]) -> str:
    """A terminal: any text (the empty one too) that does not contain any of `markers`."""
    alternatives = "|".join(regex_escape(m) for m in markers)
    return f"TEXT: /(?s:.*)/ & ~/(?s:.*)({alternatives})(?s:.*)/"


def json_rule(schema: dict) -> str:
    """A %json rule for `schema`, with the whitespace structured output allows between JSON tokens (params.py)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})


def calls_schema(functions: list[tuple[str, dict]], args_key: str) -> dict:
    """One call object {"name": <a function's name>, args_key: <its arguments>}, in the order name, arguments."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, args_key: parameters},
                       "required": ["name", args_key], "additionalProperties": False}
                      for name, parameters in functions]}


def lark(*lines: str) -> str:
    return "\n".join(["%llguidance {}", *lines]) + "\n"
