"""Reading tool calls while a reply streams: each call's name as soon as its head is written, then its arguments in
pieces as the tokens arrive (arguments.py's canonical text, the same the whole reply's parse gives).

A parser that can stream so describes its calls' layout by `StreamFormat`s: the sequence of pieces before a call's
arguments object (`first`), and the sequence between one call's arguments and the next call's (`next`: the rest of
the call, a separator, the next head). The pieces are literals, optional literals, JSON whitespace, a choice of
literals, a JSON string (the function's name), raw text up to a literal (a name written bare), and any text up to a
literal (text between calls). `CallScanner` matches them on a growing text: a piece the text ends inside of waits for
more; one the text cannot match stops the scanning for good, and the parser's own parse of the finished reply is
left to say what is a call (the stream then sends the rest of its calls whole, tools.ToolCallStream).
"""

import json
import re
from dataclasses import dataclass

from nanoserve.structured.tool_parsers.arguments import WS, ArgumentsReader

# Pieces of a format (tuples, matched by `match`).
SPACE = ("ws",)
NAME = ("name",)  # a JSON string: the function's name


def lit(text: str) -> tuple:
    return ("lit", text)


def opt(text: str) -> tuple:
    return ("opt", text)


def alt(*texts: str) -> tuple:
    return ("alt", texts)


def raw_name(until: str, forbidden: str) -> tuple:
    """The function's name as bare text up to `until` (stripped, not empty, without `forbidden`)."""
    return ("raw", until, forbidden)


def skip_to(text: str) -> tuple:
    """Any text, up to and including `text`."""
    return ("skip", text)


def fixed_name(name: str) -> tuple:
    """The function's name is known already (a tool_choice naming it): nothing is read."""
    return ("fixed", name)


def json_head(args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[tuple]:
    """`{"name": "<name>", "<args key>": ` with JSON whitespace anywhere between."""
    return [lit("{"), SPACE, lit('"name"'), SPACE, lit(":"), SPACE, NAME, SPACE, lit(","), SPACE,
            alt(*(json.dumps(k) for k in args_keys)), SPACE, lit(":")]


@dataclass(frozen=True)
class StreamFormat:
    first: list[tuple]  # from the start of the tool-call section to the first call's arguments
    next: list[tuple] | None  # from a call's arguments' end to the next call's arguments; None: one call only
    allow_string: bool = False  # arguments may be a JSON string holding the object


_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_STRING_PREFIX = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
WAIT, FAIL = "wait", "fail"


def match(pieces: list[tuple], text: str, i: int) -> tuple[int, str | None] | str:
    """(where the match ends, the name it read) if text[i:] starts with `pieces`; WAIT if the text ends inside them
    but could still match; FAIL if it cannot."""
    name, n = None, len(text)
    for piece in pieces:
        kind = piece[0]
        if kind == "ws":
            while i < n and text[i] in WS:
                i += 1
            continue
        if kind == "fixed":
            name = piece[1]
            continue
        if i >= n:
            return WAIT
        if kind in ("lit", "opt"):
            if text.startswith(piece[1], i):
                i += len(piece[1])
            elif piece[1].startswith(text[i:]):
                return WAIT
            elif kind == "lit":
                return FAIL
        elif kind == "alt":
            found = next((t for t in piece[1] if text.startswith(t, i)), None)
            if found is None:
                return WAIT if any(t.startswith(text[i:]) for t in piece[1]) else FAIL
            i += len(found)
        elif kind == "name":
            m = _STRING.match(text, i)
            if m is None:
                return WAIT if _STRING_PREFIX.match(text, i) else FAIL
            name = json.loads(m.group())
            if not name:
                return FAIL
            i = m.end()
        elif kind == "raw":
            _, until, forbidden = piece
            end = text.find(until, i)
            bad = text.find(forbidden, i)
            if bad >= 0 and (end < 0 or bad < end):
                return FAIL
            if end < 0:
                return WAIT
            name = text[i:end].strip()
            if not name:
                return FAIL
            i = end + len(until)
        elif kind == "skip":
            end = text.find(piece[1], i)
            if end < 0:
                return WAIT
            i = end + len(piece[1])
        else:
            raise AssertionError(kind)
    return i, name


class CallScanner:
    """Scans one reply's text as it grows (`advance`), from the start of its tool-call section, and reports each call
    it reads: (call number, name, first piece of arguments) when a call starts, (call number, None, piece) after.
    A call starts once its arguments object has begun (its "{" read)."""

    def __init__(self, formats: list[StreamFormat], start: int) -> None:
        self.formats = formats
        self.format: StreamFormat | None = None  # chosen by the first call's head
        self.pos = start
        self.reader: ArgumentsReader | None = None
        self.name = ""
        self.started = False
        self.count = 0  # calls started
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def advance(self, text: str, final: bool) -> list[tuple[int, str | None, str]]:
        events = []
        while not self.stopped:
            if self.reader is None and not self._head(text, final):
                break
            before = self.reader.consumed
            piece = self.reader.feed(text[self.pos:])
            self.pos += self.reader.consumed - before
            if piece:
                if self.started:
                    events.append((self.count - 1, None, piece))
                else:
                    events.append((self.count, self.name, piece))
                    self.started = True
                    self.count += 1
            if self.reader.failed or final and not self.reader.done:
                self.stop()
            if not self.reader.done:
                break
            self.reader = None
        return events

    def _head(self, text: str, final: bool) -> bool:
        """Match the next call's head; True once the arguments reader is set up to read it."""
        if self.format is None:
            candidates = self.formats
        elif self.format.next is None:
            self.stop()
            return False
        else:
            candidates = [self.format]
        for fmt in candidates:
            result = match(fmt.first if self.format is None else fmt.next, text, self.pos)
            if result == FAIL:
                continue
            if result == WAIT:  # an earlier format that may still match goes first
                if final:
                    self.stop()
                return False
            self.format = fmt
            self.pos, self.name = result
            self.reader = ArgumentsReader(allow_string=fmt.allow_string)
            self.started = False
            return True
        self.stop()
        return False
