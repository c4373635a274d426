"""What every tool-call parser shares: the parsed shapes, call ids, argument normalizing, and the streaming state.

A parser turns a model's whole reply into (content, tool calls) in the format of the model family it serves; what
it cannot read as a call stays content (a malformed call is never an error). For streaming, a parser also says
where its tool-call section starts (`section_start`), which calls of an unfinished reply are complete already
(`parse(text, final=False)` returns only calls that the final parse returns too), and, where its format allows,
how to read a call's arguments while they are written (`stream_formats`, scan.py), so that a stream's deltas join
to the message the same request gets unstreamed. Arguments are arguments.py's canonical text of the object the
model wrote.

With a tool marked `strict`, tool_choice "auto" holds the reply to `strict_grammar`: free text, or calls in the
parser's format whose JSON follows the tools' schemas (grammar.py); a format that cannot hold them says why in
`strict_unsupported`.
"""

import secrets
import string
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class ToolParser:
    """Base class: subclasses set `name` and implement `parse`, and either set `section_marker` (the calls start at
    its first occurrence) or implement `section_start` and `may_start`."""

    name = ""
    section_marker = ""
    needs_special_tokens = False  # its markers are special tokens, which the text must keep
    markers: tuple[str, ...] = ()  # its own markers, which scrub() keeps
    stream_formats: list = []  # scan.StreamFormat: how its calls' arguments stream (none: each call comes whole)
    strict_unsupported = ""  # why its format cannot hold strict tools under "auto" (empty: it can)

    def __init__(self, special_tokens: list[str] | None = None) -> None:
        # Special tokens' text that must not reach content when the reply keeps special tokens (eos, say).
        self.special_tokens = [t for t in special_tokens or [] if t and t not in self.markers]

    def section_start(self, text: str) -> int | None:
        """Where the tool-call section of `text` starts; None if it has none yet."""
        if not self.section_marker:
            raise NotImplementedError
        at = text.find(self.section_marker)
        return None if at < 0 else at

    def may_start(self, text: str) -> int:
        """How many characters at the end of `text` could begin a section's marker (a stream holds them back)."""
        return held_back(text, self.section_marker) if self.section_marker else 0

    def parse(self, text: str, final: bool = True) -> ParsedReply:
        raise NotImplementedError

    def stream_text(self, text: str) -> str:
        """The text its stream_formats are matched on (a parser that reads its section without special tokens'
        text scrubs it)."""
        return text

    def new_id(self) -> str:
        return call_id()

    def strict_grammar(self, functions: list[tuple[str, dict]], parallel: bool, markers) -> str:
        """The grammar (Lark) that holds a reply to free text or calls of `functions` ((name, arguments schema)),
        at most one call unless `parallel`; `markers` (grammar.Markers) says which of its markers are tokens."""
        raise NotImplementedError

    def scrub(self, text: str) -> str:
        """`text` without special tokens' text."""
        for token in self.special_tokens:
            text = text.replace(token, "")
        return text

    def clean(self, content: str | None) -> str | None:
        """Content without special tokens' text, and None when only whitespace is left."""
        if content is None:
            return None
        content = self.scrub(content)
        return content if content.strip() else None


def held_back(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def mistral_call_id() -> str:
    """Mistral's templates want 9 alphanumeric characters."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
