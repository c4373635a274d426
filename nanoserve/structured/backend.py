"""The grammar backend: llguidance matchers over the model's tokenizer, a compile cache, and batched token masks.

Why llguidance (a probe, scripts/grammar_backend_probe.py at 32a2823; docs/server.md has the figures): a schema
compiles in about 1 ms against xgrammar's 40-50 ms (it builds the lexer lazily, as tokens arrive), which matters
when every agent request
brings tools of its own; its masks cost 2-3x xgrammar's at batch 1 and 64 and the same at 256 (about 35 us per
mask on a 100k vocabulary), which the engine hides behind the model's forward pass; and it needs neither torch
nor triton.

A compiled grammar is one matcher kept in an LRU cache by grammar text; each sample gets a deep copy of it (a few
microseconds), which is also faster to step than a matcher built anew (it shares the compiled lexer).
"""

from collections import OrderedDict

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
        never allowed); num_threads: threads for batched masks (None: llguidance's default)."""
        if tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to constrain its output with")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                                      eos_token=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.cache_size = cache_size
        self.executor = llguidance.LLExecutor(num_threads=num_threads)

    @property
    def mask_words(self) -> int:
        """int32 words of one row's bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def cached(self, grammar: str) -> llguidance.LLMatcher | None:
        template = self.cache.get(grammar)
        if template is not None:
            self.cache.move_to_end(grammar)
        return template

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """The compiled grammar (a fresh matcher to copy from); ValueError with llguidance's message if it does not
        compile against this tokenizer (a special token it names is not in the vocabulary, say). Thread-safe for
        distinct grammars; llguidance drops the GIL while it builds, so this may run on a worker thread."""
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=_QUIET)
        if template.is_error():
            raise ValueError(f"structured_outputs: {template.get_error().strip()[:400]}")
        return template

    def store(self, grammar: str, template: llguidance.LLMatcher) -> None:
        self.cache[grammar] = template
        self.cache.move_to_end(grammar)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)

    def fill(self, states: list["GrammarState"], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` (int32, on the host, contiguous) gets the tokens states[i] allows next, computed on
        llguidance's threads."""
        self.executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])


class GrammarState:
    """One sample's place in its grammar: the matcher and how many of the sample's output tokens it has taken."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.matcher = template.deep_copy()
        self.num_consumed = 0

    def advance(self, token_ids: list[int], num_prompt_tokens: int, pending: int | None = None) -> None:
        """Take the sample's output tokens (token_ids after its prompt, then `pending`, a token sampled but not yet
        appended) not taken yet. Each is taken once: the engine shows a pending token early, to compute the next
        mask, and again when it appends it. Only the new tokens are sliced: this runs per sample per step. Raises
        ValueError if the grammar refuses one, which only a token sampled against the mask (or forced) can be."""
        new = token_ids[num_prompt_tokens + self.num_consumed:]
        if pending is not None:
            new.append(pending)
        if not new:
            return
        self.num_consumed += len(new)
        # One at a time: llguidance's consume_tokens refuses even eos once the grammar is complete, consume_token
        # takes it (and more eos after it, as with ignore_eos).
        if not all(self.matcher.consume_token(t) for t in new):
            raise ValueError(f"structured_outputs: the grammar refused a generated token: "
                             f"{self.matcher.get_error().strip()[:300]}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the sample."""
        return self.matcher.is_stopped()
