"""Command line: nanoserve serve | generate | chat | bench | worker."""

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from nanoserve import __version__
from nanoserve.args import HelpFormatter, add_engine_args, add_router_args, add_server_args, engine_args_from

BENCHMARKS = ("throughput", "latency", "serve", "prefix", "multi-turn", "long-context")
# The exit status of a command stopped by Ctrl-C, as a shell reports a process that SIGINT ended.
INTERRUPTED = 130


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                                  "with this much probability")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1: all")
    parser.add_argument("--sample-seed", type=int, default=None, help="seed of the sampling; None: unseeded")


def _sampling_params(ns: argparse.Namespace, **overrides):
    from nanoserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          seed=ns.sample_seed, **overrides)


def _stream(engine, request_id: str, render: Callable[[str], str] = lambda delta: delta,
            interrupted: Callable[[], bool] = lambda: False):
    """Print a request's text as it is generated (each delta through `render`); returns its final output, or
    None if `interrupted()` turned true first (the request is then aborted)."""
    shown = 0
    while True:
        if interrupted():
            engine.abort_request(request_id)
            print()
            return None
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            print(render(text[shown:]), end="", flush=True)
            shown = len(text)
            if out.finished:
                print()
                return out


@contextlib.contextmanager
def _sigint_as_flag() -> Iterator[threading.Event]:
    """Within the block Ctrl-C sets the event instead of raising: the engine's step is never cut in the middle,
    and the caller stops between steps."""
    hit = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hit.set())
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_generate(ns: argparse.Namespace) -> int:
    from nanoserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    engine.add_request("cli", ns.prompt, _sampling_params(ns))
    out = _stream(engine, "cli")
    c = out.outputs[0]
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
          f"finish_reason={c.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    """Interactive chat, streamed, with the calculator tool loop on models that have its tokens. Ctrl-C stops
    an answer (it is left out of the history, with its question); at the prompt it ends the chat."""
    from nanoserve.chat_engine import TOOL_MARKERS, ToolLoop, ToolTokens
    from nanoserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    tool_loop = ToolLoop.attach(engine, "chat-")
    # With tools, special tokens stay in the text (the history must hold the tool calls) and are
    # printed as markers: "[calculator: 123*456] 56088", then the answer on its own line.
    params = _sampling_params(ns, skip_special_tokens=tool_loop is None)
    markers = {f"<|{f.name}|>": TOOL_MARKERS.get(f.name, "") for f in dataclasses.fields(ToolTokens)}

    def render(delta: str) -> str:
        # Each special token's text arrives whole within one delta (the detokenizer never splits
        # ASCII), so replacing per delta is safe.
        for special, marker in markers.items():
            delta = delta.replace(special, marker)
        return delta

    messages: list[dict] = []
    print("nanoserve chat: type a message, or /quit (Ctrl-C stops an answer)", flush=True)
    for turn in itertools.count():
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line:
            _chat_turn(engine, f"chat-{turn}", messages, line, params, render)


def _chat_turn(engine, request_id: str, messages: list[dict], line: str, params, render: Callable[[str], str]) -> None:
    """Ask `line` and stream the answer; both join `messages` unless the answer was stopped or refused."""
    question = {"role": "user", "content": line}
    try:
        engine.add_request(request_id, engine.apply_chat_template([*messages, question]), params)
    except ValueError as e:  # e.g. the conversation has outgrown the context: the chat goes on
        print(f"error: {e}", flush=True)
        return
    with _sigint_as_flag() as interrupted:
        out = _stream(engine, request_id, render, interrupted.is_set)
    if out is None:
        print("[stopped]", flush=True)
        return
    text = out.outputs[0].text
    for terminal in ("<|assistant_end|>", "<|bos|>"):  # the template closes the turn itself
        text = text.removesuffix(terminal)
    messages += [question, {"role": "assistant", "content": text}]


def _take_model_tag(ns: argparse.Namespace) -> None:
    """`serve MODEL` sets --model; both, naming different directories, is an error."""
    if ns.model_tag is None:
        return
    if ns.model is not None and ns.model != ns.model_tag:
        raise ValueError(f"model: given twice, as {ns.model_tag!r} and as --model {ns.model!r}")
    ns.model = ns.model_tag


def cmd_serve(ns: argparse.Namespace) -> int:
    from nanoserve.server.app import run_server

    _take_model_tag(ns)
    return run_server(engine_args_from(ns), host=ns.host, port=ns.port, api_key=ns.api_key,
                      max_waiting_requests=ns.max_waiting_requests, drain_timeout=ns.drain_timeout,
                      served_model_name=ns.served_model_name, api_server_count=ns.api_server_count,
                      uvicorn_log_level=ns.uvicorn_log_level, disable_log_requests=ns.disable_log_requests,
                      tool_call_parser=ns.tool_call_parser, enable_auto_tool_choice=ns.enable_auto_tool_choice)


def cmd_worker(ns: argparse.Namespace) -> int:
    """The tensor-parallel ranks of one more node (node_rank >= 1), until node 0's engine stops them."""
    from nanoserve.worker.tp_worker import run_node

    _take_model_tag(ns)
    return run_node(engine_args_from(ns).create_config())


def cmd_router(ns: argparse.Namespace) -> int:
    from nanoserve.router.app import run_router_from

    return run_router_from(ns)


def cmd_bench(kind: str, argv: list[str]) -> int:
    """Run nanoserve/bench/<kind>.py with the rest of the command line, --help included."""
    module = importlib.import_module(f"nanoserve.bench.{kind.replace('-', '_')}")
    return module.main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", formatter_class=HelpFormatter,
                                     description="A small LLM inference engine and OpenAI-compatible server.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model directory, as vLLM's `serve MODEL` (the same as --model)")
    add_engine_args(serve)
    add_server_args(serve)
    gen = sub.add_parser("generate", help="one completion, streamed to stdout", formatter_class=HelpFormatter)
    add_engine_args(gen, serving=False)
    gen.add_argument("--prompt", required=True, help="the prompt's text")
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive terminal chat", formatter_class=HelpFormatter)
    add_engine_args(chat, serving=False)
    _sampling_args(chat)
    worker = sub.add_parser("worker", help="tensor-parallel ranks of another node (--node-rank 1 ..)",
                            formatter_class=HelpFormatter,
                            description="Run this node's share of the tensor-parallel ranks of an engine that "
                                        "node 0 runs (nanoserve serve ... --nnodes N --node-rank 0). Give the "
                                        "same model and engine flags as node 0, and this node's --node-rank.")
    worker.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the same as --model")
    add_engine_args(worker, serving=False)
    router = sub.add_parser("router", help="cache-aware routing over nanoserve servers (on several machines)",
                            formatter_class=HelpFormatter,
                            description="One OpenAI-compatible endpoint in front of `nanoserve serve` processes: "
                                        "each request goes to one of them, where its prompt's prefix is cached if "
                                        "it can (docs/scale_out.md).")
    add_router_args(router)
    bench = sub.add_parser("bench", help=f"{' | '.join(BENCHMARKS)} (flags: bench KIND --help)",
                           formatter_class=HelpFormatter)
    bench.add_argument("kind", choices=BENCHMARKS, help="the benchmark; `nanoserve bench KIND --help` lists its flags")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        # A benchmark parses its own flags: everything after its name goes to it, --help included.
        if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
            return cmd_bench(argv[1], argv[2:])
        ns = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "worker": cmd_worker,
                "router": cmd_router}[ns.command](ns)
    # A bad flag or config (a model that is not a directory, a length that does not fit) is the user's to fix: one
    # line naming the field, as argparse's own errors, not a traceback.
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
