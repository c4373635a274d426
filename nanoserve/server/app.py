"""The OpenAI-compatible HTTP server: routes, app assembly, and run_server.

build_app wires an AsyncEngine into a FastAPI app (tests build one around any engine); run_server
builds the engine from EngineArgs and serves it with uvicorn until SIGTERM / SIGINT, draining first, or
with --api-server-count N > 1 hands over to api_servers.py (N server processes, one engine process).
`python -m nanoserve.server.app --model DIR --port P` runs it without the CLI.
"""

import argparse
import asyncio
import gc
import logging
import os
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.args import add_engine_args, add_server_args, engine_args_from
from nanoserve.config import EngineArgs
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.engine_view import engine_view_router
from nanoserve.server.errors import APIError, bad_request, install_error_handlers
from nanoserve.server.gate import GateMiddleware, GateState
from nanoserve.server.http_limits import HEADER_TIMEOUT_S, MAX_HEADER_BYTES, limited_http_protocol
from nanoserve.server.metrics import CONTENT_TYPE, ServerMetrics
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from nanoserve.server.serving_chat import ServingChat
from nanoserve.server.serving_completions import ServingCompletions
from nanoserve.server.shutdown import serve_with_drain
from nanoserve.server.web_page import WebPage

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
BUNDLED_MODEL_NAME = "nanoserve-tiny"


