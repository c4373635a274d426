"""GET /v1/engine/stats and GET /v1/engine/events: what the engine is doing, for the web page and for scripts.

- /v1/engine/stats: one JSON snapshot: queue, KV pool (with its block grid), prefix cache, token counts, the
  last step's shape, the step counters, and the engine's configuration.
- /v1/engine/events: server-sent events, one snapshot every `interval` seconds (default and least 0.05: at most
  20 a second) while anything changed, and at least one a second; each also says what happened since the
  stream's previous event (`window`: steps, decode and prefill-chunk tokens, output tok/s, TTFT, inter-token
  latency, engine busy time). The block grid is sent when it changed.

The engine keeps its step view (engine/step_view.py) only while someone watches: these endpoints send it a
Watch lease (AsyncEngine.watch) and renew it at most once a second while a stream is open, so nobody watching
costs it nothing. Every API server (--api-server-count N) serves both: each reads the one engine's stats
through its own channel, and any one's lease turns the view on for all. With --data-parallel-size N the view is the
replicas' merged (runtime/data_parallel.py: their block grids one after the other), and `engines` lists each one's.
"""

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

import nanoserve
from nanoserve.engine.block_view import BlockGrid
from nanoserve.engine.step_view import EngineView
from nanoserve.runtime.async_engine import AsyncEngine, EngineStats
from nanoserve.server.errors import APIError
from nanoserve.server.gate import GateState

WATCH_S = 3.0  # one lease; renewed every RENEW_S while someone watches
RENEW_S = 1.0
MIN_INTERVAL_S = 0.05
MAX_INTERVAL_S = 60.0
HEARTBEAT_S = 1.0  # an event at least this often, changed or not: a chart's time axis moves on
STATS_WAIT_S = 1.0  # how long /v1/engine/stats waits for the engine's first view


class EngineWatch:
    """This API server's side of the lease: one renewal a second at most, however many streams are open."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.renewed = float("-inf")

    def renew(self) -> None:
        now = time.monotonic()
        if now - self.renewed >= RENEW_S:
            self.engine.watch(WATCH_S)
            self.renewed = now

    async def view(self) -> EngineStats:
        """The engine's stats once they carry a view (or, after STATS_WAIT_S, as they are)."""
        self.renew()
        deadline = time.monotonic() + STATS_WAIT_S
        while self.engine.stats.view is None and time.monotonic() < deadline and not self.engine.dead:
            await asyncio.sleep(0.01)
        return self.engine.stats


def engine_view_router(engine: AsyncEngine, gate: GateState, model_name: str,
                       api_server: int | None = None) -> APIRouter:
    router = APIRouter()
    watch = EngineWatch(engine)

    def status() -> str:
        return "dead" if engine.dead else "draining" if gate.draining else "ok"

    @router.get("/v1/engine/stats")
    async def get_stats() -> dict:
        stats = await watch.view()
        body = snapshot(engine, stats, status())
        view = stats.view
        body["kv_grid"] = grid_json(view.grid) if view is not None else None
        body["cpu_grid"] = grid_json(view.cpu_grid) if view is not None and view.cpu_grid is not None else None
        body["totals"] = totals(view)
        body["config"] = config_json(engine, model_name, api_server)
        body["engines"] = engines_json(engine)
        return body

    @router.get("/v1/engine/events")
    async def get_events(request: Request) -> StreamingResponse:
        interval = parse_interval(request.query_params.get("interval"))

        async def events():
            last: tuple[float, EngineStats] | None = None  # (when, stats) of the last event sent
            grids: tuple = (None, None)  # the grids last sent
            while True:
                now_status = status()
                if now_status == "ok":
                    watch.renew()
                stats, now = engine.stats, time.monotonic()
                if last is None or stats is not last[1] or now - last[0] >= HEARTBEAT_S or now_status != "ok":
                    event = snapshot(engine, stats, now_status)
                    event["window"] = window(last, now, stats)
                    view = stats.view
                    if view is not None and (view.grid, view.cpu_grid) != grids:
                        grids = (view.grid, view.cpu_grid)
                        event["kv_grid"] = grid_json(view.grid)
                        event["cpu_grid"] = grid_json(view.cpu_grid) if view.cpu_grid is not None else None
                    # Compact: a grid of 1024 cells is ~10 KB so, ~14 KB with json.dumps' default spaces.
                    yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
                    last = (now, stats)
                if now_status != "ok":  # a draining server must not wait for this stream to end
                    return
                await asyncio.sleep(interval)

        # no-cache, and no buffering by a proxy in front (nginx reads X-Accel-Buffering): events must arrive as sent.
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


def parse_interval(value: str | None) -> float:
    if value is None:
        return MIN_INTERVAL_S
    try:
        interval = float(value)
    except ValueError:
        interval = float("nan")
    if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:  # NaN fails this too
        raise APIError(400, f"interval: must be a number of seconds in [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}], "
                            f"got {value!r}", "interval")
    return interval


