"""Server-sent events, and tying an engine request's life to its HTTP client's.

A streaming response aborts its engine requests however it ends: finished, client gone (Starlette
cancels the stream when it sees http.disconnect), or failed. A non-streaming handler is raced
against the client's disconnect, since nothing else would notice the client leaving while the
engine is still generating.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from starlette.responses import StreamingResponse

from nanoserve.server.errors import APIError


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = sse("[DONE]")


class EngineStreamResponse(StreamingResponse):
    """A text/event-stream response that calls on_close when it is over, whatever the reason."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def run_until_disconnected(request: Request, work: Awaitable, on_close: Callable[[], None]):
    """Await `work`; if the client disconnects first, cancel it. on_close runs either way."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
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


async def _wait_for_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
