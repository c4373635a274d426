"""The engine view behind the web page: the KV pool's block grid (engine/block_view.py), the step recorder
(engine/step_view.py) as the EngineCore loop runs it while someone watches, and the two endpoints,
GET /v1/engine/stats and GET /v1/engine/events (server/engine_view.py), on real servers: one API server and
one with an API key. On the servers other tests start anyway: several API servers each serving the view
(tests/server/test_api_servers.py), the event stream ending when the server drains (tests/server/test_shutdown.py)."""

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

from nanoserve.config import EngineArgs
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.block_view import GPU_STATES, gpu_grid, grid_of
from nanoserve.engine.request import Request, Sequence
from nanoserve.runtime.async_engine import AsyncEngine
from nanoserve.sampling_params import SamplingParams


# -- the block grid ------------------------------------------------------------------------------------------
def _seq(tokens: list[int]) -> Sequence:
    request = Request("r", None, tokens, SamplingParams(max_tokens=1), max_tokens=1)
    return Sequence(request, 0, list(tokens), len(tokens), detokenizer=None)


def _run(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence that computed all its tokens, with its full blocks in the prefix cache."""
    seq = _seq(tokens)
    bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq


def test_grid_tells_free_used_prefix_and_cached_blocks():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    assert gpu_grid(bm).totals() == {"free": 16, "used": 0, "prefix": 0, "cached": 0}
    running = _run(bm, list(range(10)))  # 2 full blocks (cached) + 1 filling
    done = _run(bm, list(range(100, 108)))  # 2 full blocks
    bm.free_seq(done)  # parked in the free queue, still in the cache
    grid = gpu_grid(bm)
    assert grid.totals() == {"free": 11, "used": 1, "prefix": 2, "cached": 2}
    assert grid.num_cells == 16  # a small pool: one cell per block, in block id order
    cells = grid.array().tolist()
    state = {block: GPU_STATES[cells[block].index(1)] for block in range(16)}
    assert [state[b] for b in running.block_table] == ["prefix", "prefix", "used"]
    assert all(state[b] == "cached" for b in done.block_table)


def test_grid_of_a_large_pool_has_at_most_max_cells_and_counts_every_block():
    rng = np.random.default_rng(0)
    state = rng.integers(0, 4, size=100_003)
    grid = grid_of(state, GPU_STATES, max_cells=1024)
    assert grid.num_cells == 1024
    cells = grid.array()
    assert grid.per_state()["used"] == cells[:, 1].tolist()
    assert cells.sum() == 100_003
    assert grid.totals() == {name: int((state == i).sum()) for i, name in enumerate(GPU_STATES)}
    # Block i is in cell i * cells // n: cell c's run of blocks starts at ceil(c * n / cells).
    bounds = -(-np.arange(1025) * 100_003 // 1024)
    for c in (0, 511, 1023):
        expected = np.bincount(state[bounds[c]:bounds[c + 1]], minlength=4)
        assert cells[c].tolist() == expected.tolist()


# -- the step recorder, through the engine loop --------------------------------------------------------------
async def _watched_run(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> list:
    engine.watch(30)
    for _ in range(500):
        if engine.stats.view is not None:
            break
        await asyncio.sleep(0.01)
    before = engine.stats.view
    assert before is not None, "a watched engine publishes a view, even idle"
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    groups = [engine.submit([(f"r{i}", ids, params)]) for i, ids in enumerate(prompts)]

    async def drain(group):
        async for _ in group:
            pass

    await asyncio.gather(*(drain(g) for g in groups))
    return [before, engine.stats.view]


@pytest.mark.parametrize("engine_process,async_scheduling", [(False, False), (False, True), (True, True)],
                         ids=["thread-sync", "thread-async", "process-async"])
def test_view_counts_every_step_token_first_token_and_finished_request(engine_process, async_scheduling):
    # No prefix caching: every prompt token is computed, so the counts are exact.
    engine = AsyncEngine.from_engine_args(EngineArgs(num_kv_blocks=64, engine_process=engine_process,
                                                     async_scheduling=async_scheduling, enable_prefix_caching=False,
                                                     max_num_batched_tokens=64))
    prompts = [list(range(1, 1 + n)) for n in (30, 45, 100)]  # 100 tokens: two prefill chunks of a 64 budget
    try:
        assert engine.stats.view is None  # nobody watched yet
        before, after = asyncio.run(_watched_run(engine, prompts, max_tokens=12))
    finally:
        engine.shutdown()
    assert after.prefill_tokens - before.prefill_tokens == 175
    assert after.decode_tokens - before.decode_tokens == 3 * 11  # the first token of each comes from its prefill
    assert after.ttft_count - before.ttft_count == 3
    assert after.ttft_sum > before.ttft_sum
    assert after.itl_count - before.itl_count == 33 and after.itl_sum > before.itl_sum
    assert after.finished - before.finished == 3
    assert after.steps - before.steps >= 12
    assert after.batch_seqs - before.batch_seqs >= 3 * 12
    assert after.grid.totals()["used"] == 0  # the view the engine went idle with is up to date


def test_view_stops_when_the_watch_lapses():
    engine = AsyncEngine.from_engine_args(EngineArgs(num_kv_blocks=64, engine_process=False))

    async def main():
        engine.watch(0.2)
        for _ in range(200):
            if engine.stats.view is not None:
                break
            await asyncio.sleep(0.01)
        assert engine.stats.view is not None
        await asyncio.sleep(0.3)  # the lease is over; the next iteration drops the view
        async for _ in engine.submit([("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]):
            pass
        return engine.stats

    try:
        stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert stats.view is None and stats.generation_tokens == 4


# -- the endpoints -------------------------------------------------------------------------------------------
def _events(url: str, headers: dict | None = None, until=None, limit: int = 400, out: list | None = None,
            **params) -> list[dict]:
    """Events from /v1/engine/events until until(events) (or `limit` events, or the stream's end), appended to
    `out` as they come."""
    events = out if out is not None else []
    with httpx.stream("GET", url + "/v1/engine/events", headers=headers, params=params, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) >= limit or (until is not None and until(events)):
                    break
    return events


def _load(server, n: int, max_tokens: int) -> list[threading.Thread]:
    def one(i: int) -> None:
        server.client().completions.create(model="tiny-llama", prompt=f"request {i}", max_tokens=max_tokens,
                                           extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_stats_snapshot(server):
    server.wait_idle()
    body = httpx.get(server.url + "/v1/engine/stats", timeout=30).json()
    assert body["status"] == "ok" and body["running"] == 0 and body["waiting"] == 0
    assert body["kv_blocks_total"] == 256
    grid = body["kv_grid"]
    assert grid["num_blocks"] == 256 and grid["num_cells"] == 256
    assert list(grid["counts"]) == ["free", "used", "prefix", "cached"]
    assert all(len(cells) == 256 for cells in grid["counts"].values())
    assert sum(map(sum, grid["counts"].values())) == 256 and grid["totals"]["used"] == 0
    assert body["totals"]["steps"] >= 0 and body["finished"] >= 0
    assert body["config"]["block_size"] == 16 and body["config"]["model"] == "tiny-llama"
    assert set(body["last_step"]) == {"decode_tokens", "prefill_tokens", "num_seqs", "ms"}


def _grid_in_use(events: list[dict]) -> int:
    """Blocks held by running requests in the latest grid of the stream (a grid is sent when it changed)."""
    totals = next(e["kv_grid"]["totals"] for e in reversed(events) if e.get("kv_grid"))
    return totals["used"] + totals["prefix"]


def test_events_follow_requests_through_the_engine(server):
    server.wait_idle()
    threads = _load(server, 6, 200)
    try:
        events = _events(server.url, until=lambda ev: ev[-1]["running"] >= 2 and _grid_in_use(ev) > 0)
    finally:
        for t in threads:
            t.join()
    assert events[0]["window"] is None  # a first event has nothing before it
    assert events[0]["kv_grid"]["num_blocks"] == 256
    # Then they are over: the running count and the grid come back to nothing held.
    tail = _events(server.url, until=lambda ev: ev[-1]["running"] == 0 and _grid_in_use(ev) == 0)
    assert tail[-1]["finished"] >= 6 and tail[-1]["kv_blocks_used"] == 0
    assert all(e["window"]["seconds"] > 0 for e in tail[1:])


def test_events_windows_count_the_steps_of_a_run(server):
    server.wait_idle()
    seen: list[dict] = []
    reader = threading.Thread(target=_events, args=(server.url,), kwargs={"out": seen, "limit": 10_000, "until": (
        lambda ev: ev[-1]["running"] == 0 and ev[-1]["generation_tokens"] - ev[0]["generation_tokens"] >= 160)})
    reader.start()
    while not seen:  # the stream is open before the requests start
        time.sleep(0.05)
    for t in _load(server, 4, 40):
        t.join()
    reader.join()
    windows = [e["window"] for e in seen[1:]]
    generated = sum(w["generation_tokens"] for w in windows)
    assert generated == seen[-1]["generation_tokens"] - seen[0]["generation_tokens"] >= 160
    if all("steps" in w for w in windows):  # the view was on for the whole stream
        assert sum(w["decode_tokens"] for w in windows) >= 4 * 39 - 4  # at most one first token per request lost
        assert max(w["itl_count"] for w in windows) > 0


@pytest.mark.parametrize("value", ["0.01", "abc", "nan", "1e9"])
def test_bad_interval_is_a_400_naming_it(server, value):
    r = httpx.get(server.url + "/v1/engine/events", params={"interval": value}, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "interval" and error["type"] == "invalid_request_error"
    assert "interval" in error["message"]


def test_interval_spaces_the_events(server):
    events = _events(server.url, limit=3, interval="0.5")
    times = [e["time"] for e in events]
    assert all(b - a >= 0.45 for a, b in zip(times, times[1:], strict=False))


def test_endpoints_need_the_key_but_the_page_does_not(strict_server):
    keyed = strict_server
    assert httpx.get(keyed.url + "/v1/engine/stats", timeout=10).status_code == 401
    assert httpx.get(keyed.url + "/v1/engine/events", timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {keyed.api_key}"}
    assert httpx.get(keyed.url + "/v1/engine/stats", headers=auth, timeout=30).json()["kv_grid"] is not None
    assert _events(keyed.url, headers=auth, limit=1)[0]["status"] == "ok"
    page = httpx.get(keyed.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>nanoserve</title>" in page.text
    script = httpx.get(keyed.url + "/static/main.js", timeout=10)
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    for path in ("/static/../app.py", "/static/", "/static/nothing.js"):
        assert httpx.get(keyed.url + path, headers=auth, timeout=10).status_code == 404
    assert httpx.post(keyed.url + "/", timeout=10).status_code == 401  # only GET and HEAD pass the gate unasked
