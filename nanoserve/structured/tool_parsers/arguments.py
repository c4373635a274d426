"""A tool call's arguments as OpenAI's `function.arguments` text, read from the model's JSON in pieces.

The text is the object the model wrote, re-written canonically: json.dumps's separators (", " and ": ") and no
other whitespace, strings escaped as json.dumps(ensure_ascii=False) escapes them (escaped surrogate pairs joined, a
lone surrogate kept as its escape), numbers and literals as written, keys in the model's order. A reply read whole
(the unstreamed message) and one read token by token (a stream's argument deltas) go through the same
`ArgumentsReader`, whose output for a text does not depend on how the text is cut: so the deltas join to exactly
the unstreamed message's arguments.

`read_call` reads a call object ({"name": ..., "arguments": {...}}) at a place in a reply, for the parsers whose
formats hold calls as JSON objects.
"""

import json
import re

from nanoserve.structured.tool_parsers.base import ToolCall, call_id

WS = " \t\n\r"  # JSON's whitespace
_PLAIN = re.compile(r'[^"\\\x00-\x1f\ud800-\udfff]+')  # string characters that stand for themselves
_NUMBER_CHARS = re.compile(r"[0-9.eE+-]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_DECODE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ENCODE = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


def escape(text: str) -> str:
    """A decoded string's characters as json.dumps(ensure_ascii=False) writes them between the quotes (a lone
    surrogate as its escape, so the text stays valid UTF-8)."""
    if _PLAIN.fullmatch(text):
        return text
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ENCODE:
            out.append(_ENCODE[ch])
        elif code < 0x20 or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


class JsonString:
    """The inside of a JSON string after its opening quote, decoded as it arrives, by json's rules: the escapes, an
    escaped surrogate pair joined into one character, no raw control characters (ValueError)."""

    def __init__(self, key: bool = False) -> None:
        self.key = key
        self.escape: str | None = None  # "" after a backslash, then "u" and the hex digits read so far
        self.high: int | None = None  # an escaped high surrogate, waiting to see whether a low one follows

    def feed(self, text: str, i: int) -> tuple[str, int, bool]:
        """(decoded characters, where reading stopped, whether the closing quote was read)."""
        out, n = [], len(text)
        while i < n:
            if self.escape is None:
                if self.high is None and (m := _PLAIN.match(text, i)):
                    out.append(m.group())
                    i = m.end()
                    continue
                c = text[i]
                i += 1
                if c == "\\":
                    self.escape = ""
                    continue
                self._flush(out)
                if c == '"':
                    return "".join(out), i, True
                if ord(c) < 0x20:
                    raise ValueError("a raw control character in a string")
                out.append(c)  # a raw surrogate (only a decoded string's text can hold one)
                continue
            c = text[i]
            i += 1
            if self.escape == "":
                if c == "u":
                    self.escape = "u"
                    continue
                if c not in _DECODE:
                    raise ValueError(f"a bad escape \\{c}")
                self.escape = None
                self._flush(out)
                out.append(_DECODE[c])
                continue
            if c not in _HEX:
                raise ValueError("a bad \\u escape")
            self.escape += c
            if len(self.escape) < 5:
                continue
            code, self.escape = int(self.escape[1:], 16), None
            if self.high is not None and 0xDC00 <= code <= 0xDFFF:
                out.append(chr(0x10000 + ((self.high - 0xD800) << 10) + code - 0xDC00))
                self.high = None
                continue
            self._flush(out)
            if 0xD800 <= code <= 0xDBFF:
                self.high = code
            else:
                out.append(chr(code))
        return "".join(out), i, False

    def _flush(self, out: list[str]) -> None:
        if self.high is not None:
            out.append(chr(self.high))
            self.high = None


class ArgumentsReader:
    """Reads one JSON object arriving in pieces (`feed`) and returns its canonical text piece by piece. It stops at
    the object's end (`done`; `consumed` counts the characters it took, whitespace before the object included), and
    fails (`failed`) at the first character that cannot continue one. With allow_string, a JSON string whose text is
    an object is read too (some models write the arguments so): its decoded text is read as the object."""

    def __init__(self, allow_string: bool = False) -> None:
        self.allow_string = allow_string
        self.stack: list[str] = []
        self.expect = "start"  # start, key_or_close, key, colon, value, value_or_close, comma_or_close
        self.string: JsonString | None = None
        self.number: str | None = None
        self.literal = ""  # the rest of true / false / null still to read
        self.outer: JsonString | None = None  # the string that holds the object (allow_string)
        self.inner: ArgumentsReader | None = None
        self.done = False
        self.failed = False
        self.consumed = 0

    def feed(self, text: str) -> str:
        if self.done or self.failed:
            return ""
        out: list[str] = []
        try:
            i = self._feed(text, out)
        except ValueError:
            self.failed = True
            return "".join(out)
        self.consumed += i
        return "".join(out)

    def _feed(self, text: str, out: list[str]) -> int:
        i, n = 0, len(text)
        while i < n and not self.done:
            if self.outer is not None:
                decoded, i, closed = self.outer.feed(text, i)
                before = self.inner.consumed
                out.append(self.inner.feed(decoded))
                if self.inner.failed or decoded[self.inner.consumed - before:].strip(WS):
                    raise ValueError("not an object")
                if closed:
                    if not self.inner.done:
                        raise ValueError("the string ends before the object")
                    self.done = True
                continue
            if self.string is not None:
                decoded, i, closed = self.string.feed(text, i)
                out.append(escape(decoded))
                if closed:
                    out.append('"')
                    self.expect = "colon" if self.string.key else "comma_or_close"
                    self.string = None
                continue
            if self.number is not None:
                m = _NUMBER_CHARS.match(text, i)
                self.number += m.group()
                out.append(m.group())
                i = m.end()
                if i < n:  # the number ends here
                    if not _NUMBER.match(self.number):
                        raise ValueError(f"a bad number {self.number}")
                    self.number = None
                    self.expect = "comma_or_close"
                continue
            c = text[i]
            i += 1
            if self.literal:
                if c != self.literal[0]:
                    raise ValueError("a bad literal")
                out.append(c)
                self.literal = self.literal[1:]
                if not self.literal:
                    self.expect = "comma_or_close"
                continue
            if c in WS:
                continue
            self._structure(c, out)
        return i

    def _structure(self, c: str, out: list[str]) -> None:
        expect = self.expect
        if expect == "start":
            if c == '"' and self.allow_string:
                self.outer, self.inner = JsonString(), ArgumentsReader()
            elif c == "{":
                self._open(c, out)
            else:
                raise ValueError("not an object")
        elif expect in ("key_or_close", "key"):
            if c == '"':
                self.string = JsonString(key=True)
                out.append(c)
            elif c == "}" and expect == "key_or_close":
                self._close(c, out)
            else:
                raise ValueError("expected a key")
        elif expect == "colon":
            if c != ":":
                raise ValueError("expected ':'")
            out.append(": ")
            self.expect = "value"
        elif expect == "comma_or_close":
            if c == ",":
                out.append(", ")
                self.expect = "key" if self.stack[-1] == "{" else "value"
            elif c == ("}" if self.stack[-1] == "{" else "]"):
                self._close(c, out)
            else:
                raise ValueError("expected ',' or the end of a container")
        elif c == "]" and expect == "value_or_close":
            self._close(c, out)
        else:  # a value
            if c in "{[":
                self._open(c, out)
            elif c == '"':
                self.string = JsonString()
                out.append(c)
            elif c == "-" or c.isdigit() and c.isascii():
                self.number = c
                out.append(c)
            elif c in _LITERALS:
                self.literal = _LITERALS[c][1:]
                out.append(c)
            else:
                raise ValueError("expected a value")

    def _open(self, c: str, out: list[str]) -> None:
        self.stack.append(c)
        out.append(c)
        self.expect = "key_or_close" if c == "{" else "value_or_close"

    def _close(self, c: str, out: list[str]) -> None:
        self.stack.pop()
        out.append(c)
        self.expect = "comma_or_close"
        if not self.stack:
            self.done = True


def canonical_arguments(text: str) -> str | None:
    """The canonical text of the JSON object `text` (whitespace around it allowed); None if it is not one object."""
    reader = ArgumentsReader()
    out = reader.feed(text)
    return out if reader.done and not text[reader.consumed:].strip(WS) else None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


_DECODER = json.JSONDecoder()


def read_call(text: str, at: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> tuple[ToolCall, int] | None:
    """The call object {"name": ..., "arguments" | "parameters": {...}} at text[at:] (after whitespace), and where
    it ends; None if there is none. Keys in any order, other keys ignored, a key given twice is malformed; the
    arguments are an object or a string holding one (none: "{}"). Each call gets a fresh id."""
    i = skip_ws(text, at)
    if not text.startswith("{", i):
        return None
    members: dict[str, object] = {}
    i = skip_ws(text, i + 1)
    if text.startswith("}", i):
        return None  # no name
    try:
        while True:
            if not text.startswith('"', i):
                return None
            key, i = _DECODER.raw_decode(text, i)
            i = skip_ws(text, i)
            if key in members or not text.startswith(":", i):
                return None
            i = skip_ws(text, i + 1)
            if key in args_keys:
                reader = ArgumentsReader(allow_string=True)
                members[key] = reader.feed(text[i:])
                if not reader.done:
                    return None
                i += reader.consumed
            else:
                members[key], i = _DECODER.raw_decode(text, i)
            i = skip_ws(text, i)
            if text.startswith("}", i):
                break
            if not text.startswith(",", i):
                return None
            i = skip_ws(text, i + 1)
    except json.JSONDecodeError:
        return None
    name = members.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in args_keys if k in members), None)
    return ToolCall(name, members[key] if key is not None else "{}", call_id()), i + 1


def read_call_list(text: str, at: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> list[ToolCall] | None:
    """A JSON array of one or more call objects at text[at:], and nothing but whitespace after it; None if not."""
    i = skip_ws(text, at)
    if not text.startswith("[", i):
        return None
    calls = []
    while True:
        read = read_call(text, i + 1, args_keys)
        if read is None:
            return None
        calls.append(read[0])
        i = skip_ws(text, read[1])
        if text.startswith("]", i):
            return calls if not text[i + 1:].strip(WS) else None
        if not text.startswith(",", i):
            return None
