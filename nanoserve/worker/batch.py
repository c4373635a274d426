"""What the model runner reads of a scheduled step, as Protocols: worker/ sits below engine/, so it names the
fields it needs here instead of importing the scheduler's types. The engine passes its own objects
(engine/scheduler.py's SchedulerOutput and ScheduledSeq, engine/request.py's Sequence and Request), read in
place; anything with these fields would do.
"""

from collections.abc import Sequence
from typing import Protocol

from nanoserve.layers.sampler import SamplingRow


class BatchRequest(Protocol):
    @property
    def request_id(self) -> str: ...


class BatchSeq(SamplingRow, Protocol):
    """One sample: what ModelRunner.prepare and the prompt logprobs read, and the sampler's row."""

    @property
    def request(self) -> BatchRequest: ...
    @property
    def seq_id(self) -> int: ...  # names the sample's row of a launched step (LaunchedStep.rows)
    @property
    def index(self) -> int: ...  # which of the request's n samples
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def block_table(self) -> list[int]: ...
    @property
    def cpu_blocks(self) -> list[int] | None: ...  # long-context mode: CPU blocks before block_table's (or None)
    @property
    def local_table(self) -> list[int]: ...  # the sliding-window layers' blocks, where they have their own pool


class ScheduledEntry(Protocol):
    """One sequence's work in a step: num_new_tokens tokens from position start."""

    @property
    def seq(self) -> BatchSeq: ...
    @property
    def start(self) -> int: ...
    @property
    def num_new_tokens(self) -> int: ...
    @property
    def sample_seqs(self) -> Sequence[BatchSeq]: ...  # the samples that take a token from this entry's last row
    @property
    def draft_token_ids(self) -> Sequence[int]: ...  # speculative: its last len() new tokens are drafts to verify


class ScheduledBatch(Protocol):
    """One step's batch (engine/scheduler.py's SchedulerOutput)."""

    @property
    def scheduled(self) -> Sequence[ScheduledEntry]: ...  # decodes (one new token each) first, then prefill chunks
    @property
    def block_copies(self) -> Sequence[tuple[int, int]]: ...  # (src, dst) KV blocks to copy before the step
    @property
    def kv_swap_out(self) -> Sequence[tuple[int, int]]: ...  # (device block, CPU block): to the CPU tier, first
    @property
    def kv_swap_in(self) -> Sequence[tuple[int, int]]: ...  # (CPU block, device block): back, after block_copies
    @property
    def local_block_copies(self) -> Sequence[tuple[int, int]]: ...  # (src, dst) in the sliding-window pool
    @property
    def num_decodes(self) -> int: ...
