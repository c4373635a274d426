"""Request (what a caller asked for) and Sequence (one sample of it, the unit the scheduler runs)."""

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.outputs import RequestMetrics, TokenLogprobs
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.structured.backend import GrammarState


class SeqStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request: "Request"
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache, or is being written by a launched step
    # Tokens sampled by a launched step that the host has not read yet: they follow token_ids. With
    # async scheduling the next step is scheduled (and reads them on the device) before they arrive.
    num_pending: int = 0
    num_stale: int = 0  # tokens in flight that arrive after force_tokens replaced them: dropped
    block_table: list[int] = field(default_factory=list)
    # The sliding-window layers' blocks, where they have a pool of their own (engine/local_blocks.py): indexed like
    # block_table, NULL_BLOCK (0) for blocks out of the window.
    local_table: list[int] = field(default_factory=list)
    # Long-context mode (a sequence longer than the GPU pool): the CPU blocks holding its first len(cpu_blocks)
    # logical blocks; block_table then holds the ones after them. None: every block is in block_table.
    cpu_blocks: list[int] | None = None
    block_hashes: list[int] = field(default_factory=list)  # prefix-cache hash chain of the full blocks
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    grammar: "GrammarState | None" = None  # structured output: this sample's place in its grammar
    spec_token_ids: list[int] = field(default_factory=list)  # speculative: drafts proposed for its next step

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token left to compute: a prompt, or a sequence recomputing after preemption."""
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context length
    priority: int = 0  # lower runs first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)  # the samples started so far
    # Samples 1 .. n-1, built with the request (so that whatever could fail in building one fails when the
    # request is added, not in the middle of a step) and started when the prompt's prefill ends.
    unforked: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    aborted: bool = False
    error: str | None = None  # why the engine failed this request alone (finish_reason "error")

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    @property
    def needs_fork(self) -> bool:
        """n > 1 samples are forked from the first one once its prompt is prefilled."""
        return not self.aborted and bool(self.unforked)

    def start_fork(self) -> Sequence:
        seq = self.unforked.pop(0)
        self.seqs.append(seq)
        return seq

    @property
    def finished(self) -> bool:
        return not self.needs_fork and all(s.is_finished for s in self.seqs)
