"""The grammar backend: llguidance matchers over the model's tokenizer, a compile cache, and batched token masks.

Why llguidance (a probe, scripts/grammar_backend_probe.py at 32a2823; docs/server.md has the figures): a schema
compiles in about 1 ms against xgrammar's 40-50 ms (it builds the lexer lazily, as tokens arrive), which matters
when every agent request
brings tools of its own; its masks cost 2-3x xgrammar's at batch 1 and 64 and the same at 256 (about 35 us per
mask on a 100k vocabulary), which the engine hides behind the model's forward pass; and it needs neither torch
nor triton.

A compiled grammar is kept in an LRU cache by grammar text; each sample gets a deep copy of one of its matchers (a
few microseconds), which is also faster to step than a matcher built anew (it shares the compiled lexer).

Lanes. That sharing has a price: llguidance's deep_copy shares the lexer (and its lazily built DFA) of the matcher it
copies, behind one mutex that each mask computation holds from start to end, so the masks of samples copied from one
matcher are computed one at a time, whatever LLExecutor's threads (llguidance 1.8's source: LLMatcher.deep_copy is
Matcher::clone, whose Parser keeps the lexer in an Arc<Mutex>; deep_clone, which copies it, is not exposed to Python;
with 1.9.1 two mask threads over copies of one matcher wait on one futex, at about every row). So a grammar
has up to one matcher of its own per mask thread, each compiled apart ("lanes"): a new sample takes the lane with the
fewest live samples, a lane is compiled (about 1 ms, GIL dropped) only when every lane has one, and `fill` hands the
rows to the threads lane by lane. A grammar used by one sample at a time (most tool grammars) keeps one lane.
"""

import os
import weakref
from collections import OrderedDict
from concurrent.futures import Future

import llguidance
import llguidance.hf
import torch

# Matchers log to stderr by default; errors reach the caller through is_error() / get_error() instead.
_QUIET = 0


