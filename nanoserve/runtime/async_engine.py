"""AsyncEngine: the engine behind the server's event loop, whichever way it runs.

The server talks to one AsyncEngine: it submits requests and reads each one's outputs as an async
stream (streams.py), and reads `stats` for /health and /metrics. Behind it, an EngineClient talks to the
EngineCore (engine_core.py) that runs the engine:

- ThreadEngineClient (thread_client.py, the default on the CPU, or `--no-engine-process`): the EngineCore
  on a background thread of this process.
- ProcessEngineClient (process_client.py, the default on CUDA, or `--engine-process`): the EngineCore in a
  process of its own, so that its host work does not take turns with the event loop on one GIL (and, with
  --api-server-count N, a ChannelEngineClient per API server process).
- DataParallelClient (data_parallel.py, `--data-parallel-size N`): N engine processes, each request to one.

All take the same calls (add, abort, abort_all, setup, shutdown) and publish the same stats, error and
cumulative outputs. `async_engine.engine` is what the serving code asks about the model (config,
tokenizer, validate_prompt): the LLMEngine itself, or an EngineFrontend that mirrors the engine
process's final config.

If the engine fails, every in-flight and queued request gets an EngineDeadError, and the engine stays
dead: new requests are refused at once instead of hanging.
"""

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from nanoserve.config import EngineArgs, resolve_engine_process
from nanoserve.engine.frontend import EngineFrontend, engine_config
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.runtime.data_parallel import DataParallelClient
from nanoserve.runtime.engine_core import EngineStats, Watch
from nanoserve.runtime.process_client import ProcessEngineClient
from nanoserve.runtime.streams import EngineDeadError, RequestFailedError, RequestGroup, RequestStream
from nanoserve.runtime.thread_client import ThreadEngineClient
from nanoserve.sampling_params import SamplingParams

# The names the server imports from here.
__all__ = ["AsyncEngine", "EngineClient", "EngineDeadError", "EngineStats", "RequestFailedError", "RequestGroup",
           "TokenizerPools"]
T = TypeVar("T")


class EngineClient(Protocol):
    """An AsyncEngine's way to the EngineCore that runs the engine (ThreadEngineClient, ProcessEngineClient or
    ChannelEngineClient)."""

    engine: EngineFrontend
    stats: EngineStats
    error: str | None

    def add(self, requests: list[tuple[str, list[int], SamplingParams, RequestStream]]) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def abort_all(self) -> None: ...
    def setup(self, fn: Callable[[LLMEngine], object]) -> None: ...
    def shutdown(self) -> None: ...


class AsyncEngine:
    def __init__(self, client: LLMEngine | EngineClient) -> None:
        """An LLMEngine runs on a background thread (a ThreadEngineClient); any other client is used as it is."""
        self.client: EngineClient = ThreadEngineClient(client) if isinstance(client, LLMEngine) else client
        self.engine = self.client.engine
        self._num_submitted = 0  # event loop thread only
        self._tokenizers = TokenizerPools()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncEngine":
        """Load the model and start the engine: in its own process if args.engine_process (None: on CUDA)."""
        # Resolved once here, so that the config the engine reports says which way it runs.
        args = dataclasses.replace(args, engine_process=resolve_engine_process(args))
        if args.data_parallel_size > 1:
            return cls(DataParallelClient.start(args))
        if args.engine_process:
            return cls(ProcessEngineClient(args))
        return cls(LLMEngine(engine_config(args)))

    # -- state ----------------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self.client.stats

    @property
    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats (--data-parallel-size); one engine's alone otherwise."""
        if isinstance(self.client, DataParallelClient):
            return self.client.replica_stats
        return [self.client.stats]

    @property
    def error(self) -> str | None:
        """Why the engine died (None while it runs)."""
        return self.client.error

    @property
    def dead(self) -> bool:
        return self.client.error is not None

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not yet running: in the scheduler's queue, or on their way to it."""
        return self.num_waiting_in(self.stats)

    def num_waiting_in(self, stats: EngineStats) -> int:
        """num_waiting as of `stats`: a report that reads stats once stays consistent with itself (the engine
        swaps them between two reads)."""
        return stats.num_waiting + (self._num_submitted - stats.num_added)

    # -- tokenizer work (off the event loop) ----------------------------------------------------
    async def tokenize(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            # Token ids need no tokenizer: the hop to the pool and back would cost two turns of a busy loop.
            return self.engine.tokenize(prompt)
        return await self._tokenizers.run(len(prompt), self.engine.tokenize, prompt)

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  tools: list[dict] | None = None) -> list[int]:
        size = sum(len(m.get("content") or "") for m in messages)
        return await self._tokenizers.run(size, self.engine.apply_chat_template, messages, add_generation_prompt,
                                          tools)

    async def detokenize(self, token_ids: list[int]) -> str:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("tokens: this model has no tokenizer")
        return await self._tokenizers.run(len(token_ids), tok.decode, token_ids)

    async def decode_each(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (for logprobs of echoed prompt tokens)."""
        tok = self.engine.tokenizer
        return await self._tokenizers.run(len(token_ids),
                                           lambda: [tok.decode([t]) if tok is not None else "" for t in token_ids])

    # -- requests -------------------------------------------------------------------------------
    def submit(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Queue (request_id, prompt token ids, params) requests; call on the event loop. Raises
        EngineDeadError at once, before anything is queued, if the engine has died."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        streams = [RequestStream(request_id, loop, wake) for request_id, _, _ in requests]
        self.client.add([(*request, stream) for request, stream in zip(requests, streams, strict=True)])
        self._num_submitted += len(requests)
        return RequestGroup(self, streams, wake)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    def abort_all(self) -> None:
        """Abort every request in flight (a drain that ran out of time)."""
        self.client.abort_all()

    def setup(self, fn: Callable[[LLMEngine], object]) -> None:
        """Call fn(engine) where the engine runs (its thread, or its process), before any request
        submitted later. With the engine process fn must pickle: a module-level function, or a
        functools.partial of one (the chat server installs its tool loop so)."""
        self.client.setup(fn)

    def watch(self, seconds: float) -> None:
        """Have the engine add an EngineView to its stats for the next `seconds` (server/engine_view.py renews
        it while someone watches; nobody watching costs the engine nothing)."""
        self.client.setup(Watch(seconds))

    def shutdown(self) -> None:
        self.client.shutdown()
        self._tokenizers.shutdown()


class TokenizerPools:
    """Where tokenizer work runs: off the event loop, and (with ThreadEngineClient) off the engine thread, so a
    long prompt never delays a decode step. Inputs of LARGE_INPUT characters or tokens or more go to a pool of
    their own, so that a small request never queues behind a large one: transformers' encode runs in the
    tokenizers library with the GIL released, so the two pools really run side by side.

    Measured once (tests' tiny BPE tokenizer, 2 shared CPU cores): while a 1 MB prompt was being tokenized
    (~0.5 s), a small /tokenize took a median 389 ms (max 569 ms) with the one pool there was, and 5.7 ms (max
    7.6 ms) with the two; alone it takes ~1 ms."""

    LARGE_INPUT = 32_768

    def __init__(self) -> None:
        self.small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-tokenize")
        self.large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-tokenize-large")

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the pool for an input of `size` characters or tokens."""
        pool = self.large if size >= self.LARGE_INPUT else self.small
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def shutdown(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)
