"""Server-sent events, and tying an engine request's life to its HTTP client's.

A stream sends one piece of its SSE body per engine output that makes chunks, so this path runs tens of
thousands of times a second under load and is kept lean: the JSON parts that never change within a stream
(id, object, created, model, the surrounding structure) are encoded once by ChunkHead, and
EngineStreamResponse has the body written straight through the ASGI `send`, not through StreamingResponse.
The bytes are exactly what json.dumps(chunk, ensure_ascii=False) framed as `data: ...\\n\\n` gives, with
U+0085, U+2028 and U+2029 escaped (tests/server/test_stream_chunks.py checks that): JSON may leave them raw, but
they end a line for Python's str.splitlines and so for httpx's iter_lines, which then cut an event in two (a
random-weight model writes them now and then).

A streaming response aborts its engine requests however it ends: finished, client gone (a watcher task
sees http.disconnect, and the task writing the body is cancelled), or failed. A non-streaming handler is
raced against the client's disconnect, since nothing else would notice the client leaving while the
engine is still generating.
"""

import asyncio
import json
from collections.abc import Awaitable, Callable
from json.encoder import encode_basestring

from fastapi import Request
from starlette.responses import Response
from starlette.types import Send

from nanoserve.server.errors import APIError

# The line breaks of str.splitlines that JSON leaves raw; escaped, a JSON string means the same. They can only be
# inside strings in JSON text (its structure is ASCII), so the whole text can be translated.
_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(json_text: str) -> str:
    """JSON text without the line breaks that splitlines sees and JSON does not escape."""
    return json_text if json_text.isascii() else json_text.translate(_RAW_LINE_BREAKS)


def json_str(s: str) -> str:
    """json.dumps(s, ensure_ascii=False) for a str s, one line, without building a JSONEncoder per call: json.dumps
    makes one whenever a keyword argument is not the default, and that is most of its cost for small values."""
    return one_line(encode_basestring(s))


def json_value(value) -> str:
    """json.dumps(value, ensure_ascii=False), one line, quick for the None and str that most chunk fields hold."""
    if value is None:
        return "null"
    if value.__class__ is str:
        return one_line(encode_basestring(value))
    return one_line(json.dumps(value, ensure_ascii=False))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else one_line(json.dumps(data, ensure_ascii=False))}\n\n"


SSE_DONE = sse("[DONE]")


class ChunkHead(dict):
    """The constant start of one stream's chunks, up to and including `"index": i, ` of choice i, as
    head[i]: a chunk is head[i] + its choice's other fields + CHUNK_END. A dict, so that the lookup each
    chunk makes is one in C."""

    def __init__(self, response_id: str, obj: str, created: int, model: str) -> None:
        super().__init__()
        self.head = (f'data: {{"id": {json_str(response_id)}, "object": {json_str(obj)}, "created": {created}, '
                     f'"model": {json_str(model)}, "choices": [{{"index": ')

    def __missing__(self, index: int) -> str:
        prefix = self[index] = f"{self.head}{index}, "
        return prefix


CHUNK_END = "}]}\n\n"

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]


class EngineStreamResponse(Response):
    """A text/event-stream response whose body `write(send)` sends (http.response.body messages, the last
    with more_body=False), calling on_close when it is over, whatever the reason. A Response subclass only so
    that FastAPI passes it through; it keeps none of Response's machinery: StreamingResponse's task group
    (per request), its per-chunk framing and the async iterator layers it reads its body from cost more
    than the rest of a chunk's trip through the server."""

    def __init__(self, write: Callable[[Send], Awaitable[None]], on_close: Callable[[], None]) -> None:
        self.write = write
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.raw_headers = list(_HEADERS)  # a middleware may add to the list it is sent

    async def __call__(self, scope, receive, send: Send) -> None:
        # The body is written from a task of its own: waking this one would resume every coroutine of the
        # ASGI stack (a dozen middleware and routing layers) for each chunk.
        writer = asyncio.ensure_future(self._write(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait([writer, watcher], return_when=asyncio.FIRST_COMPLETED)
            if writer.done():
                writer.result()
        finally:
            watcher.cancel()
            if not writer.done():
                writer.cancel()  # the client left (or the server is stopping): stop generating for it
            self.on_close()

    async def _write(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await self.write(send)
        except OSError:
            pass  # how servers of ASGI spec 2.4 report a client that left during a send


async def run_until_disconnected(request: Request, work: Awaitable, on_close: Callable[[], None]):
    """Await `work`; if the client disconnects first, cancel it. on_close runs either way."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        # 499 (nginx's "client closed request"): nobody reads it, but the access log says why.
        raise APIError(499, "the client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        on_close()


async def _wait_for_disconnect(receive) -> None:
    # The body was read already, so the next ASGI message can only be the disconnect (or, from servers that
    # say so when a response is complete, a notice that it is).
    while (await receive())["type"] != "http.disconnect":
        pass
