"""CPU per streamed chunk in the app alone: the real FastAPI app (build_app) over a stub engine, its ASGI
interface called directly, with no uvicorn, sockets or engine.

    python scripts/bench_stream_chunks.py [--streams 200] [--tokens 128] [--chat] [--rounds 5]

Each round opens --streams streamed requests (include_usage), then hands every stream one cumulative output
per step (one token each, as a busy engine step does) until --tokens, and charges the process CPU time of
the steps to the chunks sent. What it measures is what the server's event loop spends per chunk between an
engine output arriving and the ASGI send (metrics, chunk encoding, the response, the stream wake-up) and
nothing else: scripts/profile_serve_chunks.py measures the whole server. Prints the best round (least
disturbed by other processes) and all rounds, as one JSON line.
"""

import argparse
import asyncio
import gc
import json
import time
from types import SimpleNamespace

import uvloop

from nanoserve.engine.streams import RequestGroup, RequestStream
from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.server.app import build_app


class StubEngine:
    """What build_app and the serving code ask of an AsyncEngine; submit() precomputes every output."""

    def __init__(self, tokens: int) -> None:
        config = SimpleNamespace(args=SimpleNamespace(max_num_seqs=1024), model=SimpleNamespace(vocab_size=1000),
                                 model_dir="stub")
        self.engine = SimpleNamespace(config=config, validate_prompt=lambda ids: None, tokenizer=None)
        self.max_model_len, self.num_waiting, self.tokens = 4096, 0, tokens
        self.streams: list[tuple[RequestStream, list[RequestOutput]]] = []

    def setup(self, fn) -> None:
        pass

    async def tokenize(self, prompt: list[int]) -> list[int]:
        return prompt

    async def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return [1, 2, 3]

    def submit(self, requests) -> RequestGroup:
        wake = asyncio.Event()
        streams = []
        for request_id, ids, _ in requests:
            streams.append(RequestStream(request_id, asyncio.get_running_loop(), wake))
            now = time.monotonic()
            metrics, outputs, text = RequestMetrics(now, now, now), [], ""
            for t in range(self.tokens):
                text += f" tok{t}é"
                done = t == self.tokens - 1
                sample = CompletionOutput(0, text, list(range(t + 1)), finish_reason="length" if done else None)
                outputs.append(RequestOutput(request_id, None, ids, [sample], done, metrics=metrics))
            self.streams.append((streams[-1], outputs))
        return RequestGroup(self, streams, wake)

    def abort(self, request_id: str) -> None:
        pass


async def one_round(args: argparse.Namespace) -> float:
    engine = StubEngine(args.tokens)
    app = build_app(engine, "stub")
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    body = {"max_tokens": args.tokens, "stream": True, "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "hi"}]} if args.chat else {"prompt": [1, 2, 3]})}
    data = json.dumps(body).encode()
    counts = {"started": 0, "sent": 0}  # http.response.start messages, http.response.body messages

    async def request() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        pending = [{"type": "http.request", "body": data, "more_body": False}]
        client_gone = asyncio.get_running_loop().create_future()  # never: the client stays

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await client_gone
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            counts["started" if message["type"] == "http.response.start" else "sent"] += 1

        await app(scope, receive, send)

    tasks = [asyncio.ensure_future(request()) for _ in range(args.streams)]
    while counts["started"] < args.streams:
        await asyncio.sleep(0)
    gc.collect()
    cpu = time.process_time()
    for step in range(args.tokens):
        for stream, outputs in engine.streams:
            stream.put(outputs[step])
        # A stream's reader takes its output and sends what it makes in one go (the stub's send never waits),
        # so once nothing is pending every chunk of the step was sent.
        while any(stream.pending for stream, _ in engine.streams):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.process_time() - cpu) / (args.streams * args.tokens) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true", help="stream /v1/chat/completions, not /v1/completions")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rounds = [round(uvloop.run(one_round(args)), 2) for _ in range(args.rounds)]
    print(json.dumps({"benchmark": "stream_chunks_app", "streams": args.streams, "tokens": args.tokens,
                      "endpoint": "chat" if args.chat else "completions", "best_us_per_chunk": min(rounds),
                      "rounds_us_per_chunk": rounds}))


if __name__ == "__main__":
    main()
