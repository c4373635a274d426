"""The OpenAI-compatible HTTP server's entry: run_server.

run_server builds the engine from EngineArgs and serves its app (routes.py's build_app) with uvicorn until
SIGTERM / SIGINT, draining first, or with --api-server-count N > 1 hands over to api_servers.py (N server
processes, one engine process).
`python -m nanoserve.server.app --model DIR --port P` runs it without the CLI.
"""

import argparse
import asyncio
import logging
import os
import sys

from nanoserve.args import add_engine_args, add_server_args, engine_args_from
from nanoserve.config import EngineArgs
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.server.api_servers import ServerOptions, run_api_servers
from nanoserve.server.gate import GateState
from nanoserve.server.http_limits import HEADER_TIMEOUT_S, MAX_HEADER_BYTES, limited_http_protocol
from nanoserve.server.routes import build_app, model_names
from nanoserve.server.shutdown import serve_with_drain
from nanoserve.server.uvicorn_setup import event_loop_factory, startup_objects_frozen, uvicorn_config

logger = logging.getLogger(__name__)

BUNDLED_MODEL_NAME = "nanoserve-tiny"


def default_model_name(engine_args: EngineArgs) -> str:
    if engine_args.model is None:
        return BUNDLED_MODEL_NAME
    return os.path.basename(os.path.normpath(engine_args.model))


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
    # With tensor parallelism a lost rank kills the engine, and with data parallelism a lost replica the deployment:
    # a server that exits (non-zero) is one an orchestrator restarts, where one left answering 503 (or serving on at
    # a fraction of its capacity) would wait for a person.
    tp = engine_args.tensor_parallel_size > 1 or engine_args.data_parallel_size > 1
    try:
        with startup_objects_frozen(), asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(serve_with_drain(config, gate, async_engine, drain_timeout, exit_when_engine_dies=tp))
    finally:
        async_engine.shutdown()


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
