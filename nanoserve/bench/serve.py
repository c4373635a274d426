"""The OpenAI server under load from a client process.

N streaming /v1/completions requests of random token-id prompts of an exact length, max_tokens with
ignore_eos (so every request generates exactly that many tokens), sent all at once (rate inf) or as
a seeded Poisson process. Reports request/s, output tok/s, and TTFT / TPOT / ITL mean, p50 and p99
in ms; the last line printed is one JSON object.

    python -m nanoserve.bench.serve --base-url http://127.0.0.1:8000 --num-prompts 500 --request-rate 16
    python -m nanoserve.bench.serve --launch --num-prompts 50 --model DIR --load-format dummy

With --launch, flags this benchmark does not know are passed to the server it starts (`nanoserve serve`): e.g.
--engine-process (the engine in a process of its own: on an H100 at rate inf it served 158.7 req/s against 92.8
with the engine on the server's thread, d224d89). The lengths default to the recipe's (512 and 128), scaled down
together on a model whose max_model_len (from /v1/models) is shorter than both.
"""

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from aiohttp.http_exceptions import HttpProcessingError
from tqdm import tqdm

from nanoserve.args import HelpFormatter, at_least_one
from nanoserve.bench.common import environment, json_line
from nanoserve.bench.launch import LaunchedServer, LaunchError, launch
from nanoserve.bench.lengths import fit_lengths

RECIPE = {"input_len": 512, "output_len": 128}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first token
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between token chunks


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="nanoserve bench serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load (ignored with --launch)")
    p.add_argument("--api-key", default=None, help="the server's --api-key")
    p.add_argument("--num-prompts", type=int, default=500, help="requests sent")
    p.add_argument("--input-len", type=at_least_one, default=None,
                   help="prompt length in tokens; None: 512, scaled down with --output-len where the model's "
                        "context is shorter than both")
    p.add_argument("--output-len", type=at_least_one, default=None,
                   help="max_tokens, with ignore_eos; None: 128, as --input-len")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight; None: no cap")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary of the random prompt ids; None: read from /v1/models")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    p.add_argument("--launch", action="store_true", help="start a server (nanoserve serve) with the unknown flags, "
                                                         "and stop it afterwards")
    # The launched server's address is this benchmark's to set (it loads that address), so these two are its own
    # flags, not passed through: passed through, a second --port would win in the server and not here.
    p.add_argument("--host", default="127.0.0.1", help="with --launch: the address the server listens on")
    p.add_argument("--port", type=int, default=None, help="with --launch: the server's port; None: a free one")
    p.add_argument("--launch-timeout", type=float, default=900,
                   help="seconds to wait for a launched server to load (one that exits fails at once)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args, rest = p.parse_known_args(argv)
    if rest and not args.launch:
        p.error(f"unrecognized arguments: {' '.join(rest)} (server flags need --launch)")
    if args.port is not None and not args.launch:
        p.error("--port: only with --launch (--base-url names the server to load)")
    return args, rest


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Low ids are often special tokens (bos, eos, pad); random prompts stay clear of them.
    low = min(16, vocab_size - 1)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(n)]


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]


