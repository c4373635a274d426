"""StructuredOutputManager: the engine's side of structured output.

- Compiling. A request whose grammar is in the cache starts at once; another waits, out of the scheduler, while a
  worker thread compiles it (llguidance drops the GIL while it builds), so a large schema never stalls the steps
  of everyone else. The engine asks for the ready ones at the start of each step.
- Masks. The model runner calls `logit_masks` as it launches a step, before it queues the forward pass. With async
  scheduling a constrained sample's last token may still be in flight (sampled by the previous step, not read yet).
  A mask thread reads it (waiting only for the previous step's sampling, queued before this step's forward), steps
  the grammars over their new tokens and fills the masks (llguidance's threads, GIL dropped), while the device runs
  the forward pass and the engine's thread handles the previous step's outputs, schedules the next step and builds
  its inputs; the step's sampling is queued once the masks are filled, just before the next forward
  (ModelRunner.launch). On the engine's thread, 146 rows of masks (~5 ms on an H100 machine) added to its own host
  work and made the host the bottleneck beside a ~7 ms device step (BENCHMARKS.md table 7).
- Advancing. When the engine appends a sample's token its grammar takes it, unless the mask thread has or will have
  (GrammarState.reserve counts those): each token is taken once, and the engine's thread does not wait for a fill.
"""

import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanoserve.structured.backend import GrammarCompiler, GrammarState

logger = logging.getLogger(__name__)

# The mask thread takes the GIL back twice a fill (once the previous step's samples are on the host, and after
# llguidance's fill), while the engine's thread runs Python; CPython hands the GIL over only every switch interval,
# 5 ms by default, which is most of a step. One call on an H100 (BENCHMARKS.md table 7): structured / plain 0.821 at
# 5 ms, 0.906 at 1 ms, 0.884 at 0.5 ms, 0.838 at 0.2 ms (handing over too often costs too).
MASK_SWITCH_INTERVAL = 0.001


@dataclass
class TokenBitmask:
    """A step's masks, as the sampler reads them (layers/sampler.py's AllowedTokens): bit t % 32 of word t // 32 set
    allows token t."""

    rows: list[int]  # the rows of the batch it constrains, in order
    bits: torch.Tensor  # [len(rows), words] int32 on the host (pinned when bound for a GPU)
    failed: dict[int, Exception] = field(default_factory=dict)  # row -> why its grammar could not give a mask
    ready: Callable[[], None] | None = None  # waits until `bits` is filled, when the mask thread fills it

    def wait(self) -> None:
        if self.ready is not None:
            self.ready()
            self.ready = None


