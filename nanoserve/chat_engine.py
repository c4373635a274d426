"""Engine: nanochat's token-level generation API, with num_samples and the calculator tool.

    engine = Engine(LLM())
    for column, masks in engine.generate(prompt_ids, num_samples=4, max_tokens=64):
        ...  # column[i]: sample i's next token (None once it has finished); masks[i]: 1 sampled, 0 forced
    results, masks = engine.generate_batch(prompt_ids, num_samples=4)

One request with n=num_samples carries all samples: the scheduler prefills the prompt once and forks
it, so the samples share the prompt's KV blocks, and each fork samples its own first token (sample i
draws from seed + i).

The tool loop (ToolLoop) runs inside LLMEngine.step(), as a step hook: when a sample emits
<|python_end|>, the text since its <|python_start|> goes to the calculator, and on success
<|output_start|>result<|output_end|> is appended to that sample only (LLMEngine.force_tokens). The next
step computes those tokens as a prefill chunk and samples the token after them. Running in the step
means the call is answered before any later step can sample past it, whoever drives the engine: this
Engine, `nanoserve chat`, or the server's engine thread or process. A sample ends at <|assistant_end|> or
<|bos|> (or the model's eos, or max_tokens, which counts forced tokens too).

Text: a request that hides special tokens (skip_special_tokens, the default) would show the call, its
result and the answer run together ("12*3440812*34 = 408."); the tool loop puts markers in its text in
their place, as `nanoserve chat` prints them: "[calculator: 12*34] 408\n12*34 = 408.". A request that keeps
special tokens gets them as they are.

Columns: samples advance in lockstep, one token per sample per column, so column t holds every
sample's t-th generated token. Forced tokens enter the engine several at a time but are handed out one
per column, as nanochat does. A sample's terminal token is yielded (mask 1); after it, and after a
sample stops at max_tokens, its entries are None with mask 0 until the longest sample ends: a finished
sample has no token, and None cannot be mistaken for one.
"""

import dataclasses
import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.request import Sequence
from nanoserve.outputs import CompletionOutput, RequestOutput, ToolCompletionOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.tools.calculator import calculator

# What the text shows in place of a tool token (ToolTokens' field names); the others show as nothing.
# A later version gives tool calls OpenAI's `tool_calls` shape in the chat API; until then the text
# carries them in this form.
TOOL_MARKERS = {"python_start": "[calculator: ", "python_end": "] ", "output_end": "\n"}


@dataclass(frozen=True)
class ToolTokens:
    python_start: int
    python_end: int
    output_start: int
    output_end: int
    assistant_end: int
    bos: int

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ToolTokens | None":
        """The ids of the tool-use special tokens, or None if the vocabulary lacks any of them."""
        if tokenizer is None:
            return None
        vocab = tokenizer.get_vocab()
        names = {f.name: f"<|{f.name}|>" for f in dataclasses.fields(cls)}
        if any(token not in vocab for token in names.values()):
            return None
        return cls(**{name: vocab[token] for name, token in names.items()})


@dataclass
class _SampleState:
    masks: list[int] = field(default_factory=list)  # one per output token seen so far
    expr: list[int] | None = None  # the token ids since <|python_start|>, while a call is open
    # (offset in the detokenizer's text, marker) for each tool token seen; None: the text keeps special tokens.
    markers: list[tuple[int, str]] | None = None

    def with_markers(self, text: str) -> str:
        """`text` with the markers of the tool tokens inside it put in."""
        if not self.markers:
            return text
        parts, at = [], 0
        for offset, marker in self.markers:
            if offset > len(text):  # not shown yet (held back, or cut by a stop string)
                break
            parts += [text[at:offset], marker]
            at = offset
        parts.append(text[at:])
        return "".join(parts)


