"""Eagle3Proposer: an EAGLE-3 head (model/llama_eagle3.py) drafts k tokens a step from the target's own hidden
states (speculative_config's eagle3 method).

The head is a one-layer model with its own paged KV pool and block tables, run as draft_model.py runs a draft model
(its single-token steps replay decode CUDA graphs where the target uses graphs), and its drafts are drawn the same
way (the request's own parameters, q kept for verification). What differs is its input. The head's position i reads
the token at i + 1 and the target's hidden states at position i (three layers' worth, projected by fc), so it can
only run where the target has run:
- every target step (prefill chunks, decodes, verify steps) hands the proposer its hidden states at the head's three
  layers (ModelRunner.aux_hidden_sink), projected by fc at once and kept per sequence by position until its next
  proposal; a verify step's rows past the accepted drafts are written over by the next step's from the same position;
- a proposal catches the head up on positions done .. N - 2 of a sequence of N tokens (the target has run all of
  them, and the token after each is known), whose last row gives the first draft; then k - 1 single-token steps,
  each feeding the head's own output (before its final norm) as the next position's hidden state.
The head's KV of positions past N - 2, written from its own outputs, is written over by the next catch-up.
Positions the target did not compute in this sequence (a prefix-cache hit) have no hidden states: the head sees
zeros there (drafts are worse, output is the same: verification decides).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig, read_config_json
from nanoserve.model.llama_eagle3 import aux_hidden_state_layers
from nanoserve.model.registry import DRAFT_HEADS
from nanoserve.spec_decode.proposer import DraftRow
from nanoserve.spec_decode.rejection import DraftPosition
from nanoserve.worker.batch import ScheduledBatch
from nanoserve.worker.draft_model import DraftModelProposer, _Batch, _DraftSeq, _Entry
from nanoserve.worker.model_runner import ModelRunner
from nanoserve.worker.step_inputs import StepInputs


def eagle3_engine_config(config: EngineConfig) -> EngineConfig:
    """The head's config, with the target's dtype, device, block size and max_model_len (its own
    max_position_embeddings is its training length, not a limit of the target's). Refuses a head whose hidden size
    or vocabulary is not the target's."""
    spec = config.speculative
    try:
        architecture = read_config_json(spec.model)["architectures"][0]
        if architecture not in DRAFT_HEADS:
            raise ValueError(f"architecture {architecture!r} is not an EAGLE-3 head ({', '.join(DRAFT_HEADS)})")
        args = dataclasses.replace(
            config.args,
            model=spec.model,
            tokenizer=None,
            speculative_config=None,
            enforce_eager=True,
            enable_prefix_caching=False,
            num_kv_blocks=1,
            quantization=None,
            max_model_len=None,
            async_scheduling=False,
        )
        head = args.create_config()
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"speculative_config.model: the EAGLE-3 head {spec.model!r}: {exc}") from exc
    target = config.model
    for key, ours, theirs in (
        ("hidden_size", head.model.hidden_size, target.hidden_size),
        ("target_hidden_size", head.model.raw.get("target_hidden_size", target.hidden_size), target.hidden_size),
        ("vocab_size", head.model.vocab_size, target.vocab_size),
    ):
        if ours != theirs:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's {key} {ours} differs from the target's {theirs}"
            )
    return dataclasses.replace(head, dtype=config.dtype, device=config.device, max_model_len=config.max_model_len)


# Pieces of hidden states a sequence keeps before they are copied into one tensor.
_MAX_PIECES = 64


@dataclass
class _HeadEntry(_Entry):
    hidden: torch.Tensor | None = None  # [num_new_tokens, hidden]: the head's hidden-state input of each row