class _SwitchInterval:
    """The interval is the process's, so the engines of one process share it: lowered while any has a mask thread,
    the process's own given back when the last one shuts down."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.saved = sys.getswitchinterval()

    def lower(self) -> None:
        with self.lock:
            if self.users == 0:
                self.saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self.saved, MASK_SWITCH_INTERVAL))
            self.users += 1

    def restore(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                sys.setswitchinterval(self.saved)


_switch_interval = _SwitchInterval()


@dataclass
class MaskStats:
    """What the masks cost the host: the benchmark reports these."""

    steps: int = 0  # steps with at least one constrained row
    rows: int = 0
    seconds: float = 0.0  # the engine's thread in logit_masks
    fill_seconds: float = 0.0  # the mask thread: the grammars taking tokens (pending reads included), the fill
    waited: float = 0.0  # the engine's thread waiting for a fill to end

    def per_step(self, seconds: float) -> float:
        return 1e3 * seconds / self.steps if self.steps else 0.0

    @property
    def ms_per_step(self) -> float:
        """Host time of masks a step: the engine's thread, then the mask thread's (grammars stepped, masks filled)."""
        return self.per_step(self.seconds + self.fill_seconds)


class StructuredOutputManager:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], device: torch.device) -> None:
        """make_compiler: builds the GrammarCompiler (a second or so for a large vocabulary), on the worker thread
        at the first constrained request."""
        self.make_compiler = make_compiler
        self.device = device
        self.compiler: GrammarCompiler | None = None
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.mask_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.compiling: dict[str, concurrent.futures.Future] = {}  # grammar text -> its compile
        self.waiting: list = []  # requests waiting for their grammar
        self.stats = MaskStats()

    @property
    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def admit(self, request) -> bool:
        """Whether `request` can be scheduled now: True without a constraint or with its grammar cached (each sample
        gets its state); False when it waits for its compile (take_ready hands it back)."""
        spec = request.params.structured_outputs
        if spec is None:
            return True
        template = self.compiler.cached(spec.compiled) if self.compiler is not None else None
        if template is not None:
            _attach(request, template)
            return True
        if spec.compiled not in self.compiling:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-grammar")
            self.compiling[spec.compiled] = self.pool.submit(self._compile, spec.compiled)
        self.waiting.append(request)
        return False

    def _compile(self, grammar: str):
        if self.compiler is None:
            self.compiler = self.make_compiler()
        return self.compiler.compile(grammar)

    def take_ready(self, block: bool) -> tuple[list, list[tuple[object, Exception]]]:
        """(requests whose grammar is compiled, each sample with its state; (request, error) for failed compiles).
        Aborted requests are dropped. block: wait a little for a compile when there is nothing else to do, rather
        than have the engine's loop spin."""
        if not self.waiting:
            return [], []
        if block:
            concurrent.futures.wait(list(self.compiling.values()), timeout=0.01,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, still = [], [], []
        for request in self.waiting:
            grammar = request.params.structured_outputs.compiled
            future = self.compiling.get(grammar)
            template = self.compiler.cached(grammar) if self.compiler is not None else None
            if template is None and future is not None and future.done():
                if future.exception() is None:
                    template = future.result()
                    self.compiler.store(grammar, template)
                del self.compiling[grammar]
            if request.aborted:
                continue
            if template is not None:
                _attach(request, template)
                ready.append(request)
            elif future is not None and future.done():
                failed.append((request, future.exception()))
            else:
                still.append(request)
        self.waiting = still
        return ready, failed

    def logit_masks(self, seqs: list, prev) -> TokenBitmask | None:
        """The masks of the constrained rows of a step about to sample `seqs` (its rows, in order); `prev`: the
        launched step before it (a LaunchedStep), whose samples hold the constrained rows' pending tokens. A thread
        of its own reads those tokens, steps the grammars over them and fills the masks (TokenBitmask.wait); this
        thread only counts what each grammar is to take."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        start = time.perf_counter()
        failed: dict[int, Exception] = {}
        takes = []  # per row: (tokens appended but not taken, row of prev's samples with its pending token or None)
        for i in rows:
            seq = seqs[i]
            try:
                pending = prev.rows[seq.seq_id] if seq.num_pending else None  # see the module's doc
                takes.append((seq.grammar.reserve(seq.token_ids, seq.num_prompt_tokens, pending is not None),
                              pending))
            except Exception as exc:
                failed[i] = exc
                takes.append(([], None))
        bits = torch.empty((len(rows), self.compiler.mask_words), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")
        states = [seqs[i].grammar for i in rows]
        if self.mask_pool is None:
            self.mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-masks")
            _switch_interval.lower()
        filling = self.mask_pool.submit(self._fill, rows, states, takes, prev, bits, failed)
        for state in states:  # the engine's thread must not step a grammar while its mask is being computed
            state.filling = filling
        self.stats.steps += 1
        self.stats.rows += len(rows)
        self.stats.seconds += time.perf_counter() - start

        def ready() -> None:
            waited = time.perf_counter()
            filling.result()
            self.stats.waited += time.perf_counter() - waited

        return TokenBitmask(rows, bits, failed, ready)

    def _fill(self, rows: list[int], states: list, takes: list, prev, bits: torch.Tensor,
              failed: dict[int, Exception]) -> None:
        """The mask thread: the grammars take their tokens (the pending ones read once the previous step's samples
        reach the host), then the masks are filled. A row whose grammar refuses is failed (`failed`, read by the
        sampler after the wait)."""
        start = time.perf_counter()
        sampled = None
        for i, state, (tokens, pending) in zip(rows, states, takes, strict=True):
            if i in failed:
                continue
            try:
                if pending is not None:
                    sampled = sampled or prev.result()
                    tokens = [*tokens, sampled.token_ids[pending]]
                state.take(tokens)
            except Exception as exc:
                failed[i] = exc
        self.compiler.fill(states, bits)
        # bits was made under the engine thread's inference mode, which a thread does not inherit.
        with torch.inference_mode():
            for j, i in enumerate(rows):
                if i in failed:
                    bits[j] = -1  # any token: the row is dropped, but must not be all -inf (NaN) beside the others
        self.stats.fill_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        if self.mask_pool is not None:
            self.mask_pool.shutdown(wait=True)  # a fill in progress writes into a buffer that must outlive it
            self.mask_pool = None
            _switch_interval.restore()


def _attach(request, template) -> None:
    for seq in [*request.seqs, *request.unforked]:
        seq.grammar = GrammarState(template)
