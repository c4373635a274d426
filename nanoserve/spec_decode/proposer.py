"""What the engine asks of a proposer: the Protocol each speculative method implements.

A proposer is asked, once a step, for the drafts of the sequences about to decode. The n-gram proposer reads only
the tokens; a draft model (worker/draft_model.py) runs on the device over its own KV cache, keeps that state per
sequence id between steps (`release` drops it when a sequence ends), and reads each row's sampling fields too
(layers/sampler.py's SamplingRow: the engine's Sequence has them) to draw its drafts with the request's parameters.
An EAGLE-3 head (worker/eagle3.py) also reads the target's hidden states, which the target's runner hands it after
every step, and a row's block table (where they are stored). Under async scheduling those two also draft early, on
the device, from a verify step the host has not read (DraftModelProposer.propose_early / take_early); the n-gram
proposer does not.
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
