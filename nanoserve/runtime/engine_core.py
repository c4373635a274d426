"""EngineCore: the loop that drives an LLMEngine for a server, wherever that engine lives (vLLM's name).

LLMEngine is not thread-safe, so one loop owns it. Others talk to the loop in commands (add a request,
abort one, stop, ...), taken at the top of every iteration; the loop steps while there is work and
blocks for the next command when there is none, so an idle engine uses no CPU. After each iteration it
publishes what happened: the outputs, the adds that the engine refused, and an EngineStats snapshot for
/health and /metrics. While someone watches (a Watch, sent by /v1/engine/events and /v1/engine/stats), the
snapshot also carries an EngineView of the engine's steps and KV pool (engine/step_view.py).

The same loop runs on a background thread of the server's process (thread_client.py) and in the engine
core process (engine_core_process.py); they differ only in where commands come from and where results go,
which the `receive` and `publish` callables say.
"""

import bisect
import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.step_view import EngineView, ViewRecorder
from nanoserve.outputs import RequestOutput
from nanoserve.runtime.streams import RequestFailedError
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

# The upper bounds of EngineStats.iteration_tokens' buckets (vLLM's for its iteration_tokens_total).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
    num_added: int = 0  # add commands the loop has taken so far
    num_preemptions: int = 0
    num_cpu_blocks: int = 0  # the CPU tier's (--kv-offload-gb); 0: none
    num_cpu_blocks_used: int = 0
    cpu_prefix_hits: int = 0  # of prefix_hits, the prompt tokens found in the CPU tier
    # Loop iterations by the prompt and generation tokens they added to the counts above, as vLLM counts its
    # iteration_tokens_total (a prompt when it is first scheduled, a token when it is sampled): one count per
    # bucket of ITERATION_TOKEN_BUCKETS, then one past the last; empty until an iteration adds any.
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # Speculative decoding (vLLM's spec_decode_* counts); None when it is off.
    spec_decode: SpecDecodeStats | None = None
    view: EngineView | None = None  # while someone watches (Watch), else None

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @classmethod
    def of(cls, engine: LLMEngine, num_added: int, previous: "EngineStats | None" = None) -> "EngineStats":
        """The engine's stats now; `previous`: those of the loop's iteration before, whose token counts this
        iteration's are told from."""
        bm = engine.block_manager
        stats = cls(num_waiting=len(engine.scheduler.waiting), num_running=len(engine.scheduler.running),
                    num_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
                    prefix_queries=bm.prefix_queries, prefix_hits=bm.prefix_hits,
                    prompt_tokens=engine.num_prompt_tokens, generation_tokens=engine.num_generation_tokens,
                    num_added=num_added, num_preemptions=engine.scheduler.num_preemptions,
                    num_cpu_blocks=bm.cpu.num_blocks if bm.cpu else 0,
                    num_cpu_blocks_used=bm.cpu.num_used if bm.cpu else 0, cpu_prefix_hits=bm.cpu_prefix_hits,
                    # A copy: the engine goes on counting in its own while readers hold this snapshot.
                    spec_decode=copy.deepcopy(engine.spec_stats) if engine.spec_stats is not None else None)
        return stats._count_iteration(previous or cls())

    def _count_iteration(self, previous: "EngineStats") -> "EngineStats":
        tokens = self.prompt_tokens + self.generation_tokens - previous.prompt_tokens - previous.generation_tokens
        if tokens <= 0:
            return dataclasses.replace(self, iteration_tokens=previous.iteration_tokens,
                                       iteration_tokens_sum=previous.iteration_tokens_sum)
        counts = list(previous.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1))
        counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        return dataclasses.replace(self, iteration_tokens=tuple(counts),
                                   iteration_tokens_sum=previous.iteration_tokens_sum + tokens)


# -- commands (plain data: they cross to the engine core process pickled) --------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class AbortAll:
    """Abort every request in flight (a drain that ran out of time)."""


@dataclass
class Setup:
    """Call fn(engine) on the loop, before any command after it (the chat server's tool loop hook)."""

    fn: Callable[[LLMEngine], object]


@dataclass
class Stop:
    pass


