"""N-gram proposer (prompt lookup): draft what followed the last time the sequence's latest tokens appeared.

For n from prompt_lookup_max down to prompt_lookup_min, the sequence's last n tokens are looked for earlier in its
own prompt and output; at the first n with a match, the tokens that followed the match (up to k) are the draft.
Host-side, numpy, no model: it pays off where outputs copy their inputs (editing, summarising with quotes, code).
"""

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanoserve.spec_decode.proposer import DraftRow


def ngram_lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """The up to k tokens after an earlier occurrence of the longest suffix of `tokens` (max_n .. min_n tokens long)
    that occurs earlier; [] when none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Starts of n-grams that end before the last token: each is followed by at least one token.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            # The latest occurrence that has k tokens after it (the nearest context is the likeliest to be copied
            # on), else the earliest: in a repeating stretch the latest ones sit just before the end, with
            # fewer than k tokens after them.
            full = hits[hits + n + k <= length]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min
        # Each sequence's tokens as numpy, grown by the tokens added since its last proposal: converting the whole
        # list every step cost ~0.3 ms for 8k tokens, per sequence.
        self.tokens: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, rows: Sequence[DraftRow], max_tokens: Sequence[int]) -> list[list[int]]:
        return [
            ngram_lookup(self._tokens(row), self.max_n, self.min_n, min(self.k, cap))
            for row, cap in zip(rows, max_tokens, strict=True)
        ]

    def _tokens(self, row: DraftRow) -> np.ndarray:
        ids = row.token_ids
        buffer, length = self.tokens.get(row.seq_id, (None, 0))
        if buffer is None or length > len(ids):
            buffer, length = np.empty(max(2 * len(ids), 64), np.int64), 0
        if len(ids) > len(buffer):
            buffer = np.concatenate([buffer[:length], np.empty(len(ids), np.int64)])
        buffer[length : len(ids)] = ids[length:]
        self.tokens[row.seq_id] = (buffer, len(ids))
        return buffer[: len(ids)]

    def release(self, seq_id: int) -> None:
        self.tokens.pop(seq_id, None)
