"""How fast can `nanoserve bench serve`'s client go? Runs its load against a stand-in server that answers every
streamed completion at once (chunks shaped like ours, no model), so the figures are the client's ceiling.

    python scripts/serve_client_ceiling.py [--num-prompts 500 --output-len 128]

The stand-in runs in a process of its own; ends with bench serve's JSON line (its client_cpu_s against
duration_s says how busy the client was).
"""

import asyncio
import json
import multiprocessing
import socket
import sys
import time

from nanoserve.bench import serve

MODELS = json.dumps({"object": "list", "data": [{"id": "stand-in", "object": "model", "vocab_size": 1000}]})


def _chunk(i: int, last: bool) -> bytes:
    body = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "stand-in",
            "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": "length" if last else None}]}
    data = f"data: {json.dumps(body)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, output_len: int) -> None:
    usage = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "stand-in", "choices": [],
             "usage": {"prompt_tokens": 1, "completion_tokens": output_len, "total_tokens": output_len + 1}}
    tail = f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")), 0)
        await reader.readexactly(length)
        if lines[0].startswith("GET"):
            body = (MODELS if "/v1/models" in lines[0] else "{}").encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            continue
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(output_len):
            writer.write(_chunk(i, i == output_len - 1))
            await writer.drain()
            await asyncio.sleep(0)  # one chunk per turn of the loop, as a server streaming a step at a time
        writer.write(f"{len(tail):x}\r\n".encode() + tail + b"\r\n0\r\n\r\n")


def _stand_in(sock: socket.socket, output_len: int) -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: _handle(r, w, output_len), sock=sock)
        await server.serve_forever()

    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.IncompleteReadError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    output_len = int(argv[argv.index("--output-len") + 1]) if "--output-len" in argv else 128
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    proc = multiprocessing.get_context("spawn").Process(target=_stand_in, args=(sock, output_len), daemon=True)
    proc.start()
    time.sleep(1)
    try:
        summary = serve.run(["--base-url", f"http://127.0.0.1:{sock.getsockname()[1]}", "--no-progress", *argv])
    finally:
        proc.terminate()
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
