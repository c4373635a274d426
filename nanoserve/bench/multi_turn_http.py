"""`bench multi-turn --base-url URL`: the multi-turn recipe against a running server (or router), to compare routing.

The conversations are bench/multi_turn.py's (a shared system prompt, each conversation's history growing turn by
turn), sent as token-id prompts to /v1/completions with max_tokens 1, so that a request's time is its time to first
token. Turn by turn: every conversation's turn t is sent, up to --max-concurrency at once, before any turn t + 1, so
that by the time a conversation comes back the others have pushed its history out of a small KV pool; each turn's
conversations go in a new seeded order, as users' do. What it
measures, from turn 2 on: TTFT (the request's whole time, the client's view) and the prompt tokens the server found
cached (`usage.prompt_tokens_details.cached_tokens`), as a hit rate. Run it against `serve --data-parallel-size N
--data-parallel-routing POLICY` for each policy, against one replica with N times the KV pool, or through
`nanoserve router`, with the same flags.
"""

import argparse
import asyncio
import random
import time

import aiohttp
import numpy as np

from nanoserve.bench.lengths import fit_lengths


async def run_http(ns: argparse.Namespace, recipe: dict, conversations, history) -> dict:
    """The figures of one run against ns.base_url; `conversations(vocab, ns)` and `history(lengths)` are
    bench/multi_turn.py's."""
    base = ns.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    async with aiohttp.ClientSession(
        base, headers=headers, connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    ) as http:
        async with http.get("/v1/models") as r:
            r.raise_for_status()
            model = (await r.json())["data"][0]
        fit_lengths(ns, recipe, history, model["max_model_len"], "multi-turn")
        system, turns = conversations(model["vocab_size"], ns)
        histories = [list(system) for _ in turns]
        limit = asyncio.Semaphore(ns.max_concurrency)
        times: list[float] = []
        prompt_tokens = cached = 0

        async def send(index: int, t: int) -> None:
            nonlocal prompt_tokens, cached
            question, answer = turns[index][t]
            body = {
                "model": model["id"],
                "prompt": histories[index] + question,
                "max_tokens": 1,
                "temperature": 0,
                "ignore_eos": True,
            }
            async with limit:
                start = time.perf_counter()
                async with http.post("/v1/completions", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"/v1/completions answered {r.status}: {await r.text()}")
                    out = await r.json()
                seconds = time.perf_counter() - start
            usage = out["usage"]
            if t:
                times.append(seconds)
                prompt_tokens += usage["prompt_tokens"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            # The one generated token is not known as an id here: the answer's random ids stand for it too.
            histories[index] += question + answer

        # Each turn in its own seeded order: in one fixed order, round-robin over N replicas sends conversation i
        # to replica i mod N every turn (as sticky as cache-aware routing, by accident of the benchmark).
        rng = random.Random(ns.seed)
        for t in range(ns.turns):
            order = rng.sample(range(len(turns)), len(turns))
            await asyncio.gather(*(send(i, t) for i in order))
    return {
        "bench": "multi-turn",
        "base_url": base,
        "model": model["id"],
        "num_conversations": ns.num_conversations,
        "turns": ns.turns,
        "system_len": ns.system_len,
        "question_len": ns.question_len,
        "answer_len": ns.answer_len,
        "max_concurrency": ns.max_concurrency,
        "ttft_p50_ms": round(1e3 * float(np.median(times)), 2) if times else None,
        "ttft_mean_ms": round(1e3 * float(np.mean(times)), 2) if times else None,
        "ttft_p99_ms": round(1e3 * float(np.percentile(times, 99)), 2) if times else None,
        "cached_tokens": cached,
        "prefix_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else None,
    }
