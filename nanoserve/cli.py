"""Command line: nanoserve serve | generate | chat | bench."""

import argparse
import dataclasses
import sys
import typing

from nanoserve.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, so the CLI, LLM(...) and EngineArgs share their names."""
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool or kind == bool | None:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            # `int | None` and the like: the flag parses the non-None member.
            base = next(a for a in typing.get_args(kind) if a is not type(None)) if typing.get_args(kind) else kind
            parser.add_argument(flag, type=base, default=f.default)


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
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=1024)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--api-server-count", type=at_least_one, default=1,
                        help="API server processes (HTTP, tokenizing, streaming) in front of one engine process; "
                             "more than 1 runs the engine in a process of its own")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names()})


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sample-seed", type=int, default=None)


def _sampling_params(ns: argparse.Namespace, **overrides):
    from nanoserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                          seed=ns.sample_seed, **overrides)


def _stream(engine, request_id: str, render=lambda delta: delta):
    """Print a request's text as it is generated (each delta through `render`); returns its final output."""
    shown = 0
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            text = out.outputs[0].text
            print(render(text[shown:]), end="", flush=True)
            shown = len(text)
            if out.finished:
                print()
                return out


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
    """Interactive chat, streamed, with the calculator tool loop on models that have its tokens."""
    from nanoserve.chat_engine import ToolLoop
    from nanoserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    tool_loop = ToolLoop.attach(engine, "chat-")
    # With tools, special tokens stay in the text (the history must hold the tool calls) and are
    # printed as markers: "[calculator: 123*456] 56088", then the answer on its own line.
    params = _sampling_params(ns, skip_special_tokens=tool_loop is None)
    markers = {"<|python_start|>": "[calculator: ", "<|python_end|>": "] ", "<|output_start|>": "",
               "<|output_end|>": "\n", "<|assistant_end|>": "", "<|bos|>": ""}

    def render(delta: str) -> str:
        # Each special token's text arrives whole within one delta (the detokenizer never splits
        # ASCII), so replacing per delta is safe.
        for special, marker in markers.items():
            delta = delta.replace(special, marker)
        return delta

    messages: list[dict] = []
    turn = 0
    print("nanoserve chat: type a message, or /quit", flush=True)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        engine.add_request(f"chat-{turn}", engine.apply_chat_template(messages), params)
        text = _stream(engine, f"chat-{turn}", render).outputs[0].text
        for terminal in ("<|assistant_end|>", "<|bos|>"):  # the template closes the turn itself
            text = text.removesuffix(terminal)
        messages.append({"role": "assistant", "content": text})
        turn += 1


def cmd_serve(ns: argparse.Namespace) -> int:
    from nanoserve.server.app import run_server

    return run_server(engine_args_from(ns), host=ns.host, port=ns.port, api_key=ns.api_key,
                      max_waiting_requests=ns.max_waiting_requests, drain_timeout=ns.drain_timeout,
                      served_model_name=ns.served_model_name, api_server_count=ns.api_server_count)


def cmd_bench(ns: argparse.Namespace, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(f"nanoserve.bench.{ns.kind}")
    return module.main(rest) or 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanoserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_server_args(serve)
    gen = sub.add_parser("generate", help="one completion, streamed to stdout")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    _sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive terminal chat")
    add_engine_args(chat)
    _sampling_args(chat)
    bench = sub.add_parser("bench", help="throughput | latency | serve | prefix (flags: bench KIND --help)")
    bench.add_argument("kind", choices=["throughput", "latency", "serve", "prefix"])
    ns, rest = parser.parse_known_args(argv)
    if ns.command == "bench":
        return cmd_bench(ns, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat}[ns.command](ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