@dataclass(frozen=True)
class Watch:
    """Someone watches the engine: add an EngineView to the stats for the next `seconds` (each watcher renews it
    while it watches, so one that vanishes costs nothing for long). It travels as Setup(Watch(...)), the one
    command every engine client passes on as it is, and is taken by the loop, not called on the engine."""

    seconds: float

    def __call__(self, engine: LLMEngine) -> None:
        raise AssertionError("EngineCore takes a Watch itself")


Command = AddRequest | AbortRequest | AbortAll | Setup | Stop
# (request id, why it ended without a last output): a ValueError when the engine refused the request (the
# caller's 400), a RequestFailedError when working on it raised (the engine itself goes on).
RequestError = tuple[str, Exception]


class EngineCore:
    def __init__(self, engine: LLMEngine, receive: Callable[[bool], list[Command]],
                 publish: Callable[[list[RequestOutput], list[RequestError], EngineStats], None]) -> None:
        """receive(block) returns the commands sent since the last call (waiting for one when block is
        true); publish(outputs, add_errors, stats) hands on one iteration's results. Whatever they raise
        ends the loop and propagates: they are the transport, not the engine."""
        self.engine = engine
        self.receive = receive
        self.publish = publish
        self.num_added = 0
        self._watch_until = 0.0  # time.monotonic() when the watch ends; 0: nobody watches
        self._recorder: ViewRecorder | None = None

    def run(self) -> str | None:
        """Serve commands until Stop (returns None) or until the engine fails: returns why, after
        logging it. Either way the engine is not to be used again."""
        try:
            return self._run()
        finally:
            self.engine.shutdown()

    def _run(self) -> str | None:
        engine = self.engine
        last_stats = None
        while True:
            # Block only when there is nothing to step: an idle engine sleeps here.
            commands = self.receive(not engine.has_unfinished_requests())
            try:
                outputs, errors = [], []
                for command in commands:
                    if isinstance(command, Stop):
                        return None
                    self._apply(command, outputs, errors)
                recorder = self._watched()
                if engine.has_unfinished_requests():
                    if recorder is not None:
                        recorder.before_step(engine)
                    for out in engine.step():
                        if out.error is None:
                            outputs.append(out)
                        else:
                            errors.append((out.request_id, RequestFailedError(out.error)))
                    if recorder is not None:
                        recorder.after_step(engine, outputs)
            except Exception as exc:  # the engine's state is unknown now: it must not run again
                logger.exception("engine loop failed")
                return f"the engine failed: {type(exc).__name__}: {exc}"
            stats = EngineStats.of(engine, self.num_added, last_stats)
            if recorder is not None:
                stats = dataclasses.replace(stats, view=recorder.view(engine, self.num_added))
            if outputs or errors or stats != last_stats:
                self.publish(outputs, errors, stats)
                last_stats = stats

    def _watched(self) -> ViewRecorder | None:
        """The recorder while someone watches, else None (at no cost but this test while nobody ever has)."""
        if self._watch_until and time.monotonic() >= self._watch_until:
            self._watch_until = 0.0
        return self._recorder if self._watch_until else None

    def _apply(self, command: Command, outputs: list[RequestOutput], errors: list[RequestError]) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            self.num_added += 1
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            except ValueError as exc:  # validated at the edge already; a late refusal still reaches the caller
                errors.append((command.request_id, exc))
            except Exception as exc:  # add_request changes nothing when it raises: only this request fails
                logger.exception("adding request %s failed", command.request_id)
                errors.append((command.request_id, RequestFailedError(f"{type(exc).__name__}: {exc}")))
        elif isinstance(command, AbortRequest):
            out = engine.abort_request(command.request_id)
            if out is not None:
                outputs.append(out)
        elif isinstance(command, AbortAll):
            for request_id in list(engine.requests):
                outputs.append(engine.abort_request(request_id))
        elif isinstance(command, Setup) and isinstance(command.fn, Watch):
            if self._recorder is None:
                self._recorder = ViewRecorder()
            elif not self._watch_until:
                self._recorder.resume()
            self._watch_until = time.monotonic() + command.fn.seconds
        elif isinstance(command, Setup):
            command.fn(engine)
        else:
            raise AssertionError(f"unknown command {command!r}")
