"""--data-parallel-size 2: one server, two engine processes, as a real `nanoserve serve` on 127.0.0.1.

Every request is answered once (streamed and not), both replicas take work, the same greedy prompt gives the same
text on either, requests sharing a long prefix land on one replica (its prefix-cache hits, from /metrics' per-engine
series, are what one engine's would be), /health, /metrics and /v1/engine/stats cover both, and a killed replica ends
the server with exit status 1. The policy's own choices are tested in tests/engine/test_routing.py.
"""

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanoserve.bench import multi_turn

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

SHARED = "You are a careful assistant. Answer briefly and cite the manual where you can. " * 3  # ~200 tokens


@pytest.fixture(scope="module")
def deployments(launch_together):
    """Both deployments of this module, started together (two GPUs are not a given: on the CPU): one API server,
    and two in front of the replicas (test_replicas_behind_several_api_servers)."""
    return launch_together(
        ("--data-parallel-size", "2", "--device", "cpu"),
        ("--data-parallel-size", "2", "--api-server-count", "2", "--device", "cpu"),
    )


@pytest.fixture(scope="module")
def dp(deployments):
    return deployments[0]


def _per_engine(server, name: str) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_every_request_answered_once_on_both_replicas(dp):
    before = _per_engine(dp, "vllm:prompt_tokens_total")

    async def one(client, i: int) -> str:
        # Distinct, unrelated prompts: nothing to follow, so least load spreads them.
        prompt = f"{i} " * (3 + i) + "tell me"
        if i % 2:
            out = await client.completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            assert len(out.choices) == 1 and out.usage.completion_tokens == 6
            return out.choices[0].text
        stream = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [c async for c in stream]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        return "".join(c.choices[0].text for c in chunks if c.choices)

    async def main() -> list[str]:
        async with dp.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    texts = asyncio.run(main())
    assert len(texts) == 12 and all(texts)
    after = _per_engine(dp, "vllm:prompt_tokens_total")
    assert all(after[e] > before.get(e, 0) for e in ("0", "1")), (before, after)
    health = dp.wait_idle()
    assert health["status"] == "ok" and [e["engine"] for e in health["engines"]] == [0, 1]
    assert health["kv_blocks_total"] == sum(e["kv_blocks_total"] for e in health["engines"])
    # The same greedy prompt on either replica: the same text (one model, loaded twice).
    client = dp.client()
    again = [
        client.completions.create(
            model="tiny-llama", prompt="1 1 1 1 tell me", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert again == [texts[1]] * 2


def test_shared_prefix_stays_on_one_replica(dp):
    dp.wait_idle()
    hits = _per_engine(dp, "vllm:prefix_cache_hits_total")
    client = dp.client()
    prompt_tokens = []
    for i in range(5):
        out = client.completions.create(model="tiny-llama", prompt=SHARED + f"Question {i}: why?", max_tokens=2)
        prompt_tokens.append(out.usage.prompt_tokens)
    gained = {e: v - hits[e] for e, v in _per_engine(dp, "vllm:prefix_cache_hits_total").items()}
    # One engine alone: the first request fills the shared prefix's full blocks, each later one finds them all.
    shared_blocks = len(httpx.post(dp.url + "/tokenize", json={"prompt": SHARED}).json()["tokens"]) // 16
    one_engine = 4 * shared_blocks * 16
    assert sorted(gained.values())[0] == 0, gained  # the other replica saw none of them
    assert max(gained.values()) >= one_engine, (gained, one_engine, prompt_tokens)


def test_engine_stats_cover_both_replicas(dp):
    stats = httpx.get(dp.url + "/v1/engine/stats", timeout=10).json()
    assert stats["config"]["data_parallel_size"] == 2
    assert [e["engine"] for e in stats["engines"]] == [0, 1]
    assert stats["kv_grid"]["num_blocks"] == 2 * 256  # both pools, side by side
    assert stats["prefix_cache_hits"] == sum(e["prefix_cache_hits"] for e in stats["engines"])


def test_multi_turn_bench_over_the_replicas(dp, capsys):
    # `bench multi-turn --base-url`: each conversation's second turn finds its first turn's blocks cached, which it
    # does only on the replica that served the first turn. The shared system prompt alone is no reason to follow a
    # replica (routing.py), so each question fills two blocks of its own: the match beyond the shared prefix.
    assert (
        multi_turn.main(
            [
                "--base-url",
                dp.url,
                "--num-conversations",
                "3",
                "--turns",
                "2",
                "--system-len",
                "64",
                "--question-len",
                "32",
                "--answer-len",
                "8",
                "--max-concurrency",
                "2",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["cached_tokens"] == 3 * 96 and result["ttft_p50_ms"] > 0, result


def test_killed_replica_ends_the_server_non_zero(dp):
    pids = re.search(r"replicas of the engine, in processes (\d+), (\d+)", dp.log())
    assert pids, dp.log()
    os.kill(int(pids.group(2)), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while dp.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dp.proc.poll() == 1, dp.log()[-3000:]
    assert "engine 1: the engine process was killed by SIGKILL" in dp.log()


def test_replicas_behind_several_api_servers(deployments):
    # Each API server routes over its own channel into each replica; a lost replica stops them all.
    server = deployments[1]

    async def one(i: int) -> tuple[str, int]:
        async with server.async_client() as client:  # a connection of its own: either API server may take it
            raw = await client.completions.with_raw_response.create(
                model="tiny-llama", prompt=f"{i} " * (3 + i), max_tokens=4, extra_body={"ignore_eos": True}
            )
            return raw.headers["x-nanoserve-api-server"], raw.parse().usage.completion_tokens

    async def main() -> list[tuple[str, int]]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    answered = asyncio.run(main())
    assert [tokens for _, tokens in answered] == [4] * 8
    assert all(v > 0 for v in _per_engine(server, "vllm:prompt_tokens_total").values())
    engines = re.search(r"the engine in its own process \(pid (\d+), (\d+)\)", server.log())
    assert engines, server.log()
    os.kill(int(engines.group(1)), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.poll() == 1, server.log()[-3000:]
    assert "engine 0: the engine process was killed by SIGKILL: stopping the API servers" in server.log()