class GrammarCompiler:
    """Compiles grammar texts (StructuredOutputs.compiled) against one tokenizer, caching the results."""

    def __init__(self, tokenizer, eos_token_ids: list[int], vocab_size: int, cache_size: int = 256,
                 num_threads: int | None = None) -> None:
        """vocab_size: the model's (logit rows may be wider than the tokenizer's vocabulary: the extra ids are
        never allowed); num_threads: threads for batched masks, and lanes per grammar (None: llguidance's default
        number, default_mask_threads)."""
        if tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to constrain its output with")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                                      eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.num_threads = num_threads or default_mask_threads()
        self.executor = llguidance.LLExecutor(num_threads=self.num_threads)

    @property
    def mask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def cached(self, grammar: str) -> "CompiledGrammar | None":
        template = self.cache.get(grammar)
        if template is not None:
            self.cache.move_to_end(grammar)
        return template

    def compile(self, grammar: str) -> "CompiledGrammar":
        """The compiled grammar (its first lane: a fresh matcher to copy from); ValueError with llguidance's message
        if it does not compile against this tokenizer (a special token it names is not in the vocabulary, say).
        Thread-safe for distinct grammars; llguidance drops the GIL while it builds, so this may run on a worker
        thread."""
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=_QUIET)
        if template.is_error():
            raise ValueError(f"structured_outputs: {template.get_error().strip()[:400]}")
        return CompiledGrammar(self.tokenizer, grammar, template, self.num_threads)

    def store(self, grammar: str, template: "CompiledGrammar") -> None:
        self.cache[grammar] = template
        self.cache.move_to_end(grammar)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    def fill(self, states: list["GrammarState"], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` (int32, on the host, contiguous) gets the tokens states[i] allows next, computed on
        llguidance's threads. The rows go to them in lane order: each thread takes a run of adjacent rows, so
        threads working at once are mostly on different lanes, not waiting for one lexer's lock."""
        order = sorted(range(len(states)), key=lambda i: states[i].lane) if self.num_threads > 1 else range(len(states))
        self.executor.unsafe_compute_mask_ptr([(states[i].matcher, i) for i in order], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])


def default_mask_threads() -> int:
    """llguidance's own default for LLExecutor: 80% of the CPUs this process may use (its affinity, and a cgroup v2
    quota where one is set, as Rust's available_parallelism counts them), between 1 and 32."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return min(max(cpus * 80 // 100, 1), 32)


class CompiledGrammar:
    """One grammar's lanes: matchers compiled apart, each with a lexer of its own (see the module's doc), and how
    many live samples each holds. Lanes are taken on the engine's thread; the counts only balance the lanes (any lane
    gives the same masks)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, first: llguidance.LLMatcher,
                 max_lanes: int) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.max_lanes = max_lanes
        self.lanes = [first]
        self.users = [0]

    def take_lane(self) -> int:
        """The lane with the fewest live samples, a new one if every lane has some and there is room; counted."""
        lane = min(range(len(self.lanes)), key=self.users.__getitem__)
        if self.users[lane] and len(self.lanes) < self.max_lanes:
            matcher = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=_QUIET)
            if not matcher.is_error():  # it compiled once; should it not now, the samples share the lanes there are
                self.lanes.append(matcher)
                self.users.append(0)
                lane = len(self.lanes) - 1
        self.users[lane] += 1
        return lane

    def release(self, lane: int) -> None:
        self.users[lane] -= 1


class GrammarState:
    """One sample's place in its grammar: the matcher and how many of the sample's output tokens it has taken."""

    def __init__(self, compiled: CompiledGrammar) -> None:
        self.lane = compiled.take_lane()
        self.matcher = compiled.lanes[self.lane].deep_copy()
        weakref.finalize(self, compiled.release, self.lane)  # the sample is done with its lane
        # The sample's output tokens the matcher has taken, or that the mask thread takes before its next fill.
        self.num_consumed = 0
        self.filling: Future | None = None  # the mask computation using the matcher, if one may still run

    def settle(self) -> None:
        """Wait for a mask computation on this matcher to end: a matcher is never stepped during one."""
        if self.filling is not None:
            try:
                self.filling.result()
            finally:  # a fill that raised has ended too: it says so once
                self.filling = None

    def reserve(self, token_ids: list[int], num_prompt_tokens: int, pending: bool) -> list[int]:
        """For the mask thread, before a fill: the sample's output tokens (token_ids after its prompt) not taken
        yet, counted as taken, and one more if `pending` (sampled but not yet read: the thread reads it). The thread
        takes them (`take`) before it computes the mask; the matcher is not touched here."""
        new = token_ids[num_prompt_tokens + self.num_consumed:]
        self.num_consumed += len(new) + pending
        return new

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """Take the sample's output tokens not taken (nor reserved) yet: the engine appends each token once more
        after the mask thread took it early. Only the new tokens are sliced: this runs per sample per step. Raises
        ValueError if the grammar refuses one, which only a token sampled against the mask (or forced) can be."""
        new = token_ids[num_prompt_tokens + self.num_consumed:]
        if not new:  # the usual case: the mask thread took it, and the engine's thread does not wait for the fill
            return
        self.settle()
        self.num_consumed += len(new)
        self.take(new)

    def take(self, token_ids: list[int]) -> None:
        """Step the matcher over `token_ids`. One at a time: llguidance's consume_tokens refuses even eos once the
        grammar is complete, consume_token takes it (and more eos after it, as with ignore_eos)."""
        if not all(self.matcher.consume_token(t) for t in token_ids):
            raise ValueError(f"structured_outputs: the grammar refused a generated token: "
                             f"{self.matcher.get_error().strip()[:300]}")
        if self.matcher.is_error():
            raise ValueError(f"structured_outputs: {self.matcher.get_error()[:300]}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the sample."""
        return self.matcher.is_stopped()
