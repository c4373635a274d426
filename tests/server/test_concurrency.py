"""Many clients at once, and clients that leave: nothing one client does may hang the others or leak
KV blocks."""

import asyncio

import httpx


def test_64_concurrent_streams_get_exactly_their_tokens(server):
    async def one(client, i):
        stream = await client.completions.create(
            model="tiny-llama", prompt=f"client {i} says", max_tokens=16, temperature=0.8, seed=i,
            stream=True, logprobs=0, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens, reasons, usage = 0, [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                tokens += len(c.logprobs.tokens)
                reasons.append(c.finish_reason)
        return tokens, [r for r in reasons if r], usage

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert results == [(16, ["length"], 16)] * 64
    health = server.wait_idle()
    assert health["running"] == 0 and health["waiting"] == 0


def _assert_all_blocks_free(server) -> None:
    health = server.wait_idle(timeout=10)
    assert health["running"] == 0 and health["waiting"] == 0, health
    # Blocks parked in the prefix cache count as free: with nothing running every block is free.
    assert health["kv_blocks_free"] == health["kv_blocks_total"], health


def test_stream_disconnect_aborts_and_frees_blocks(server):
    body = {"prompt": "a long one", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.health()["running"] == 1
    # The connection is closed here, long before 400 tokens.
    _assert_all_blocks_free(server)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'nanoserve_request_success_total{finish_reason="abort"}' in metrics


def test_non_stream_disconnect_aborts(server):
    body = {"prompt": "another long one", "max_tokens": 480, "ignore_eos": True}
    generated_before = _generation_tokens(server)
    try:
        # 0.1 s: 480 tokens took 0.56 s here; 0.3 s left under 2x of headroom should CPU decoding get faster.
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.1)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("480 tokens finished within 0.1 s; the test needs a longer request")
    _assert_all_blocks_free(server)
    assert _generation_tokens(server) - generated_before < 480  # aborted, not run to its end


def _generation_tokens(server) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return float(next(line.split()[-1] for line in metrics.splitlines()
                      if line.startswith("nanoserve_generation_tokens_total ")))