class ToolLoop:
    """The calculator tool loop for the requests whose id starts with `prefix`, as a step hook.

    After every step it reads the new tokens of those requests from their sequences (so it sees each
    token in the step that produced it, whatever outputs the step builds), and its state is touched
    only by the thread that steps the engine. Outputs of tracked requests come back with
    ToolCompletionOutputs; a step that forced tokens into a request returns its output twice, before
    and after the forcing, so that a stream sends the forced tokens as a delta of their own.
    """

    def __init__(self, engine: LLMEngine, tokens: ToolTokens, prefix: str) -> None:
        self.engine = engine
        self.tokens = tokens
        self.prefix = prefix
        self.states: dict[str, dict[int, _SampleState]] = {}  # request id -> sample index -> state
        self.markers = {getattr(tokens, name): marker for name, marker in TOOL_MARKERS.items()}

    @classmethod
    def attach(cls, engine: LLMEngine, prefix: str) -> "ToolLoop | None":
        """A tool loop hooked into `engine` (the one already there for `prefix`, if any: two would
        force every result twice), or None if its model has no tool tokens."""
        tokens = ToolTokens.from_tokenizer(engine.tokenizer)
        if tokens is None:
            return None
        for hook in engine.step_hooks:
            if isinstance(hook, cls) and hook.prefix == prefix:
                return hook
        loop = cls(engine, tokens, prefix)
        engine.add_step_hook(loop)
        engine.force_after_token_ids.add(tokens.python_end)  # speculation: the result comes right after the call
        return loop

    def __call__(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        forced = {}  # request id -> its output after forcing
        for request_id, request in list(self.engine.requests.items()):  # force_tokens may finish one
            if not request_id.startswith(self.prefix) or request.params.structured_outputs is not None:
                continue  # another's, or under a grammar, which forced tokens would break
            samples = self.states.setdefault(request_id, {})
            for seq in request.seqs:
                state = samples.get(seq.index)
                if state is None:
                    state = samples[seq.index] = _SampleState(markers=[] if seq.params.skip_special_tokens else None)
                new = seq.token_ids[seq.num_prompt_tokens + len(state.masks):]
                state.masks += [1] * len(new)
                self._mark(state, seq, new)
                call = self._feed(state, new)
                if call is not None and not seq.is_finished:
                    forced[request_id] = self.engine.force_tokens(request_id, seq.index, call)
                    appended = seq.output_token_ids[len(state.masks):]
                    state.masks += [0] * len(appended)
                    self._mark(state, seq, appended)
        result = []
        for out in outputs:
            if out.request_id.startswith(self.prefix):
                out = self._with_masks(out, self.states.get(out.request_id, {}))
            result.append(out)
            if out.request_id in forced:
                result.append(self._with_masks(forced.pop(out.request_id), self.states[out.request_id]))
        # Forcing that finished a request the step built no output for (LLM's final_only steps).
        result += [self._with_masks(o, self.states[o.request_id]) for o in forced.values() if o.finished]
        # Finished requests are forgotten; so are aborted ones, whose last output bypasses step().
        for request_id in [r for r in self.states if r not in self.engine.requests]:
            del self.states[request_id]
        return result

    def _mark(self, state: _SampleState, seq: Sequence, new_tokens: list[int]) -> None:
        """Record where the tool tokens among a sample's newest tokens fall in its text. A special token adds
        no text, so that is the text's length now (the loop sees a sampled token in the step that made it)."""
        if state.markers is None:
            return
        for token in new_tokens:
            if token in self.markers:
                state.markers.append((len(seq.detokenizer.text), self.markers[token]))

    def _feed(self, state: _SampleState, new_tokens: list[int]) -> list[int] | None:
        """Advance one sample's tool state; returns the tokens to force if a call just completed."""
        t = self.tokens
        forced = None
        for token in new_tokens:
            if token == t.python_start:
                state.expr = []
            elif token == t.python_end and state.expr is not None:
                result = calculator(self.engine.tokenizer.decode(state.expr))
                state.expr = None
                if result is not None:  # on None nothing is forced: the model goes on by itself
                    result_ids = self.engine.tokenizer.encode(result, add_special_tokens=False)
                    forced = [t.output_start, *result_ids, t.output_end]
            elif state.expr is not None:
                state.expr.append(token)
        return forced

    @staticmethod
    def _with_masks(out: RequestOutput, samples: dict[int, _SampleState]) -> RequestOutput:
        completions = []
        for c in out.outputs:
            fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(CompletionOutput)}
            # A request that finished in this step left engine.requests before its last tokens were
            # seen; unseen tokens were sampled (forced ones are recorded as they are forced).
            state = samples.get(c.index, _SampleState())
            seen = state.masks[:len(c.token_ids)]
            masks = seen + [1] * (len(c.token_ids) - len(seen))
            fields["text"] = state.with_markers(c.text)
            completions.append(ToolCompletionOutput(**fields, token_masks=masks))
        return dataclasses.replace(out, outputs=completions)


