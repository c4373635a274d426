"""Limits on a request's head (request line and headers): how large it may be, and how long it may take.

uvicorn's default parser, httptools, bounds neither (uvicorn's h11_max_incomplete_event_size applies to h11
only): a client could send headers without end, or open connections and trickle their headers a byte at a
time to hold them open for ever (slowloris). LimitedHttpToolsProtocol is uvicorn's httptools protocol with
both limits, passed to uvicorn.Config as `http=limited_http_protocol(...)`:

- a head over max_header_bytes is answered 431 and the connection closed, without the app seeing it;
- a head not complete header_timeout seconds after the connection opened (for its first request) or after
  its first byte (for a later one on a kept-alive connection) is answered 408 and the connection closed;
- bytes that are not HTTP are answered 400, as uvicorn does, but in OpenAI's error shape (JSON) like the rest.

A refused connection is closed gracefully: the answer goes out with a FIN after it (write_eof), and what the
client still sends is read and dropped until it closes too, for at most LINGER_S. Closing at once, with the rest of
a 1 MB head still unread, makes the kernel reset the connection, and a reset can discard the answer before the
client reads it.
"""

import asyncio
import json
import logging
import sys

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from nanoserve.server.errors import error_body

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
HEADER_TIMEOUT_S = 20.0
LINGER_S = 5.0  # how long a refused connection is drained for its client to read the answer


def limited_http_protocol(max_header_bytes: int = MAX_HEADER_BYTES,
                          header_timeout: float = HEADER_TIMEOUT_S) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    if max_header_bytes < 1 or header_timeout <= 0:
        raise ValueError(f"max_header_bytes and header_timeout: must be positive, got {max_header_bytes} and "
                         f"{header_timeout}")
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,),
                {"max_header_bytes": max_header_bytes, "header_timeout": header_timeout})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = MAX_HEADER_BYTES
    header_timeout = HEADER_TIMEOUT_S

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reading_head = True  # until the head of the request being read is complete
        self.head_bytes = 0  # bytes received while reading_head (a bound: the last chunk may hold body too)
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False  # no more of this connection's requests are served
        self.answered = False  # the refusal has been sent
        self.linger_timer: asyncio.TimerHandle | None = None

    # -- connection events --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.linger_timer is not None:
            self.linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # dropped: the answer is out, or goes out below
        if self.reading_head:
            self.head_bytes += len(data)
        super().data_received(data)
        if self.reading_head and self.head_bytes > self.max_header_bytes:
            self.refused = True
        if self.refused and not self.answered:
            self._refuse(431, f"the request's headers are over the limit of {self.max_header_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this from the except clause that caught httptools' parse error: its text says what is wrong.
        reason = sys.exc_info()[1]
        self._refuse(400, f"the request is not valid HTTP: {reason or msg}")

    # -- parser callbacks ---------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.head_timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        self._disarm()
        self.reading_head = False
        self.head_bytes = 0
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_header_bytes:
            self.refused = True  # data_received answers once the parser has returned
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        self.reading_head = True  # what follows is the next request's head
        super().on_message_complete()

    # -- helpers --------------------------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self.head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.reading_head and not self.refused:
            self.refused = True
            self._refuse(408, f"the request's headers did not arrive within {self.header_timeout:g} s")

    def _refuse(self, status: int, message: str) -> None:
        self.refused = self.answered = True
        if self.transport.is_closing():
            return
        logger.info("%s: %d %s", self.client or "a client", status, message)
        body = json.dumps(error_body(status, message)).encode()
        head = b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
        head += b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        self.transport.write(STATUS_LINE[status] + head + body)
        # Not while an earlier request's response is still being written: that writer would fail after write_eof.
        if self.transport.can_write_eof() and (self.cycle is None or self.cycle.response_complete):
            # The client's EOF then ends the connection (asyncio closes a transport whose protocol's eof_received
            # returns None); the timer bounds how long one that keeps sending is drained.
            self.transport.write_eof()
            self.linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
