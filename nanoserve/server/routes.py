"""build_app: the OpenAI-compatible app around a running AsyncEngine (routes, middleware, error handlers).

One server runs it (app.py's run_server), and so does each API server process of several (api_servers.py);
tests build one around any engine.
"""

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.engine_view import engine_view_router, engines_json
from nanoserve.server.errors import APIError, bad_request, install_error_handlers
from nanoserve.server.gate import GateMiddleware, GateState
from nanoserve.server.metrics import CONTENT_TYPE, ServerMetrics
from nanoserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from nanoserve.server.serving_chat import ServingChat
from nanoserve.server.serving_completions import ServingCompletions
from nanoserve.server.web_page import WebPage

MAX_BODY_BYTES = 1 << 20
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

    scheme = async_engine.engine.config.quantization
    quantization = scheme.describe() if scheme is not None else None
    kv_cache_dtype = str(async_engine.engine.config.kv_dtype).removeprefix("torch.")

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "nanoserve",
            "root": async_engine.engine.config.model_dir, "max_model_len": async_engine.max_model_len,
            "vocab_size": async_engine.engine.config.model.vocab_size, "quantization": quantization,
            "kv_cache_dtype": kv_cache_dtype}
            for name in names]}

    @app.get("/health")
    async def health() -> JSONResponse:
        s = async_engine.stats
        body = {"status": "ok", "waiting": async_engine.num_waiting_in(s), "running": s.num_running,
                "kv_blocks_used": s.num_blocks - s.num_free_blocks, "kv_blocks_total": s.num_blocks,
                "kv_blocks_free": s.num_free_blocks, "prefix_cache_hit_rate": s.prefix_hit_rate,
                "in_flight": gate.in_flight}
        if (engines := engines_json(async_engine)) is not None:  # --data-parallel-size N
            body["engines"] = engines
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
