"""What the engine does step by step, for someone watching it (the web page, /v1/engine/events).

While someone watches, the EngineCore loop (runtime/engine_core.py) holds a ViewRecorder: it notes each step's
shape (decode tokens, prefill-chunk tokens, sequences), time-to-first-token and inter-token latency, and adds an
EngineView to the EngineStats it publishes. While nobody watches none of this runs.

The counters are cumulative (from the first watch on): a reader takes the difference between two views, so it
may sample them as rarely as it likes and still count every step.

A step's shape is that of the batch it scheduled (`LLMEngine.last_batch`).
"""

import time
from dataclasses import dataclass

from nanoserve.engine.block_view import BlockGrid, cpu_grid, gpu_grid
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import RequestOutput

# The block grid is refreshed at most this often, and no sooner than GRID_COST_FACTOR times its own last cost
# after the last refresh: for a pool of 100k+ blocks (about 2 ms a grid) it stays near 2 % of the loop.
GRID_INTERVAL_S = 0.1
GRID_COST_FACTOR = 50


@dataclass(frozen=True)
class StepShape:
    decode_tokens: int  # one-token entries (as SchedulerOutput.num_decodes counts them)
    prefill_tokens: int  # tokens of prefill chunks
    num_seqs: int  # sequences in the batch
    seconds: float  # in LLMEngine.step()


NO_STEP = StepShape(0, 0, 0, 0.0)


@dataclass(frozen=True)
class EngineView:
    time: float  # the engine's time.monotonic() when the view was taken
    finished: int  # requests the engine took that are over (done, aborted, failed, or refused), since it started
    last_step: StepShape
    # From the first watch on:
    steps: int
    decode_tokens: int
    prefill_tokens: int
    batch_seqs: int  # sequences, summed over the steps
    busy_seconds: float  # in LLMEngine.step()
    ttft_count: int  # requests whose first token came (arrival at the engine -> first token on the host)
    ttft_sum: float
    itl_count: int  # decode tokens; each came one loop period after its sequence's previous token
    itl_sum: float
    grid: BlockGrid  # as of the last refresh (GRID_INTERVAL_S)
    cpu_grid: BlockGrid | None  # the CPU tier's, where the engine has one


class ViewRecorder:
    def __init__(self) -> None:
        self.steps = self.decode_tokens = self.prefill_tokens = self.batch_seqs = 0
        self.busy_seconds = 0.0
        self.ttft_count = self.itl_count = 0
        self.ttft_sum = self.itl_sum = 0.0
        self.last_step = NO_STEP
        self._start = 0.0
        self._last_end: float | None = None
        self._grids: tuple[BlockGrid, BlockGrid | None] | None = None
        self._grid_due = 0.0

    def resume(self) -> None:
        """Watching starts again after a pause: the steps in between were not seen."""
        self._last_end = None
        self._grid_due = 0.0

    def before_step(self, engine: LLMEngine) -> None:
        self._start = time.monotonic()

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After LLMEngine.step(); `outputs`: what this loop iteration hands on (the step's, and any abort's)."""
        end = time.monotonic()
        start = self._start
        batch = engine.last_batch
        decode, prefill, num_seqs = _shape([e.num_new_tokens for e in batch.scheduled] if batch is not None else [])
        self.last_step = StepShape(decode, prefill, num_seqs, end - start)
        self.steps += 1
        self.decode_tokens += decode
        self.prefill_tokens += prefill
        self.batch_seqs += num_seqs
        self.busy_seconds += end - start
        # A running sequence is in every step, so its next token comes one loop period after its last one. After
        # an idle spell the period starts at this step: no sequence decoded across it.
        period = end - (self._last_end if self._last_end is not None else start)
        self.itl_count += decode
        self.itl_sum += decode * period
        self._last_end = end
        for out in outputs:
            m = out.metrics
            if m is not None and m.first_token_time is not None and m.first_token_time >= start:
                self.ttft_count += 1
                self.ttft_sum += m.first_token_time - m.arrival_time

    def view(self, engine: LLMEngine, num_added: int) -> EngineView:
        """The view after this loop iteration; `num_added`: requests the loop has been given so far."""
        now = time.monotonic()
        # Also when the engine is about to sleep: this view is the one that stays up while it is idle.
        if self._grids is None or now >= self._grid_due or not engine.has_unfinished_requests():
            bm = engine.block_manager
            self._grids = (gpu_grid(bm), cpu_grid(bm))
            cost = time.monotonic() - now
            self._grid_due = now + max(GRID_INTERVAL_S, GRID_COST_FACTOR * cost)
        return EngineView(
            time=now, finished=num_added - len(engine.requests), last_step=self.last_step, steps=self.steps,
            decode_tokens=self.decode_tokens, prefill_tokens=self.prefill_tokens, batch_seqs=self.batch_seqs,
            busy_seconds=self.busy_seconds,
            ttft_count=self.ttft_count, ttft_sum=self.ttft_sum, itl_count=self.itl_count, itl_sum=self.itl_sum,
            grid=self._grids[0], cpu_grid=self._grids[1])


def _shape(new_tokens: list[int]) -> tuple[int, int, int]:
    """(decode tokens, prefill tokens, sequences) of a batch whose entries compute `new_tokens` each."""
    decode = sum(1 for n in new_tokens if n == 1)
    return decode, sum(n for n in new_tokens if n > 1), sum(1 for n in new_tokens if n > 0)