async def send_one(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                   output_len: int) -> RequestResult:
    """Stream one completion from url (the server's /v1/completions); a failure comes back as the error text."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with http.post(url, json=body) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                return result
            async for raw in r.content:
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                # The server sends one chunk per engine step that produced a token.
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage chunk in the stream"
    # Besides the transport's errors: a line too long for aiohttp's reader (HttpProcessingError; ValueError in
    # older aiohttp) or one that is not JSON fails this request, not the whole run.
    except (aiohttp.ClientError, HttpProcessingError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_load(args: argparse.Namespace, base_url: str) -> tuple[dict, list[RequestResult], float, float]:
    """Send the requests; returns the server's model info, the results, the wall time and this client's CPU time
    over the same window (near the wall time means the client, not the server, set the pace)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base_url = base_url.rstrip("/")
    url = base_url + "/v1/completions"
    # aiohttp's default cap is 100 connections a session: past it, requests would wait in the client and that wait
    # would count as TTFT.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout) as http:
        async with http.get(base_url + "/v1/models") as r:
            r.raise_for_status()
            info = (await r.json())["data"][0]
        vocab = args.vocab_size or info.get("vocab_size")
        if vocab is None:
            raise SystemExit("the server does not report vocab_size; pass --vocab-size")
        # A server that does not report its context gets the recipe's lengths as they are.
        context = info.get("max_model_len") or sys.maxsize
        fit_lengths(args, RECIPE, lambda n: n["input_len"] + n["output_len"], context, "serve")
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
        warm = await send_one(http, url, info["id"], prompts[0][:16], 4)  # first-request costs stay out of the figures
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
        bar = tqdm(total=len(prompts), desc="requests", disable=args.no_progress, file=sys.stderr)

        async def limited(prompt: list[int]) -> RequestResult:
            async with gate:
                result = await send_one(http, url, info["id"], prompt, args.output_len)
            bar.update(1)
            return result

        spec_before = await spec_decode_counts(http, base_url)
        tasks = []
        start, cpu_start = time.perf_counter(), time.process_time()
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), args.request_rate, args.seed), strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        bar.close()
        spec_after = await spec_decode_counts(http, base_url)
        if spec_before is not None and spec_after is not None:  # a server running speculative decoding
            drafts, accepted = (after - before for after, before in zip(spec_after, spec_before, strict=True))
            info = info | {"mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0}
    return info, results, duration, client_cpu


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")


async def spec_decode_counts(http: aiohttp.ClientSession, base_url: str) -> tuple[float, float] | None:
    """The server's speculative drafts and accepted tokens so far (/metrics), or None when it has none (or no
    /metrics)."""
    async with http.get(base_url + "/metrics") as r:
        if r.status != 200:
            return None
        return spec_counts_in(await r.text())


def spec_counts_in(text: str) -> tuple[float, float] | None:
    from prometheus_client.parser import text_string_to_metric_families

    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name in SPEC_COUNTERS}
    return tuple(found[name] for name in SPEC_COUNTERS) if len(found) == len(SPEC_COUNTERS) else None


def summarize(args: argparse.Namespace, info: dict, results: list[RequestResult], duration: float,
              client_cpu: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "benchmark": "serve", "model": info["id"], "num_prompts": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "input_len": args.input_len, "output_len": args.output_len,
        "max_model_len": info.get("max_model_len"),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3), "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "client_cpu_s": round(client_cpu, 3),
    }
    if "mean_acceptance_length" in info:  # speculative decoding, over this run's requests
        summary["mean_acceptance_length"] = info["mean_acceptance_length"]
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", [g for r in ok for g in r.itl])):
        # No completed request, no figure: null in the JSON line, not NaN (which JSON does not have).
        ms = np.asarray(values) * 1000
        summary[f"mean_{name}_ms"] = round(float(ms.mean()), 3) if values else None
        summary[f"p50_{name}_ms"] = round(float(np.percentile(ms, 50)), 3) if values else None
        summary[f"p99_{name}_ms"] = round(float(np.percentile(ms, 99)), 3) if values else None
    errors = collections.Counter(r.error for r in results if not r.ok)
    if errors:
        summary["errors"] = dict(errors.most_common(5))  # each error's text and how many requests it ended
    return summary | environment()  # the commit as the other benchmarks report it (NANOSERVE_COMMIT first)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every request completed."""
    try:
        return 0 if run(argv)["failed"] == 0 else 1
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark and return the summary that its last line prints."""
    args, server_args = parse_args(argv)
    server: LaunchedServer | None = None
    if args.launch:
        server = launch(args.host, args.port, server_args, args.launch_timeout)
    try:
        info, results, duration, client_cpu = asyncio.run(run_load(args, server.url if server else args.base_url))
    finally:
        if server is not None:
            server.stop()
    summary = summarize(args, info, results, duration, client_cpu)
    print(f"{summary['completed']}/{summary['num_prompts']} requests in {summary['duration_s']} s: "
          f"{summary['request_throughput']} req/s, {summary['output_throughput']} output tok/s; "
          f"TTFT p50 {summary['p50_ttft_ms']} ms, TPOT p50 {summary['p50_tpot_ms']} ms, "
          f"ITL p50 {summary['p50_itl_ms']} ms", file=sys.stderr)
    if summary["failed"]:
        reasons = "; ".join(f"{n} x {error}" for error, n in summary["errors"].items())
        print(f"{summary['failed']} of {summary['num_prompts']} requests failed: {reasons}", file=sys.stderr)
    print(json_line(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(main())
