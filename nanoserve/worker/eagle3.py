"""Eagle3Proposer: an EAGLE-3 head (model/llama_eagle3.py) drafts k tokens a step from the target's own hidden
states (speculative_config's eagle3 method).

The head is a one-layer model with its own paged KV pool and block tables, run as draft_model.py runs a draft model
(its single-token steps and short catch-ups replay CUDA graphs where the target uses graphs), and its drafts are
drawn the same way (the request's own parameters, q kept for verification). What differs is its input. The head's
position i reads the token at i + 1 and the target's hidden states at position i (three layers' worth, projected by
fc), so it can only run where the target has run:
- every target step (prefill chunks, decodes, verify steps) hands the proposer its hidden states at the head's three
  layers (ModelRunner.aux_hidden_sink), projected by fc at once and stored by the tokens' KV slots in a pool beside
  the target's KV: a prefix-cache hit finds them with the KV it reuses, a sample forked from an n > 1 prompt in the
  blocks it shares; a verify step's rows past the accepted drafts sit in slots the next step writes over;
- a proposal catches the head up on positions done .. N - 2 of a sequence of N tokens (the target has run all of
  them, and the token after each is known), whose last row gives the first draft; then k - 1 single-token steps,
  each feeding the head's own output (before its final norm) as the next position's hidden state. These run as a
  draft model's do (draft_model.py's _draft_loop: inputs made on the device from the pass before, the drafts read
  back once at the end); the output goes from one pass to the next on the device too (_decode_logits).
The head's KV of positions past N - 2, written from its own outputs, is written over by the next catch-up. So a
head's drafts depend on the sequence's tokens alone: not on its batch, on prefix hits, or on preemption.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from nanoserve.config import EngineConfig, read_config_json
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.layers.embedding import VocabEmbedding
from nanoserve.model.llama_eagle3 import aux_hidden_state_layers
from nanoserve.model.loader import load_whole_parameter
from nanoserve.model.registry import DRAFT_HEADS
from nanoserve.spec_decode.proposer import DraftRow
from nanoserve.spec_decode.rejection import VerifyStep
from nanoserve.utils import to_device
from nanoserve.worker.draft_model import (
    WHOLE_ON_ONE_DEVICE,
    DraftModelProposer,
    _Batch,
    _DecodeState,
    _DraftSeq,
    _Early,
    _Entry,
)
from nanoserve.worker.model_runner import ModelRunner
from nanoserve.worker.step_inputs import StepInputs, chunk_slots


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
            **WHOLE_ON_ONE_DEVICE,
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


class HeadRow(DraftRow, Protocol):
    """What the head reads of a sequence (engine/request.py's Sequence): its KV blocks in the target's pool too."""

    @property
    def block_table(self) -> list[int]: ...


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
        # Under tensor parallelism the head's copy of the target's whole embedding table (attach fills it), allocated
        # here, before the target's runner sizes its KV pool, so that the pool leaves room for it.
        self.whole_embedding: torch.Tensor | None = None
        if config.args.tensor_parallel_size > 1:
            self.whole_embedding = torch.empty(config.model.vocab_size, config.model.hidden_size, dtype=config.dtype,
                                               device=config.device)
        self.done: dict[int, int] = {}  # seq_id -> positions whose head KV was made from the target's hidden states
        # fc(the target's hidden states) of every token in the target's KV pool, by its KV slot: a prefix-cache hit
        # finds them with the KV, a forked sample in the blocks it shares.
        self.hidden_pool: torch.Tensor | None = None
        # The same rows of the blocks in the target's CPU tier (kv_offload_gb): they move with the KV, or a prefix
        # loaded back from there, or a sequence swapped back in, would find another sequence's hidden states.
        self.num_cpu_blocks = 0
        self.cpu_hidden_pool: torch.Tensor | None = None
        # Whether this proposal's passes make logits over the draft vocabulary only (_argmax maps their argmax to
        # target ids): where every row takes the argmax, a target-vocabulary row (-inf outside the draft's ids) cost
        # a full-vocabulary write a pass, and the sampler's fp32 copy of it.
        self.draft_vocab = False
        self.ids_increasing: bool | None = None  # target_ids() in increasing order: argmax ties map to the same id

    @staticmethod
    def engine_config(config: EngineConfig) -> EngineConfig:
        return eagle3_engine_config(config)

    @property
    def kv_bytes_per_block(self) -> int:
        """The head's KV and the hidden-state pool's row of a block, out of the KV budget."""
        hidden = self.config.args.block_size * self.config.model.hidden_size * self.config.dtype.itemsize
        return super().kv_bytes_per_block + hidden

    def attach(self, target: ModelRunner) -> None:
        embed = target.model.model.embed_tokens
        if self.whole_embedding is not None:
            # The ranks hold a share of the table each, and its lookup is a collective that the head's passes (on
            # rank 0 alone) cannot join: the head gets the whole table on rank 0.
            self.whole_embedding.copy_(load_whole_parameter(target.config, target.model, "model.embed_tokens.weight",
                                                            tuple(self.whole_embedding.shape)))
            with torch.device("meta"):
                embed = VocabEmbedding(*self.whole_embedding.shape)
            embed.weight = nn.Parameter(self.whole_embedding, requires_grad=False)
        self.head.set_embedding(embed, self.max_num_tokens)
        self.num_cpu_blocks = target.num_cpu_blocks
        target.aux_hidden_sink = self.take_hidden

    def allocate(self, num_blocks: int, max_model_len: int, cuda_graphs: bool) -> None:
        super().allocate(num_blocks, max_model_len, cuda_graphs)
        self.hidden_pool = torch.zeros(
            num_blocks * self.block_size,
            self.config.model.hidden_size,
            dtype=self.config.dtype,
            device=self.config.device,
        )
        if self.num_cpu_blocks:  # outside kv_offload_gb: a block's hidden states are a few % of its KV
            self.cpu_hidden_pool = torch.zeros(
                self.num_cpu_blocks, self.block_size, self.config.model.hidden_size, dtype=self.config.dtype
            )

    @torch.inference_mode()
    def take_hidden(self, step: StepInputs, aux: torch.Tensor) -> None:
        """A target step's hidden states at the head's layers ([num_tokens, 3 * hidden], the step's token order),
        projected and stored at the step's KV slots, after its blocks moved as the KV's did before its forward pass
        (ModelRunner.forward: to the CPU tier, copies, back from it). Those moves read no slot this step writes."""
        blocks = self.hidden_pool.view(-1, self.block_size, self.hidden_pool.shape[1])
        if step.kv_swap_out:  # (device block, CPU block)
            device_ids, cpu_ids = zip(*step.kv_swap_out, strict=True)
            self.cpu_hidden_pool[list(cpu_ids)] = blocks[list(device_ids)].cpu()
        for src, dst in step.block_copies:
            blocks[dst].copy_(blocks[src])
        if step.kv_swap_in:  # (CPU block, device block)
            cpu_ids, device_ids = zip(*step.kv_swap_in, strict=True)
            blocks[to_device(list(device_ids), torch.int64, self.config.device)] = self.cpu_hidden_pool[
                list(cpu_ids)
            ].to(self.config.device)
        n = step.num_tokens
        slots = to_device(step.host[2 * n : 3 * n], torch.int64, self.config.device)
        self.hidden_pool.index_copy_(0, slots, self.head.combine_hidden_states(aux))

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.done.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, rows: Sequence[HeadRow], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in rows]
        work = []  # (index in rows, the row, its entry in the head's catch-up pass, its k)
        slots: list[int] = []  # the target's KV slots of the positions the head catches up on
        # Sequences whose early drafts were taken this step keep their blocks too: their q must reach the verify step.
        decoding = {row.seq_id for row in rows} | self.taken
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
            work.append((i, row, _HeadEntry(view, start, n - 1 - start, [view]), k))
            slots += chunk_slots(row.block_table, start, n - 1 - start, self.block_size)
            self.done[row.seq_id] = n - 1
        if not work:
            return drafts
        if self.ids_increasing is None:  # one read of the head's constant d2t
            ids = self.head.target_ids()
            self.ids_increasing = bool((ids[1:] > ids[:-1]).all())
        self.draft_vocab = self.ids_increasing and self._argmax_only([w[1] for w in work])
        # The target's hidden states at the positions each sequence's head catches up on, in one gather.
        hidden = self.hidden_pool[to_device(slots, torch.int64, self.config.device)]
        at = 0
        for _, _, entry, _ in work:
            entry.hidden, at = hidden[at : at + entry.num_new_tokens], at + entry.num_new_tokens
        logits, out = self._forward_head(self._catch_up_head([w[2] for w in work]))
        # Each sequence's last row (position N - 2) and its table in the head's pool, for the single-token passes.
        state = self._decode_state(
            [len(row.token_ids) - 2 for _, row, _, _ in work], [w[2].seq.block_table for w in work], hidden=out
        )
        found = self._draft_loop(logits, [w[1] for w in work], [w[3] for w in work], state)
        for (i, _, _, _), d in zip(work, found, strict=True):
            drafts[i] = d
        return drafts

    @torch.inference_mode()
    def propose_early(
        self, rows: Sequence[HeadRow], max_tokens: Sequence[int], verified: VerifyStep, at: Sequence[int]
    ) -> None:
        """DraftModelProposer.propose_early for the head: it catches up on the positions up to the verify step's last
        (their hidden states stored by the verify step, their next tokens its rows, still on the device), and draws
        its first draft from the row of the position before the token after the accepted drafts."""
        decoding = {row.seq_id for row in rows}
        work = []  # (the row, its entry, its k, the catch-up row of position L - 1, its sample in `verified`)
        slots: list[int] = []
        for row, cap, i in zip(rows, max_tokens, at, strict=True):
            tokens = row.token_ids
            n, num_rows, k = len(tokens), len(verified.drafts[i]) + 1, min(self.k, cap)
            if self.done.get(row.seq_id, 0) != n - 1:  # not in step (evicted, say): a proposal catches it up in chunks
                continue
            table = self.tables.setdefault(row.seq_id, [])
            if not self._grow(table, n + num_rows + k - 2, decoding):  # all accepted: up to n + num_rows + k - 3
                self.evict(row.seq_id)
                continue
            start = n - 1
            view = _DraftSeq(row.seq_id, list(tokens[1:]), table)
            # Positions start .. n + num_rows - 2: the verify step ran up to there (its hidden states are stored).
            entry = _HeadEntry(view, start, n + num_rows - 1 - start)
            work.append((row, entry, k, n - 1 - start, i))
            slots += chunk_slots(row.block_table, start, entry.num_new_tokens, self.block_size)
            self.done[row.seq_id] = n - 1  # until the verify step is read: see _drop_early
        if not work:
            return
        if self.ids_increasing is None:
            ids = self.head.target_ids()
            self.ids_increasing = bool((ids[1:] > ids[:-1]).all())
        self.draft_vocab = self.ids_increasing and self._argmax_only([w[0] for w in work])
        entries = [w[1] for w in work]
        self.head.hidden_in[: len(slots)].copy_(self.hidden_pool[to_device(slots, torch.int64, self.config.device)])
        hidden, first = self._forward_early(entries, verified, [w[4] for w in work])
        accepted = verified.num_accepted()[to_device([w[4] for w in work], torch.int64, self.config.device)]
        picked = to_device([f + w[3] for f, w in zip(first, work, strict=True)], torch.int64, self.config.device)
        out = hidden[picked + accepted]  # a copy: the next pass writes over a graph's output buffer
        state = self._decode_state([len(w[0].token_ids) - 1 for w in work], [e.seq.block_table for e in entries],
                                   hidden=out, shift=accepted)
        self._queue_early([w[0] for w in work], [w[2] for w in work], self._logits(out), state)

    def _take_early(self, row: DraftRow, drafts: list[int]) -> None:
        super()._take_early(row, drafts)
        self.done[row.seq_id] = len(row.token_ids) - 1

    def _drop_early(self, seq_id: int, early: _Early) -> None:
        super()._drop_early(seq_id, early)
        self.done[seq_id] = min(self.done.get(seq_id, 0), early.num_tokens - 1)

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

    def _decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, state: _DecodeState
    ) -> torch.Tensor:
        """A single-token pass reads the head's output at the position before as its hidden state."""
        self.head.hidden_in[: input_ids.shape[0]].copy_(state.hidden)
        # Not cloned: the next pass copies it into hidden_in before its replay writes over a graph's output buffer.
        state.hidden = self.runner.run_model(input_ids, positions, meta)
        return self._logits(state.hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(hidden) if self.draft_vocab else self.head.compute_logits(hidden)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The target id of each row's argmax. Over the draft vocabulary, ties go to the lowest draft id, which with
        target ids in increasing order is the lowest target id: the argmax of the target-vocabulary row."""
        if not self.draft_vocab:
            return super()._argmax(logits)
        return self.head.target_ids()[logits.argmax(dim=-1)]

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
        return self._logits(out), out
