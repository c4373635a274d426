"""Incremental, UTF-8-safe detokenization and stop-string matching for one sequence.

Decoding token by token breaks in two ways: a multi-byte character split across byte-level tokens
decodes to U+FFFD until its last byte arrives, and tokenizers that drop a leading space decode a
lone token differently from the same token in context. So each step decodes a short window of
recent tokens twice (with and without the new ones), emits the difference, and holds it back while
it ends in U+FFFD.
"""

# Prompt tokens kept in the window, so the first generated token is decoded in context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str]) -> None:
        # The Rust tokenizer behind a transformers fast tokenizer decodes without the wrapper's
        # per-call conversions (several times faster: this runs twice per token per sequence).
        self.tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        # Text that might be the start of a stop string is not shown until the match is decided.
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any (the text is then cut
        where the stop string starts)."""
        if self.tokenizer is None:
            return None  # token ids only (a checkpoint without a tokenizer)
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None  # an incomplete character: wait for its next bytes
        new_text = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(len(self.text) - self.holdback, 0)
        self.text += new_text
        for s in self.stop:
            at = self.text.find(s, start)
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[:max(len(self.text) - self.holdback, 0)]
