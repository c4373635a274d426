"""AsyncEngine: the LLMEngine driven by one background thread, bridged to asyncio.

LLMEngine is not thread-safe, so exactly one thread (the engine loop) touches it. Everything else
talks to that thread through a queue of commands (add a request, abort one, stop), drained at the
top of every loop iteration; the loop blocks on the queue when there is no work, so an idle server
uses no CPU. Outputs go back to each request's stream with one loop.call_soon_threadsafe per step,
and the loop publishes an immutable EngineStats snapshot after every iteration for /health and
/metrics.

If step() raises, every in-flight and queued request gets an EngineDeadError, and the engine stays
dead: new requests are refused at once instead of hanging.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import CompletionOutput, RequestOutput
from nanoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can run any more."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine looked like at the end of one loop iteration."""

    num_waiting: int = 0  # sequences queued in the scheduler, not running
    num_running: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_added: int = 0  # add commands the loop has taken off the queue so far

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: "_RequestStream"


@dataclass
class _Abort:
    request_id: str


class _AbortAll:
    pass


class _Stop:
    pass


class _RequestStream:
    """One request's outputs, filled from the engine thread, read on the event loop.

    Outputs are cumulative, so when the reader falls behind, a newer plain output replaces the one
    still waiting instead of queueing behind it: under load each wake-up sends one chunk with all the
    new tokens rather than one chunk per token, which is what lets a busy event loop keep up. Tool-loop
    outputs (whose chunks are flagged per output) and errors are never merged."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        self.request_id = request_id
        self.loop = loop
        self.wake = wake  # shared by the streams of one RequestGroup
        self.pending: list[RequestOutput | BaseException] = []
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.pending and _mergeable(self.pending[-1]) and _mergeable(item):
            self.pending[-1] = item
        else:
            self.pending.append(item)
        self.wake.set()


def _mergeable(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, RequestOutput) and all(type(c) is CompletionOutput for c in item.outputs)


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), read as one merged stream of
    (prompt index, cumulative RequestOutput). Call abort() when the reader goes away."""

    def __init__(self, engine: "AsyncEngine", streams: list[_RequestStream], wake: asyncio.Event) -> None:
        self._engine = engine
        self._streams = streams
        self._wake = wake

    @property
    def request_ids(self) -> list[str]:
        return [s.request_id for s in self._streams]

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        live = len(self._streams)
        while live:
            await self._wake.wait()
            # Cleared before draining: an output put while we yield sets it again.
            self._wake.clear()
            for index, stream in enumerate(self._streams):
                items, stream.pending = stream.pending, []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        stream.finished = True
                        live -= 1
                    yield index, item

    def abort(self) -> int:
        """Abort every request of the group that has not finished (a no-op once all have); returns
        how many were aborted."""
        aborted = 0
        for stream in self._streams:
            if not stream.finished:
                stream.finished = True
                self._engine.abort(stream.request_id)
                aborted += 1
        return aborted


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.stats = self._snapshot(0)
        self.error: str | None = None  # why the engine died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _RequestStream] = {}  # engine thread only
        self._num_submitted = 0  # event loop thread only
        # Guards `error` against a submit racing the loop's death, so no add is left unanswered.
        self._lock = threading.Lock()
        # Tokenizing and chat templates run here: off the event loop, and off the engine thread so
        # a long prompt never delays a decode step.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-tokenize")
        self._thread = threading.Thread(target=self._loop, name="nanoserve-engine", daemon=True)
        self._thread.start()

    # -- state ----------------------------------------------------------------------------------
    @property
    def dead(self) -> bool:
        return self.error is not None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet running: in the scheduler's queue, or still in ours."""
        stats = self.stats
        return stats.num_waiting + (self._num_submitted - stats.num_added)

    # -- tokenizer work (off the event loop) ----------------------------------------------------
    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        return await self._off_loop(self.engine.tokenize, prompt)

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return await self._off_loop(self.engine.apply_chat_template, messages, add_generation_prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("tokens: this model has no tokenizer")
        return await self._off_loop(tok.decode, token_ids)

    async def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs of echoed prompt tokens)."""
        tok = self.engine.tokenizer
        return await self._off_loop(lambda: [tok.decode([t]) if tok is not None else "" for t in token_ids])

    # -- requests -------------------------------------------------------------------------------
    def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Queue (request_id, prompt token ids, params) requests; call on the event loop. Raises
        EngineDeadError at once, before anything is queued, if the engine has died."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        streams = [_RequestStream(request_id, loop, wake) for request_id, _, _ in requests]
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(self.error)
            for (request_id, ids, params), stream in zip(requests, streams, strict=True):
                self._commands.put(_Add(request_id, ids, params, stream))
            self._num_submitted += len(requests)
        return RequestGroup(self, streams, wake)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (a drain that ran out of time)."""
        self._commands.put(_AbortAll())

    def shutdown(self) -> None:
        self._commands.put(_Stop())
        self._thread.join(timeout=10)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # -- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        num_added = 0
        while True:
            # Block only when there is nothing to step: an idle engine sleeps on the queue.
            commands = [self._commands.get()] if not self.engine.has_unfinished_requests() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            try:
                for command in commands:
                    if isinstance(command, _Stop):
                        self._fail_all("the engine was shut down")
                        return
                    if isinstance(command, _Add):
                        num_added += 1
                        self._add(command)
                    elif isinstance(command, _AbortAll):
                        for request_id in list(self._streams):
                            self._abort(request_id)
                    else:
                        self._abort(command.request_id)
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            except Exception as exc:  # the engine's state is unknown now: fail everything, loudly
                logger.exception("engine loop failed")
                with self._lock:
                    self.error = f"the engine failed: {type(exc).__name__}: {exc}"
                self._fail_all(self.error)
                return
            self._deliver(outputs)
            self.stats = self._snapshot(num_added)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:  # validated at the edge already; a late failure still reaches the caller
            self._send(command.stream, exc)
            return
        self._streams[command.request_id] = command.stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        output = self.engine.abort_request(request_id)
        if stream is not None and output is not None:
            self._send(stream, output)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        # One wake-up per event loop per step, not one per request.
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _send(self, stream: _RequestStream, item: RequestOutput | BaseException) -> None:
        _call_soon(stream.loop, _put_all, [(stream, item)])

    def _fail_all(self, message: str) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        while True:  # adds still queued get the error too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                streams.append(command.stream)
        for stream in streams:
            self._send(stream, EngineDeadError(message))

    def _snapshot(self, num_added: int) -> EngineStats:
        e, bm = self.engine, self.engine.block_manager
        return EngineStats(
            num_waiting=len(e.scheduler.waiting), num_running=len(e.scheduler.running),
            num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
            prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits,
            prompt_tokens=e.num_prompt_tokens, generation_tokens=e.num_generation_tokens,
            num_added=num_added)


def _put_all(items: list[tuple[_RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # that event loop is closed: nobody is left to read the output