def build_app(async_engine: AsyncEngine, served_model_name: list[str] | str, api_key: str | None = None,
              max_waiting_requests: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              gate: GateState | None = None, api_server: int | None = None, log_requests: bool = False,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> FastAPI:
    """The app around a running AsyncEngine. `served_model_name`: the name, or names, requests may give (the
    first is the default); `gate` is shared with serve_with_drain for shutdown; `api_server`: this process's
    index among several API servers (a response header names it); `log_requests`: one INFO line per request
    when it is over."""
    names = model_names(served_model_name)
    gate = gate or GateState()
    # /docs and /openapi.json are behind the API key, as every path but GateMiddleware's OPEN_PATHS is.
    app = FastAPI(title="nanoserve", version=nanoserve.__version__, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.add_middleware(GateMiddleware, state=gate, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(WebPage)  # outside the gate: the page at / loads without the key, then asks for it
    if api_server is not None:
        app.add_middleware(ApiServerHeader, index=api_server)  # added last: outermost, so every response has it
    install_error_handlers(app)
    metrics = ServerMetrics(async_engine, names[0], async_engine.max_model_len)
    completions = ServingCompletions(async_engine, names, metrics, max_waiting_requests, log_requests)
    chat = ServingChat(async_engine, names, metrics, max_waiting_requests, log_requests, tool_call_parser,
                       enable_auto_tool_choice)
    app.state.async_engine, app.state.gate, app.state.metrics = async_engine, gate, metrics
    app.include_router(engine_view_router(async_engine, gate, names[0], api_server))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "nanoserve",
            "root": async_engine.engine.config.model_dir, "max_model_len": async_engine.max_model_len,
            "vocab_size": async_engine.engine.config.model.vocab_size} for name in names]}

    @app.get("/health")
    async def health() -> JSONResponse:
        s = async_engine.stats
        body = {"status": "ok", "waiting": async_engine.num_waiting_in(s), "running": s.num_running,
                "kv_blocks_used": s.num_blocks - s.num_free_blocks, "kv_blocks_total": s.num_blocks,
                "kv_blocks_free": s.num_free_blocks, "prefix_cache_hit_rate": s.prefix_hit_rate,
                "in_flight": gate.in_flight}
        if s.num_cpu_blocks:  # the CPU tier (--kv-offload-gb)
            body |= {"cpu_kv_blocks_used": s.num_cpu_blocks_used, "cpu_kv_blocks_total": s.num_cpu_blocks,
                     "cpu_prefix_cache_hits": s.cpu_prefix_hits}
        if async_engine.dead:
            return JSONResponse({**body, "status": "dead", "error": async_engine.error}, status_code=503)
        if gate.draining:
            return JSONResponse({**body, "status": "draining"}, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict:
        return {"version": nanoserve.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        try:
            if body.prompt is not None:
                ids = await async_engine.tokenize(body.prompt)
            else:
                ids = await async_engine.apply_chat_template([m.for_template() for m in body.messages])
        except ValueError as exc:
            raise bad_request(exc) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": async_engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        completions.check_model(body.model)
        vocab = async_engine.engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: ids must be in [0, {vocab})", "tokens")
        try:
            return {"prompt": await async_engine.detokenize(body.tokens)}
        except ValueError as exc:
            raise bad_request(exc) from None

    return app


class ApiServerHeader:
    """Plain ASGI middleware: every response says which API server process answered it
    (`x-nanoserve-api-server: <index>`), so a client (or a test) can see how the load was spread."""

    def __init__(self, app, index: int) -> None:
        self.app = app
        self.header = (b"x-nanoserve-api-server", str(index).encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def model_names(served_model_name: list[str] | str) -> list[str]:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names or not all(names):
        raise ValueError(f"served_model_name: must be one or more non-empty names, got {served_model_name!r}")
    return names


def default_model_name(engine_args: EngineArgs) -> str:
    if engine_args.model is None:
        return BUNDLED_MODEL_NAME
    return os.path.basename(os.path.normpath(engine_args.model))


def uvicorn_config(app, uvicorn_log_level: str, max_header_bytes: int, header_timeout: float,
                   **kwargs) -> uvicorn.Config:
    """How every API server runs uvicorn. The drain happens before uvicorn's shutdown; its own graceful
    timeout only bounds the last sends."""
    return uvicorn.Config(app, log_level=uvicorn_log_level, access_log=False, timeout_graceful_shutdown=5,
                          http=limited_http_protocol(max_header_bytes, header_timeout), **kwargs)


def run_server(engine_args: EngineArgs, host: str, port: int, api_key: str | None, max_waiting_requests: int,
               drain_timeout: float, served_model_name: list[str] | str | None, api_server_count: int = 1, *,
               uvicorn_log_level: str = "info", disable_log_requests: bool = False,
               max_header_bytes: int = MAX_HEADER_BYTES, header_timeout: float = HEADER_TIMEOUT_S,
               tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> int:
    """Load the model, serve until SIGTERM / SIGINT, drain, and return the exit status (0 unless an API
    server process failed). served_model_name: the names requests may give, the first the default (None: the
    model directory's name); max_header_bytes and header_timeout bound a request's head (http_limits.py)."""
    if api_server_count < 1:
        raise ValueError(f"--api-server-count: must be at least 1, got {api_server_count}")
    names = model_names(served_model_name or default_model_name(engine_args))
    limited_http_protocol(max_header_bytes, header_timeout)  # bad limits fail here, before the model loads
    if api_server_count > 1:
        from nanoserve.server.api_servers import ServerOptions, run_api_servers

        options = ServerOptions(names, api_key, max_waiting_requests, drain_timeout, uvicorn_log_level,
                                not disable_log_requests, max_header_bytes, header_timeout, tool_call_parser,
                                enable_auto_tool_choice)
        return run_api_servers(engine_args, host, port, api_server_count, options)
    async_engine = AsyncEngine.from_engine_args(engine_args)
    gate = GateState()
    app = build_app(async_engine, names, api_key, max_waiting_requests, gate=gate,
                    log_requests=not disable_log_requests, tool_call_parser=tool_call_parser,
                    enable_auto_tool_choice=enable_auto_tool_choice)
    config = uvicorn_config(app, uvicorn_log_level, max_header_bytes, header_timeout, host=host, port=port)
    logger.info("serving %s (max_model_len %d%s) on http://%s:%d", ", ".join(map(repr, names)),
                async_engine.max_model_len,
                ", engine in its own process" if async_engine.engine.config.args.engine_process else "", host, port)
    freeze_startup_objects()
    # With tensor parallelism a lost rank kills the engine: a server that exits (non-zero) is one an orchestrator
    # restarts, where one left answering 503 would wait for a person.
    tp = engine_args.tensor_parallel_size > 1
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve_with_drain(config, gate, async_engine, drain_timeout, exit_when_engine_dies=tp))
    finally:
        async_engine.shutdown()


def freeze_startup_objects() -> None:
    """Put what start-up allocated (modules, model, tokenizer, app: ~375k objects) out of the garbage
    collector's reach, so that collections while serving don't walk it again and again between chunks."""
    gc.collect()
    gc.freeze()


def event_loop_factory():
    """uvloop where it is installed: its event loop costs a fraction of asyncio's per callback and
    socket write, and with hundreds of streams the event loop is what limits the server."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# -- python -m nanoserve.server.app ---------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nanoserve.server.app", description=__doc__)
    add_server_args(p)
    add_engine_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    return run_server(engine_args_from(args), args.host, args.port, args.api_key, args.max_waiting_requests,
                      args.drain_timeout, args.served_model_name, args.api_server_count,
                      uvicorn_log_level=args.uvicorn_log_level, disable_log_requests=args.disable_log_requests,
                      tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)


if __name__ == "__main__":
    sys.exit(main())