def snapshot(engine: AsyncEngine, stats: EngineStats, status: str) -> dict:
    """What both endpoints say of the engine now; the fields a view adds are null while it has none."""
    view = stats.view
    step = view.last_step if view is not None else None
    return {
        "time": time.time(), "status": status,
        "waiting": engine.num_waiting_in(stats), "running": stats.num_running,
        "finished": view.finished if view is not None else None,
        "kv_blocks_total": stats.num_blocks, "kv_blocks_used": stats.num_blocks - stats.num_free_blocks,
        "kv_usage": stats.kv_usage,
        "prefix_cache_queries": stats.prefix_queries, "prefix_cache_hits": stats.prefix_hits,
        "prefix_cache_hit_rate": stats.prefix_hit_rate, "preemptions": stats.num_preemptions,
        "prompt_tokens": stats.prompt_tokens, "generation_tokens": stats.generation_tokens,
        # Speculative decoding: tokens a verify step emits per sequence on average (null when it is off).
        "spec_mean_acceptance_length": stats.spec_decode.mean_acceptance_length if stats.spec_decode else None,
        "last_step": None if step is None else {
            "decode_tokens": step.decode_tokens, "prefill_tokens": step.prefill_tokens, "num_seqs": step.num_seqs,
            "ms": step.seconds * 1e3},
    }


def window(last: tuple[float, EngineStats] | None, now: float, stats: EngineStats) -> dict | None:
    """What happened between the last event (`last`: when, and the stats it showed) and now; None for a first."""
    if last is None:
        return None
    seconds = max(now - last[0], 1e-9)
    generated = stats.generation_tokens - last[1].generation_tokens
    body = {"seconds": seconds, "generation_tokens": generated, "output_tokens_per_s": generated / seconds}
    old, new = last[1].view, stats.view
    # A view that went back (its engine restarted the count: none here yet) or came and went gives no window.
    if old is None or new is None or new.steps < old.steps:
        return body
    ttft_n, itl_n = new.ttft_count - old.ttft_count, new.itl_count - old.itl_count
    return {**body, "steps": new.steps - old.steps, "decode_tokens": new.decode_tokens - old.decode_tokens,
            "prefill_tokens": new.prefill_tokens - old.prefill_tokens, "batch_seqs": new.batch_seqs - old.batch_seqs,
            "finished": new.finished - old.finished,
            "busy": min((new.busy_seconds - old.busy_seconds) / seconds, 1.0),
            "ttft_count": ttft_n, "ttft_ms": (new.ttft_sum - old.ttft_sum) / ttft_n * 1e3 if ttft_n else None,
            "itl_count": itl_n, "itl_ms": (new.itl_sum - old.itl_sum) / itl_n * 1e3 if itl_n else None}


def totals(view: EngineView | None) -> dict | None:
    """The view's counters (from the engine's first watch on), for a script to take differences of."""
    if view is None:
        return None
    return {"steps": view.steps, "decode_tokens": view.decode_tokens, "prefill_tokens": view.prefill_tokens,
            "batch_seqs": view.batch_seqs,
            "busy_seconds": view.busy_seconds, "ttft_count": view.ttft_count, "ttft_seconds_sum": view.ttft_sum,
            "itl_count": view.itl_count, "itl_seconds_sum": view.itl_sum}


def grid_json(grid: BlockGrid) -> dict:
    # A list per state rather than one per cell: half the time to encode (~0.2 ms for 1024 cells), and smaller.
    return {"num_blocks": grid.num_blocks, "num_cells": grid.num_cells, "totals": grid.totals(),
            "counts": grid.per_state()}


def config_json(engine: AsyncEngine, model_name: str, api_server: int | None) -> dict:
    config = engine.engine.config
    args = config.args
    return {"model": model_name, "version": nanoserve.__version__, "max_model_len": engine.max_model_len,
            "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.enable_prefix_caching, "engine_process": bool(args.engine_process),
            "data_parallel_size": args.data_parallel_size,
            "device": str(config.device), "dtype": str(config.dtype).removeprefix("torch."),
            "api_server": api_server}


def engines_json(engine: AsyncEngine) -> list[dict] | None:
    """Each replica's queue, KV pool and prefix cache (--data-parallel-size N > 1; None with one engine, whose
    figures are the body's own)."""
    replicas = engine.replica_stats
    if len(replicas) == 1:
        return None
    return [{"engine": index, "waiting": s.num_waiting, "running": s.num_running, "kv_blocks_total": s.num_blocks,
             "kv_blocks_used": s.num_blocks - s.num_free_blocks, "prefix_cache_queries": s.prefix_queries,
             "prefix_cache_hits": s.prefix_hits, "prefix_cache_hit_rate": s.prefix_hit_rate}
            for index, s in enumerate(replicas)]