class HasEngine(Protocol):
    """What Engine reads of an LLM (llm.py sits above this module: LLM.chat runs the tool loop)."""

    @property
    def engine(self) -> LLMEngine: ...


class Engine:
    """nanochat's Engine on an LLM: generate() yields token columns, generate_batch() whole samples."""

    def __init__(self, llm: HasEngine) -> None:
        self.engine = llm.engine
        # A per-instance prefix names this Engine's requests, so its tool loop leaves others' alone.
        self._prefix = f"engine-{uuid.uuid4().hex[:8]}-"
        self.tool_loop = ToolLoop.attach(self.engine, self._prefix)
        tokens = self.tool_loop.tokens if self.tool_loop is not None else None
        self.terminal_ids = set(self.engine.config.model.eos_token_ids)
        if tokens is not None:
            self.terminal_ids |= {tokens.assistant_end, tokens.bos}
        self._ids = itertools.count()
        self._latest: dict[str, RequestOutput | None] = {}  # the newest output of each live request

    def generate(self, tokens: list[int], num_samples: int = 1, max_tokens: int | None = None,
                 temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 42) -> Iterator[tuple[list[int | None], list[int]]]:
        """Yield (token_column, token_masks) until every sample has ended; see the module docstring."""
        params = SamplingParams(n=num_samples, temperature=temperature, top_k=top_k, seed=seed,
                                max_tokens=max_tokens, stop_token_ids=sorted(self.terminal_ids))
        request_id = f"{self._prefix}{next(self._ids)}"
        request = self.engine.add_request(request_id, list(tokens), params)
        self._latest[request_id] = None
        sent = 0
        try:
            while True:
                out = self._latest[request_id]
                if out is not None:
                    samples = [(c.token_ids, _masks(c), c.finished) for c in out.outputs]
                    ready = min((len(ids) for ids, _, done in samples if not done),
                                default=max(len(ids) for ids, _, _ in samples))
                    for t in range(sent, ready):
                        yield ([ids[t] if t < len(ids) else None for ids, _, _ in samples],
                               [masks[t] if t < len(ids) else 0 for ids, masks, _ in samples])
                    sent = max(sent, ready)
                    if out.finished:
                        return
                if request.finished:  # it ended outside our view (aborted by someone else)
                    return
                for step_out in self.engine.step():
                    if step_out.request_id in self._latest:
                        self._latest[step_out.request_id] = step_out
        finally:
            del self._latest[request_id]
            if not request.finished:  # the caller stopped early
                self.engine.abort_request(request_id)

    def generate_batch(self, tokens: list[int], num_samples: int = 1,
                       **kwargs) -> tuple[list[list[int]], list[list[int]]]:
        """(results, masks): per sample, prompt + generated tokens without the terminal token, and
        their masks (0 on the prompt, as in nanochat)."""
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks, strict=True)):
                if token is not None and token not in self.terminal_ids:
                    results[i].append(token)
                    masks[i].append(mask)
        return results, masks


def _masks(c: CompletionOutput) -> list[int]:
    return c.token_masks if isinstance(c, ToolCompletionOutput) else [1] * len(c.token_ids)
