"""SpecDecodeStats: what verification accepted, counted as vLLM counts it (its spec_decode_* metrics)."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verify entries that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position 0, 1, ...

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):  # accepted drafts are a prefix of the drafts
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per sequence on average: the accepted drafts and the one sampled token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