class Eagle3Proposer(DraftModelProposer):
    """Loads the head before the target's runner (its weights count as used memory); `attach` then shares the
    target's embedding and takes its hidden states, before `allocate` (whose graphs read the head's input buffer)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.head = self.runner.model
        self.aux_layers = aux_hidden_state_layers(self.config.model.raw, config.model.num_hidden_layers)
        config.aux_hidden_state_layers = self.aux_layers
        self.max_num_tokens = max(config.args.max_num_batched_tokens, config.args.max_num_seqs)
        self.done: dict[int, int] = {}  # seq_id -> positions whose head KV was made from the target's hidden states
        # seq_id -> (first position, fc(target hidden states) [n, hidden]) not consumed yet, oldest first.
        self.hidden: dict[int, list[tuple[int, torch.Tensor]]] = {}

    @staticmethod
    def engine_config(config: EngineConfig) -> EngineConfig:
        return eagle3_engine_config(config)

    def attach(self, target: ModelRunner) -> None:
        self.head.set_embedding(target.model.model.embed_tokens, self.max_num_tokens)
        target.aux_hidden_sink = self.take_hidden

    @torch.inference_mode()
    def take_hidden(self, batch: ScheduledBatch, aux: torch.Tensor) -> None:
        """A target step's hidden states at the head's layers, [num_tokens, 3 * hidden] in the batch's order."""
        rows = self.head.combine_hidden_states(aux)
        at = 0
        for entry in batch.scheduled:
            piece = rows[at : at + entry.num_new_tokens]
            at += entry.num_new_tokens
            parent = self.hidden.get(entry.seq.seq_id, [])
            for seq in [entry.seq, *entry.sample_seqs]:
                # n > 1: a sample forked at its prompt's last chunk has its parent's earlier rows.
                pieces = self.hidden.setdefault(seq.seq_id, list(parent) if seq is not entry.seq else [])
                if not pieces or pieces[-1][1] is not piece:
                    pieces.append((entry.start, piece))
                if len(pieces) > _MAX_PIECES:
                    # A sample that is not proposed for (a constrained one) would hold a view of every step's rows:
                    # its own rows, copied out, are what it keeps.
                    start = min(first for first, _ in pieces)
                    pieces[:] = [(start, self._gather(pieces, start, max(f + len(p) for f, p in pieces)))]

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.done.pop(seq_id, None)
        self.hidden.pop(seq_id, None)

    def evict(self, seq_id: int) -> None:
        super().release(seq_id)
        self.done.pop(seq_id, None)

    def _rows(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """The head's hidden-state input at positions start .. end - 1; keeps only the last, which a proposal that
        finds no new token runs again."""
        rows = self._gather(self.hidden.get(seq_id, []), start, end)
        self.hidden[seq_id] = [(end - 1, rows[-1:])]
        return rows

    def _gather(self, pieces: list[tuple[int, torch.Tensor]], start: int, end: int) -> torch.Tensor:
        """Positions start .. end - 1 of `pieces`, zeros where none has them (the target computed none there)."""
        rows = torch.zeros(end - start, self.head.fc.out_features, dtype=self.config.dtype, device=self.config.device)
        for first, piece in pieces:  # later pieces write over earlier ones
            lo, hi = max(first, start), min(first + len(piece), end)
            if lo < hi:
                rows[lo - start : hi - start] = piece[lo - first : hi - first]
        return rows

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in rows]
        work = []  # (index in rows, the row, its entry in the head's catch-up pass, its k)
        decoding = {row.seq_id for row in rows}
        for i, (row, cap) in enumerate(zip(rows, max_tokens, strict=True)):
            tokens = row.token_ids
            n, k = len(tokens), min(self.k, cap)
            table = self.tables.setdefault(row.seq_id, [])
            if not self._grow(table, n + k - 2, decoding):  # positions 0 .. n - 2 + k - 1
                self.evict(row.seq_id)  # no room: this sequence decodes without drafts this step
                continue
            start = min(self.done.get(row.seq_id, 0), n - 2)
            # The head's position j reads token j + 1.
            view = _DraftSeq(row.seq_id, list(tokens[1:]), table)
            entry = _HeadEntry(view, start, n - 1 - start, [view], hidden=self._rows(row.seq_id, start, n - 1))
            work.append((i, row, entry, k))
            self.done[row.seq_id] = n - 1
        if not work:
            return drafts
        entries = self._catch_up_head([w[2] for w in work])
        live = list(range(len(work)))
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        for j in range(max(w[3] for w in work)):
            logits, out = self._forward_head(entries)
            positions = [DraftPosition(work[w][1], drafts[work[w][0]]) for w in live]
            tokens, q = self._draw(logits, positions)
            next_live, next_entries = [], []
            for at, w in enumerate(live):
                i, _, entry, k = work[w]
                if tokens[at] is None:  # its own sampling work raised: no more drafts for it
                    continue
                drafts[i].append(tokens[at])
                if q is not None and q[at] is not None:
                    probs[w].append(q[at])
                if j + 1 < k:
                    view = entry.seq
                    view.token_ids.append(tokens[at])
                    next_live.append(w)
                    next_entries.append(_HeadEntry(view, len(view.token_ids) - 1, 1, [view], hidden=out[at : at + 1]))
            live, entries = next_live, next_entries
            if not live:
                break
        for w, (i, row, _, _) in enumerate(work):
            self.probs[row.seq_id] = torch.stack(probs[w]) if probs[w] and len(probs[w]) == len(drafts[i]) else None
        return drafts

    def _catch_up_head(self, entries: list[_HeadEntry]) -> list[_HeadEntry]:
        """Runs the rows beyond one step's token budget first, in chunks, without sampling (no head pass is larger
        than the target's largest); returns what is left, each entry's last row among it."""
        while sum(e.num_new_tokens for e in entries) > self.max_num_batched_tokens:
            chunks, left = [], self.max_num_batched_tokens
            for e in entries:
                n = min(e.num_new_tokens - 1, left)
                if n > 0:
                    chunks.append(_HeadEntry(e.seq, e.start, n, hidden=e.hidden[:n]))
                    left -= n
                if not left:
                    break
            if not chunks:
                break
            self._forward_head(chunks)
            done = {id(c.seq): c.num_new_tokens for c in chunks}
            entries = [
                dataclasses.replace(e, start=e.start + n, num_new_tokens=e.num_new_tokens - n, hidden=e.hidden[n:])
                if (n := done.get(id(e.seq), 0))
                else e
                for e in entries
            ]
        return entries

    def _forward_head(self, entries: list[_HeadEntry]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One pass of the head: the logits (over the target's vocabulary) and the output (the next step's hidden
        state) of each entry's last row, in the entries' order; (None, None) when no entry samples. Single-token
        entries go first in the batch, as attention expects decodes."""
        order = sorted(range(len(entries)), key=lambda i: entries[i].num_new_tokens != 1)
        batch = [entries[i] for i in order]
        num_decodes = next((n for n, e in enumerate(batch) if e.num_new_tokens != 1), len(batch))
        step = StepInputs.build(_Batch(batch, num_decodes), {}, self.block_size, [])
        self.head.hidden_in[: step.num_tokens].copy_(torch.cat([e.hidden for e in batch]))
        hidden, logit_rows = self.runner.forward(step, None)
        if not step.sample:
            return None, None
        # A copy (a graph's output buffer is written over by the next pass).
        out = hidden.clone() if logit_rows is None else hidden[logit_rows]
        back = sorted(range(len(order)), key=order.__getitem__)  # batch row of each entry
        out = out[back]
        return self.head.compute_logits(out), out
