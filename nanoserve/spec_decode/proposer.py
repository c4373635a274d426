"""What the engine asks of a proposer: the Protocol each speculative method implements.

A proposer is asked, once a step, for the drafts of the sequences about to decode. The n-gram proposer reads only
the tokens; a draft model or an EAGLE head (later) would run on the device over its own KV cache, and gets each
sequence's id so it can keep that state between steps (and `release` to drop it when a sequence ends or is
preempted).
"""

from collections.abc import Sequence
from typing import Protocol


class DraftRow(Protocol):
    """What a proposer reads of one sequence (engine/request.py's Sequence is one)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...  # prompt, then generated tokens: all known (the host has read them)


class Proposer(Protocol):
    def propose(self, rows: Sequence[DraftRow], max_tokens: Sequence[int]) -> list[list[int]]:
        """Up to max_tokens[i] (>= 1) draft tokens to follow rows[i]'s tokens; [] where it has none."""
        ...

    def release(self, seq_id: int) -> None:
        """Forget whatever is kept for a sequence that ended or was preempted."""
        ...
