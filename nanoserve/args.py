"""Command-line flags shared by the entry points: `nanoserve` (cli.py), `python -m nanoserve.server.app` and
`nanoserve bench ...` (bench/). Here, beside config.py, and not in cli.py: the CLI sits above the server (it
imports server/), so the server and the benchmarks take their flags from this module, as the CLI does.
"""

import argparse
import dataclasses
import json
import typing

from nanoserve.config import ROUTING_POLICIES, EngineArgs

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# EngineArgs fields only the server reads (they place and profile its engine process): generate, chat, worker and
# the offline benchmarks build an engine in their own process and leave them out of their flags.
SERVING_ONLY = ("engine_process", "profile_engine", "data_parallel_size", "data_parallel_routing")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every optional flag's help ends with its default; a description keeps its line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required:
            return action.help or ""
        return super()._get_help_string(action)


def add_engine_args(parser: argparse.ArgumentParser, serving: bool = True) -> None:
    """One flag per EngineArgs field, so the CLI, LLM(...) and EngineArgs share their names; serving=False leaves
    out those only a server reads (SERVING_ONLY)."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if not serving and f.name in SERVING_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        help_ = f.metadata["help"]
        if kind is bool or kind == bool | None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        elif kind == dict | None:  # vLLM's --speculative-config: a JSON object on the command line
            parser.add_argument(flag, type=json_object, default=f.default, metavar="JSON", help=help_)
        else:
            # `int | None` and the like: the flag parses the non-None member.
            base = next(a for a in typing.get_args(kind) if a is not type(None)) if typing.get_args(kind) else kind
            parser.add_argument(flag, type=base, default=f.default, help=help_)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's own flags (`nanoserve serve` and `python -m nanoserve.server.app`)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None, help="the key clients must send as a bearer token; None: no key")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="one or more names clients may give as `model`; None: the model directory's name")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests that may wait to run before new ones get 429")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds that running requests get to finish on SIGTERM / Ctrl-C")
    parser.add_argument("--api-server-count", type=at_least_one, default=1,
                        help="API server processes (HTTP, tokenizing, streaming) in front of one engine process; "
                             "more than 1 runs the engine in a process of its own")
    parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                        help="uvicorn's own log level")
    parser.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let chat requests with tools use tool_choice "auto" (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None,
                        choices=["hermes", "llama3_json", "mistral", "pythonic", "nanochat"],
                        help="how a model writes tool calls (hermes: Qwen and Hermes; llama3_json: Llama 3.1/3.2; "
                             "mistral; pythonic: Llama 3.2/4 pythonic; nanochat: the bundled model); None: nanochat "
                             "on a model with its tokens (and auto tool choice on), else none")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs of the flags parsed; a field the command has no flag for keeps its default."""
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names() if hasattr(ns, name)})


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """`nanoserve router`'s flags (router/app.py)."""
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="a nanoserve server's root URL (http://host:port); repeat for each; more can be added "
                             "while running (POST /router/backends)")
    parser.add_argument("--policy", choices=ROUTING_POLICIES, default="cache_aware",
                        help="which backend takes a request (docs/scale_out.md)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None, help="the key clients must send as a bearer token; None: no key")
    parser.add_argument("--health-check-interval", type=float, default=2.0,
                        help="seconds between checks of each backend's /health")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds that requests in flight get to finish on SIGTERM / Ctrl-C")
    parser.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                        help="uvicorn's own log level")
