"""GateMiddleware: what every HTTP request passes before it reaches a route.

In order: a draining server refuses new work (503); an API key, when set, is checked (401); a body
over the size limit is refused (413) before any JSON parsing; and in-flight requests are counted,
so a graceful shutdown knows when the last one has finished sending. It is plain ASGI (not
BaseHTTPMiddleware) so streaming responses pass through untouched and the count covers the whole
stream, not just the response headers.
"""

import json
import secrets
from dataclasses import dataclass

from nanoserve.server.errors import error_body

# Open without a key and during a drain: probes and scrapers must keep working.
OPEN_PATHS = ("/health", "/metrics", "/version")


@dataclass
class GateState:
    """Shared between the middleware and the shutdown logic (one per app)."""

    draining: bool = False
    in_flight: int = 0


class _BodyTooLarge(Exception):
    pass


class GateMiddleware:
    def __init__(self, app, state: GateState, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await _reply(send, 503, "the server is shutting down; retry on another instance")
            return
        if self.api_key is not None and not self._authorized(scope):
            await _reply(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, f"request body of {declared} bytes is over the limit of "
                                    f"{self.max_body_bytes} bytes")
            return
        # Counted from here, before the body has arrived: a drain that starts while a slow upload is still coming
        # must wait for that request too, not stop the server under it.
        self.state.in_flight += 1
        try:
            body = await self._read_body(receive)
            await self.app(scope, _replay(body, receive), send)
        except _BodyTooLarge:  # only _read_body raises it
            await _reply(send, 413, f"request body is over the limit of {self.max_body_bytes} bytes")
        finally:
            self.state.in_flight -= 1

    def _authorized(self, scope) -> bool:
        header = _header(scope, b"authorization") or ""
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                       self.api_key.encode())

    async def _read_body(self, receive) -> bytes:
        # Read it all here (it is small by construction) so the real size is checked, not just
        # what Content-Length claims (chunked uploads have none).
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left; the route will see the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive):
    """A receive() that hands the buffered body over once, then passes through (to disconnects)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
