"""`nanoserve router`: one OpenAI-compatible endpoint in front of nanoserve servers on several machines.

    nanoserve serve MODEL --host 0.0.0.0 --port 8000        # on each machine (each may run --data-parallel-size N)
    nanoserve router --backend http://gpu1:8000 --backend http://gpu2:8000 --port 8000

Every OpenAI route (and any other path: /v1/models, /tokenize, ...) is forwarded to one backend (router/proxy.py),
picked by runtime/routing.py's policy (--policy: cache_aware by default, least_load, round_robin) among the healthy
ones (router/backends.py). The router's own routes:
- GET /health: 200 while at least one backend is healthy (503 with none), and each backend's state;
- GET /metrics: per backend, whether it is healthy and the requests in flight there (each backend has its own);
- GET /router/backends, POST /router/backends {"url": URL}, DELETE /router/backends?url=URL: the backends, added
  or removed while the router runs (behind the API key: they change where requests go).
--api-key is checked here, before anything is forwarded (GateMiddleware, as `serve` checks it), and the client's
Authorization header is passed on, so backends may check the same key. SIGTERM / Ctrl-C drain as `serve` does:
new requests get 503 while those in flight finish.
"""

import argparse
import asyncio
import contextlib
import logging
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

import nanoserve
from nanoserve.args import add_router_args
from nanoserve.router.backends import BackendPool
from nanoserve.router.proxy import FORWARDED_HEADERS, Forwarder, routing_key
from nanoserve.runtime.routing import RoutingConfig
from nanoserve.server.errors import APIError, install_error_handlers
from nanoserve.server.gate import GateMiddleware, GateState
from nanoserve.server.http_limits import HEADER_TIMEOUT_S, MAX_HEADER_BYTES
from nanoserve.server.metrics import CONTENT_TYPE
from nanoserve.server.routes import MAX_BODY_BYTES
from nanoserve.server.shutdown import serve_with_drain
from nanoserve.server.streaming import run_until_disconnected
from nanoserve.server.uvicorn_setup import event_loop_factory, uvicorn_config

logger = logging.getLogger(__name__)


class BackendBody(BaseModel):
    url: str


def build_router_app(pool: BackendPool, api_key: str | None = None, gate: GateState | None = None) -> FastAPI:
    gate = gate or GateState()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        yield
        await pool.stop()

    app = FastAPI(
        title="nanoserve router",
        version=nanoserve.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(GateMiddleware, state=gate, api_key=api_key, max_body_bytes=MAX_BODY_BYTES)
    install_error_handlers(app)
    forwarder = Forwarder(pool)

    @app.get("/health")
    async def health() -> JSONResponse:
        backends = [b.json() for b in pool.backends.values()]
        healthy = any(b["healthy"] for b in backends)
        status = "draining" if gate.draining else "ok" if healthy else "no healthy backend"
        return JSONResponse(
            {"status": status, "policy": pool.routing.policy, "backends": backends},
            status_code=200 if status == "ok" else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = [
            "# HELP nanoserve_router_backend_healthy Whether the backend passed its last health check",
            "# TYPE nanoserve_router_backend_healthy gauge",
        ]
        lines += [
            f'nanoserve_router_backend_healthy{{backend="{b.url}"}} {int(b.healthy)}' for b in pool.backends.values()
        ]
        lines += [
            "# HELP nanoserve_router_requests_in_flight Requests the router has in flight at the backend",
            "# TYPE nanoserve_router_requests_in_flight gauge",
        ]
        lines += [
            f'nanoserve_router_requests_in_flight{{backend="{b.url}"}} {b.in_flight}' for b in pool.backends.values()
        ]
        return Response("\n".join(lines) + "\n", media_type=CONTENT_TYPE)

    @app.get("/router/backends")
    async def list_backends() -> dict:
        return {"backends": [b.json() for b in pool.backends.values()]}

    @app.post("/router/backends")
    async def add_backend(body: BackendBody) -> dict:
        try:
            return (await pool.add(body.url)).json()
        except ValueError as exc:
            raise APIError(400, str(exc), "url") from None

    @app.delete("/router/backends")
    async def remove_backend(url: str) -> dict:
        try:
            return pool.remove(url).json()
        except ValueError as exc:
            raise APIError(400, str(exc), "url") from None
        except KeyError:
            raise APIError(404, f"url: {url!r} is not a backend of this router", "url") from None

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        headers = {name: value for name in FORWARDED_HEADERS if (value := request.headers.get(name)) is not None}
        query = f"?{request.url.query}" if request.url.query else ""
        key = routing_key(request.url.path, body) if request.method == "POST" else None
        work = forwarder.forward(request.method, request.url.path, query, headers, body, key)
        return await run_until_disconnected(request, work, on_close=lambda: None)

    return app


class _NoEngine:
    """What serve_with_drain aborts at the drain's timeout: the router holds no requests of its own. uvicorn's
    shutdown then closes the clients' connections, which closes those to the backends, which abort them."""

    dead = False
    error = None

    def abort_all(self) -> None:
        pass


def run_router(
    backends: list[str],
    policy: str = "cache_aware",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    health_interval: float = 2.0,
    drain_timeout: float = 30.0,
    uvicorn_log_level: str = "info",
) -> int:
    """Route until SIGTERM / SIGINT, then drain; returns the exit status. Raises ValueError for a bad argument."""
    if not health_interval > 0:
        raise ValueError(f"health_check_interval: must be > 0 seconds, got {health_interval}")
    pool = BackendPool(backends, RoutingConfig(policy=policy), health_interval)
    if not pool.backends:
        logger.warning("no backends yet: requests get 503 until one is added (POST /router/backends)")
    gate = GateState()
    app = build_router_app(pool, api_key, gate)
    config = uvicorn_config(app, uvicorn_log_level, MAX_HEADER_BYTES, HEADER_TIMEOUT_S, host=host, port=port)
    logger.info("routing (%s) over %s on http://%s:%d", policy, ", ".join(pool.backends) or "no backends", host, port)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(serve_with_drain(config, gate, _NoEngine(), drain_timeout))


def run_router_from(ns: argparse.Namespace) -> int:
    return run_router(
        ns.backend,
        ns.policy,
        ns.host,
        ns.port,
        ns.api_key,
        ns.health_check_interval,
        ns.drain_timeout,
        ns.uvicorn_log_level,
    )


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoserve.router.app`: the router without the CLI."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m nanoserve.router.app", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_router_args(parser)
    try:
        return run_router_from(parser.parse_args(argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
