"""Forwarding one request through the router to a backend, and its answer back.

- Which backend: BackendPool.choose over the request's routing key (routing_key: a completion's prompt, or a
  chat's messages as text), so that requests sharing a prefix go where it is cached.
- Before an answer: a backend that cannot be reached, drops the connection before its response's head, or answers
  502 / 503 / 504 (503: it is draining, or its engine died) is marked unhealthy and the request is sent once more,
  to another backend. Only once: a request that fails twice fails with 502 rather than walk the whole pool.
- The answer: a stream (text/event-stream) is passed on chunk by chunk as it arrives, nothing buffered; anything
  else is read whole and returned with the backend's status. Every answer names its backend in
  `x-nanoserve-backend`.
- A backend that fails in the middle of a stream: the stream ends with an error event (OpenAI's error shape, code
  "backend_failed") and `data: [DONE]`, never silently.
- A client that disconnects: the request to the backend is cancelled, which closes its connection there, and the
  backend aborts the request as it does for any client that leaves (server/streaming.py).
"""

import json
import logging

import aiohttp
from starlette.responses import Response
from starlette.types import Send

from nanoserve.router.backends import Backend, BackendPool
from nanoserve.server.errors import APIError, error_body
from nanoserve.server.streaming import SSE_DONE, EngineStreamResponse, sse

logger = logging.getLogger(__name__)

RETRY_STATUSES = (502, 503, 504)
# Request headers passed on to the backend (the key too: a backend may check the same one).
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
BACKEND_HEADER = "x-nanoserve-backend"
# How a backend's failure shows: aiohttp's own errors, and a connection reset that aiohttp passes on as it is.
BACKEND_ERRORS = (aiohttp.ClientError, OSError, TimeoutError)


def routing_key(path: str, body: bytes) -> str | list[int] | None:
    """What a request is routed by: the prompt (the first, of a batch), or a chat's messages as one text in order
    (a conversation's next turn extends the text of the last). None: nothing to route by (load decides)."""
    if not body:
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None  # the backend answers the bad body with its own 400
    if not isinstance(request, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(f"{m.get('role')}\n{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    return None


def _content_text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


class Forwarder:
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    async def forward(
        self, method: str, path: str, query: str, headers: dict[str, str], body: bytes, key: str | list[int] | None
    ) -> Response:
        """The backend's answer to one request (tried on a second backend if the first fails before answering);
        raises APIError 503 if no backend is healthy, 502 if both tries failed."""
        failed: Backend | None = None
        why = "no backend is healthy"
        for _ in range(2):
            backend = self.pool.choose(key, exclude=failed)
            if backend is None:
                break
            backend.in_flight += 1
            try:
                response = await self.pool.session.request(
                    method, backend.url + path + query, data=body, headers=headers, allow_redirects=False
                )
            except BACKEND_ERRORS as exc:
                backend.in_flight -= 1
                why = f"backend {backend.url} failed before answering: {type(exc).__name__}: {exc}"
                self.pool.mark_failed(backend, why)
                logger.warning("%s; %s", why, "retrying on another" if failed is None else "giving up")
                failed = backend
                continue
            except BaseException:  # cancelled: the client left while the backend worked
                backend.in_flight -= 1
                raise
            if response.status in RETRY_STATUSES:
                text = await _read_quietly(response)
                backend.in_flight -= 1
                why = f"backend {backend.url} answered {response.status}: {text[:200]}"
                self.pool.mark_failed(backend, why)
                logger.warning("%s; %s", why, "retrying on another" if failed is None else "giving up")
                failed = backend
                continue
            return await self._relay(backend, response)
        if failed is None:
            raise APIError(503, f"no backend can take the request: {why}", code="no_backend")
        raise APIError(502, why, code="backend_failed")

    async def _relay(self, backend: Backend, response: aiohttp.ClientResponse) -> Response:
        content_type = response.headers.get("content-type", "application/json")
        if content_type.startswith("text/event-stream"):
            stream = EngineStreamResponse(
                lambda send: self._pass_stream(backend, response, send), lambda: self._done(backend, response)
            )
            stream.status_code = response.status
            stream.raw_headers.append((BACKEND_HEADER.encode(), backend.url.encode()))
            return stream
        try:
            body = await response.read()
        except BACKEND_ERRORS as exc:
            why = f"backend {backend.url} failed while answering: {type(exc).__name__}: {exc}"
            self.pool.mark_failed(backend, why)
            raise APIError(502, why, code="backend_failed") from None
        finally:
            self._done(backend, response)
        return Response(
            body, status_code=response.status, media_type=content_type, headers={BACKEND_HEADER: backend.url}
        )

    async def _pass_stream(self, backend: Backend, response: aiohttp.ClientResponse, send: Send) -> None:
        chunks = response.content.iter_any()
        while True:
            # Only the read from the backend is guarded here: an OSError from `send` is the client leaving, which
            # EngineStreamResponse takes care of.
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except BACKEND_ERRORS as exc:
                why = f"backend {backend.url} failed mid-stream: {type(exc).__name__}: {exc}"
                logger.warning(why)
                self.pool.mark_failed(backend, why)
                last = sse(error_body(502, why, code="backend_failed")) + SSE_DONE
                await send({"type": "http.response.body", "body": last.encode(), "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _done(backend: Backend, response: aiohttp.ClientResponse) -> None:
        # A response read to its end gives its connection back for the next request; one that was not (the client
        # left) must not go back to the pool, and closing its connection is what tells the backend to abort it.
        if response.content.at_eof():
            response.release()
        else:
            response.close()
        backend.in_flight -= 1


async def _read_quietly(response: aiohttp.ClientResponse) -> str:
    try:
        return (await response.read()).decode(errors="replace")
    except BACKEND_ERRORS:
        return ""
    finally:
        response.close()
