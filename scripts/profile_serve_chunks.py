"""CPU time per streamed chunk in the API server's event loop, under the serve benchmark's kind of load.

    python scripts/profile_serve_chunks.py [--num-prompts 200 --input-len 128 --output-len 128] [--repeat 3]
        [--profile srv.prof] [server flags, e.g. --model DIR]

Starts `python -m nanoserve.server.app --engine-process` (the bundled model unless --model is given), so the
server process holds only the HTTP side, sends all requests at once (streamed /v1/completions with ignore_eos
and include_usage, as `nanoserve bench serve` does), counts the chunks that carry a choice, and reads the CPU
time the server's main thread (the event loop) and the whole server process spent during the load from
/proc (loop_sys_s: the kernel's part, mostly the socket writes). CPU time, not wall time, but on a small
machine that others share it still moves by 10-20 %: use --repeat and compare the best runs of each side. The
per-chunk figure includes each request's fixed costs (parsing, validation, admission) spread over its chunks,
and the garbage collector's passes (one full collection over the server's startup objects costs ~0.2 s).

The engine merges outputs the reader has not taken yet, so a slower server sends fewer, fatter chunks: compare
runs by us/chunk and also look at chunks/request. To compare two versions, run this script from a checkout of
each with PYTHONPATH set to it. With --profile the server runs under cProfile (which inflates every Python call
several times over, so its figures mostly count calls), profiling only the loads, and writes PATH at exit:
`python -c "import pstats; pstats.Stats('srv.prof').sort_stats('tottime').print_stats(30)"`.
scripts/bench_stream_chunks.py measures the app's own share (no uvicorn, sockets or engine) more steadily.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

TICKS = os.sysconf("SC_CLK_TCK")

# The server's module with a cProfile of its main thread that SIGUSR1 starts and SIGUSR2 stops (so start-up and
# imports stay out of it), timed by the thread's CPU clock: wall-clock timing (cProfile's default) would charge a
# function for the time its thread waited for the GIL or for a core.
_PROFILED = """
import cProfile, runpy, signal, sys, time
sys.argv = sys.argv[1:]
profiler = cProfile.Profile(time.thread_time)
signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
signal.signal(signal.SIGUSR2, lambda *_: profiler.disable())
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
finally:
    profiler.dump_stats({path!r})
"""


def cpu_seconds(stat_path: str) -> tuple[float, float]:
    """(user, system) CPU seconds. The command name (field 2) may hold spaces; utime and stime are fields 14, 15."""
    fields = open(stat_path).read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


async def one(http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int) -> tuple[int, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks = tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"]:
                chunks += 1
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return chunks, tokens


async def load(url: str, pid: int, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        info = (await http.get("/v1/models")).json()["data"][0]
        rng = random.Random(0)
        prompts = [[rng.randrange(16, info["vocab_size"]) for _ in range(args.input_len)]
                   for _ in range(args.num_prompts)]
        await asyncio.gather(*(one(http, info["id"], p[:16], 8) for p in prompts[:8]))  # warm-up
        main_thread, process = f"/proc/{pid}/task/{pid}/stat", f"/proc/{pid}/stat"
        if args.profile:
            os.kill(pid, signal.SIGUSR1)
        loop0, proc0, wall0 = cpu_seconds(main_thread), cpu_seconds(process), time.perf_counter()
        results = await asyncio.gather(*(one(http, info["id"], p, args.output_len) for p in prompts))
        wall = time.perf_counter() - wall0
        loop1, proc1 = cpu_seconds(main_thread), cpu_seconds(process)
        if args.profile:
            os.kill(pid, signal.SIGUSR2)
    loop_user, loop_sys = loop1[0] - loop0[0], loop1[1] - loop0[1]
    loop_s, proc_s = loop_user + loop_sys, sum(proc1) - sum(proc0)
    chunks, tokens = sum(c for c, _ in results), sum(t for _, t in results)
    return {"requests": len(results), "chunks": chunks, "tokens": tokens, "wall_s": round(wall, 2),
            "loop_cpu_s": round(loop_s, 2), "loop_sys_s": round(loop_sys, 2), "process_cpu_s": round(proc_s, 2),
            "chunks_per_request": round(chunks / len(results), 1),
            "loop_us_per_chunk": round(loop_s / chunks * 1e6, 1),
            "process_us_per_chunk": round(proc_s / chunks * 1e6, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=1, help="loads to run against the same server")
    p.add_argument("--profile", default=None, help="run the server under cProfile, writing this file at exit")
    args, server_flags = p.parse_known_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ["-m", "nanoserve.server.app"]
    if args.profile:
        server = ["-c", _PROFILED.format(path=args.profile), "nanoserve.server.app"]
    cmd = [sys.executable, *server, "--host", "127.0.0.1", "--port", str(port), "--engine-process",
           "--max-num-seqs", "256", *server_flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        runs = []
        for _ in range(args.repeat):
            runs.append(asyncio.run(load(url, proc.pid, args)))
            print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    best = min(runs, key=lambda r: r["loop_us_per_chunk"])
    print(json.dumps({"benchmark": "serve_chunks", "args": sys.argv[1:], "best": best, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
