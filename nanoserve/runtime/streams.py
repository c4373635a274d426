"""Request streams: where a request's outputs wait for the event loop that reads them.

The engine's results arrive on another thread (ThreadEngineClient's engine thread, or a
ChannelEngineClient's reader thread); `deliver` hands a step's worth to each event loop with one
call_soon_threadsafe, and a RequestGroup reads the streams of one HTTP request as one merged async iterator.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from nanoserve.outputs import CompletionOutput, RequestOutput


class EngineDeadError(RuntimeError):
    """The engine failed (or was shut down); no request can run any more."""


class RequestFailedError(RuntimeError):
    """Working on this request raised inside the engine; the engine and every other request go on."""


class RequestStream:
    """One request's outputs, filled from an engine-side thread, read on the event loop.

    Outputs are cumulative, so when the reader falls behind, a newer plain output replaces the one
    still waiting instead of queueing behind it: under load each wake-up sends one chunk with all the
    new tokens rather than one chunk per token, which is what lets a busy event loop keep up. Tool-loop
    outputs (whose chunks are flagged per output) and errors are never merged."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        self.request_id = request_id
        self.loop = loop
        self.wake = wake  # shared by the streams of one RequestGroup
        self.pending: list[RequestOutput | BaseException] = []
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.pending and _mergeable(self.pending[-1]) and _mergeable(item):
            self.pending[-1] = item
        else:
            self.pending.append(item)
        self.wake.set()


def _mergeable(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, RequestOutput) and all(type(c) is CompletionOutput for c in item.outputs)


class _Aborter(Protocol):
    def abort(self, request_id: str) -> None: ...


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), read as one merged stream of
    (prompt index, cumulative RequestOutput). Call abort() when the reader goes away."""

    def __init__(self, engine: _Aborter, streams: list[RequestStream], wake: asyncio.Event) -> None:
        self._engine = engine
        self._streams = streams
        self._wake = wake

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self._streams]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        live = len(self._streams)
        while live:
            await self._wake.wait()
            # Cleared before draining: an output put while we yield sets it again.
            self._wake.clear()
            for index, stream in enumerate(self._streams):
                items, stream.pending = stream.pending, []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        stream.finished = True
                        live -= 1
                    yield index, item

    def abort(self) -> int:
        """Abort every request of the group that has not finished (a no-op once all have); returns
        how many were aborted."""
        aborted = 0
        for stream in self._streams:
            if not stream.finished:
                stream.finished = True
                self._engine.abort(stream.request_id)
                aborted += 1
        return aborted


def deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Put each item in its stream, on the stream's event loop: one wake-up per loop, not per item.
    Call from any thread but the event loop's."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput | BaseException]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # that event loop is closed: nobody is left to read the output


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)
