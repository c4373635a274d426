"""StructuredOutputManager: the engine's side of structured output.

- Compiling. A request whose grammar is in the cache starts at once; another waits, out of the scheduler, while a
  worker thread compiles it (llguidance drops the GIL while it builds), so a large schema never stalls the steps
  of everyone else. The engine asks for the ready ones at the start of each step.
- Masks. The model runner calls `logit_masks` after it has queued a step's forward pass. With async scheduling a
  constrained sample's last token may still be in flight (sampled by the previous step, not read yet): it is read
  then, and the grammar takes it early; reading it waits only for the previous step, which the device finished
  before this step's forward began. Then a mask thread fills the masks (llguidance's threads, GIL dropped) while
  the device runs the forward pass and the engine's thread handles the previous step's outputs and schedules the
  next one; the step's sampling is queued once they are filled, before the next forward (ModelRunner.launch).
  In series with the engine's own host work, the masks made the host the bottleneck (146 rows of the bench
  schema: ~5 ms of masks beside a ~7 ms device step on an H100 machine, BENCHMARKS.md table 7).
- Advancing. When the engine appends a sample's token, its grammar takes it (GrammarState.advance takes each token
  once, whether it saw it early or not).
"""

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.layers.sampler import TokenBitmask
from nanoserve.structured.backend import GrammarCompiler, GrammarState

logger = logging.getLogger(__name__)


@dataclass
class MaskStats:
    """What the masks cost the host: the benchmark reports these."""

    steps: int = 0  # steps with at least one constrained row
    rows: int = 0
    seconds: float = 0.0  # the engine's thread in logit_masks (the grammars taking tokens; pending reads included)
    fill_seconds: float = 0.0  # the mask thread filling masks
    waited: float = 0.0  # the engine's thread waiting for a fill to end

    def per_step(self, seconds: float) -> float:
        return 1e3 * seconds / self.steps if self.steps else 0.0

    @property
    def ms_per_step(self) -> float:
        """Host time of masks a step: the grammars stepped on the engine's thread and the fill beside it."""
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
        launched step before it (a LaunchedStep), whose samples hold the constrained rows' pending tokens. The
        grammars take those tokens here; the masks are filled on a thread of their own (TokenBitmask.wait)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        start = time.perf_counter()
        failed: dict[int, Exception] = {}
        sampled = None
        for i in rows:
            seq = seqs[i]
            try:
                pending = None
                if seq.num_pending:  # its last token is the previous step's: read it now (see the module's doc)
                    sampled = sampled or prev.result()
                    pending = sampled.token_ids[prev.rows[seq.seq_id]]
                seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens, pending)
                if seq.grammar.matcher.is_error():
                    raise ValueError(f"structured_outputs: {seq.grammar.matcher.get_error()[:300]}")
            except Exception as exc:
                failed[i] = exc
        bits = torch.empty((len(rows), self.compiler.mask_words), dtype=torch.int32,
                           pin_memory=self.device.type == "cuda")
        states = [seqs[i].grammar for i in rows]
        failed_rows = [j for j, i in enumerate(rows) if i in failed]
        if self.mask_pool is None:
            self.mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanoserve-masks")
        filling = self.mask_pool.submit(self._fill, states, bits, failed_rows)
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

    def _fill(self, states: list, bits: torch.Tensor, failed_rows: list[int]) -> None:
        start = time.perf_counter()
        self.compiler.fill(states, bits)
        # bits was made under the engine thread's inference mode, which a thread does not inherit.
        with torch.inference_mode():
            for j in failed_rows:
                bits[j] = -1  # any token: the row is dropped, but must not be all -inf (NaN) beside the others
        self.stats.fill_seconds += time.perf_counter() - start

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        if self.mask_pool is not None:
            self.mask_pool.shutdown(wait=True)  # a fill in progress writes into a buffer that must outlive it
            self.mask_pool = None


def _attach(request, template) -> None:
    for seq in [*request.seqs, *request.unforked]:
        seq.grammar = GrammarState(template)
