"""The router's backends: nanoserve servers it forwards to, their health, and which one takes a request.

A BackendPool holds the backends (by URL), checks each one's /health every `health_interval` seconds, and picks a
backend for a request with runtime/routing.py's policy over the healthy ones, load being the requests this router
has in flight there (known at once, where a backend's /health figures lag). A backend is healthy while its /health
answers 200: one that is draining or whose engine died answers 503, and one that is gone does not answer. A
connection that fails marks its backend unhealthy at once; the next health check that passes brings it back.

Backends are added and removed while the router runs through its HTTP endpoint (router/app.py), not a watched
file: an orchestrator (a deploy script, a Kubernetes hook) reaches the router over HTTP wherever it runs, the change
takes effect at once, and a mistake (a URL that is not one, a backend that is not there) is answered with an error,
where a watched file needs a file system both can reach, a polling delay, and has nobody to tell of a typo.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from nanoserve.runtime.routing import RoutingConfig, RoutingPolicy

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


@dataclass
class Backend:
    url: str  # scheme://host:port, no trailing slash
    healthy: bool = False  # until its first health check passes
    in_flight: int = 0  # requests this router has sent it that have not finished
    error: str | None = None  # why it is unhealthy
    checked: float = 0.0  # time.monotonic() of the last health check

    def json(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight, "error": self.error}


def normalize_url(url: str) -> str:
    """http(s)://host[:port] of a backend; raises ValueError naming the field for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"backend: must be an http:// or https:// URL of a nanoserve server, got {url!r}")
    if parts.path.strip("/") or parts.query:
        raise ValueError(f"backend: give the server's root URL (no path such as /v1), got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


class BackendPool:
    def __init__(self, urls: list[str], routing: RoutingConfig, health_interval: float = 2.0) -> None:
        self.routing = routing
        self.policy = RoutingPolicy(routing)
        self.health_interval = health_interval
        self.backends: dict[str, Backend] = {}
        self.session: aiohttp.ClientSession | None = None  # made on the event loop, by start()
        self._checker: asyncio.Task | None = None
        for url in urls:
            self._add(normalize_url(url))

    # -- life -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        # No limit on connections (aiohttp's default of 100 would cap the streams in flight), no read timeout
        # (a long generation may be quiet between tokens for as long as its backend is busy); a connection that
        # cannot be made in 5 s is a backend that is not there.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            auto_decompress=False,
        )
        await self.check_all()
        self._checker = asyncio.get_running_loop().create_task(self._check_forever())

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self.session is not None:
            await self.session.close()

    # -- membership -------------------------------------------------------------------------------------------
    async def add(self, url: str) -> Backend:
        """Add a backend (or find it there already) and check its health once; raises ValueError for a bad URL."""
        backend = self._add(normalize_url(url))
        await self.check(backend)
        return backend

    def remove(self, url: str) -> Backend:
        """Stop sending it requests (those in flight there finish); raises KeyError if it is not a backend."""
        backend = self.backends.pop(normalize_url(url))
        self.policy.remove_backend(backend.url)
        logger.info("backend %s removed", backend.url)
        return backend

    def _add(self, url: str) -> Backend:
        if url not in self.backends:
            self.backends[url] = Backend(url)
            self.policy.add_backend(url)
            logger.info("backend %s added", url)
        return self.backends[url]

    # -- health ---------------------------------------------------------------------------------------------
    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(backend) for backend in list(self.backends.values())))

    async def check(self, backend: Backend) -> None:
        try:
            async with self.session.get(
                backend.url + "/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            ) as response:
                body = await response.json(content_type=None)
                healthy = response.status == 200
                error = None if healthy else f"/health answered {response.status}: {body.get('status')}"
        except (TimeoutError, OSError, aiohttp.ClientError, ValueError, AttributeError) as exc:
            healthy, error = False, f"/health failed: {type(exc).__name__}: {exc}"
        backend.checked = time.monotonic()
        self._set(backend, healthy, error)

    def mark_failed(self, backend: Backend, why: str) -> None:
        """A request could not reach it: unhealthy until a health check passes."""
        self._set(backend, False, why)

    def _set(self, backend: Backend, healthy: bool, error: str | None) -> None:
        if healthy != backend.healthy:
            if healthy:
                logger.info("backend %s is healthy", backend.url)
            else:
                logger.warning("backend %s is unhealthy: %s", backend.url, error)
                # Whatever comes back there (a restarted server) starts with an empty prefix cache.
                if self.backends.get(backend.url) is backend:  # not one removed while a request was in flight
                    self.policy.remove_backend(backend.url)
                    self.policy.add_backend(backend.url)
        backend.healthy, backend.error = healthy, error

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_all()

    # -- routing ----------------------------------------------------------------------------------------------
    def choose(self, prompt: str | list[int] | None, exclude: Backend | None = None) -> Backend | None:
        """The backend for a request (None if no healthy one is left)."""
        loads = {url: b.in_flight for url, b in self.backends.items() if b.healthy and b is not exclude}
        if not loads:
            return None
        return self.backends[self.policy.choose(prompt, loads)]
