"""DraftModelProposer: a smaller model of the target's vocabulary drafts k tokens a step (speculative_config's
draft_model method), over its own paged KV pool.

The draft runs through a second ModelRunner (where the target uses CUDA graphs, its single-token steps replay decode
graphs and its catch-up passes of up to k + 1 tokens a sequence prefill graphs; a prompt's catch-up is eager) whose
pool has its own block tables, kept here: a sequence's table holds the KV of the tokens it has seen (`cached`). At
each proposal the draft first catches up on the sequence's tokens it has not seen (a prompt, the tokens the last
verify step emitted: one forward pass, every sequence a chunk), whose last row gives the first draft, then runs
k - 1 single-token steps. The tokens it cached that the target rejected are found by comparing `cached` with the
sequence's tokens, and written over. Simple and exact; it pays no attention to the target's prefix cache (a prompt
the target found cached is prefilled by the draft all the same).

What runs where (_draft_loop, which EAGLE-3's proposer shares): the host builds the catch-up pass's inputs
(StepInputs, one copy to the device) and, in one more copy, the single-token passes' positions, slots and lengths
with the sequences' block tables, grown beforehand for every draft (_decode_state: all follow from the catch-up's
last positions). From then on the draft tokens stay on the device: each single-token pass takes the last pass's
draws as its input ids (_decode_pass), so the host queues all k passes without waiting for any; the drafts come to
the host in one read at the end (the engine's scheduler and the verify step's inputs take them as lists). A pass's
drafts are read at once only where a row's penalties read its tokens, drafts included. At one draft pass of ~1 ms,
a read per pass left the GPU idle while the host read the token and built the next pass's inputs.

Early proposals (async scheduling, propose_early): the same passes, queued right after the target's verify step and
before the host reads it. The catch-up runs over the verify step's row tokens, still on the device, at their known
positions; the first draft is picked from the row after the accepted ones, and the single-token passes' positions are
shifted by the accepted count, both on the device. The engine then takes the drafts (take_early) of the sequences
that kept every token the device drafted from (confirm_early); the others' are dropped (docs/speculative_decoding.md).

Each draft is drawn from the draft's distribution q at its position, made with the request's own parameters
(Sampler.processed and filtered_probs, the drafts before it counted as its tokens, as verification counts them), and
q is kept for verification (spec_decode/rejection.py: accept with min(1, p/q)); greedy requests take q's argmax.

Host time (issue #43: with a small model both decoding paths are host-bound, so the host's work per step sets the
speed-up). A CPU probe (a 2-layer, hidden-64 Llama as its own draft, k = 3, greedy, eager, synchronous steps) spent
0.47 ms of a speculative step outside the forward passes at batch 1 and 0.69 ms at batch 4 (plain decoding: 0.13 and
0.18); 0.38 and 0.56 ms after verify's all-greedy check on the host, chunk_slots' short path and the (seen, drafts)
cache here. What is left is spread thin (py-spy, batch 1): the proposal is half of it, its catch-up pass's inputs
(StepInputs built, copied, sliced) ~22 %, the single-token passes ~14 % and their decode state ~11 %; the verify step's
launch ~25 %; appending the k + 1 tokens (the detokenizer) ~10 %; the step's three host-to-device copies ~13 % of it
together. On a GPU the CUDA graphs' input copies at every pass (worker/cuda_graphs.py) and the proposal's one read,
which waits for the draft's passes, come on top; the probe sees neither.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.config import EngineConfig, read_config_json
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.model.registry import check_architecture
from nanoserve.spec_decode.proposer import DraftRow
from nanoserve.spec_decode.rejection import DraftPosition, VerifyStep, takes_raw_argmax
from nanoserve.utils import to_device
from nanoserve.worker.cuda_graphs import CUDAGraphRunner, PrefillGraphRunner
from nanoserve.worker.kv_cache import allocate_kv_cache, bytes_per_block
from nanoserve.worker.model_runner import ModelRunner
from nanoserve.worker.step_inputs import StepInputs


@dataclass
class _DraftSeq:
    """A sequence as the draft's StepInputs sees it: its tokens (drafts appended) and its block table in the draft's
    pool."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    cpu_blocks: None = None


@dataclass
class _Entry:
    seq: _DraftSeq
    start: int
    num_new_tokens: int
    sample_seqs: list = field(default_factory=list)
    draft_token_ids: tuple = ()


@dataclass
class _Batch:
    scheduled: list[_Entry]
    num_decodes: int
    block_copies: tuple = ()
    kv_swap_out: tuple = ()
    kv_swap_in: tuple = ()


@dataclass
class _DecodeState:
    """The inputs of the drafting rows' single-token passes, on the device, rows in the order of the last pass's
    logits: pass j (from 0) reads row j of positions, slots and seq_lens. All are known on the host before the first
    pass (they follow from each row's last position and its table, grown for every draft first), so they reach the
    device with the tables in one copy, and a pass makes none of its inputs itself."""

    positions: torch.Tensor  # [passes, rows] int64
    slots: torch.Tensor  # [passes, rows] int64: their KV slots in the draft's pool
    seq_lens: torch.Tensor  # [passes, rows] int32
    cu_seqlens_q: torch.Tensor  # [rows + 1] int32: 0, 1, .., rows (a row's first n + 1 serve n rows)
    block_tables: torch.Tensor  # [rows, width] int32, in the draft's pool
    hidden: torch.Tensor | None = None  # EAGLE-3: the head's output at the last pass, the next pass's hidden input
    done: int = 0  # passes run

    def select(self, keep: torch.Tensor) -> None:
        self.positions, self.slots = self.positions[:, keep], self.slots[:, keep]
        self.seq_lens, self.block_tables = self.seq_lens[:, keep], self.block_tables[keep]
        if self.hidden is not None:
            self.hidden = self.hidden[keep]


def _read_drafts(passes: list[tuple[torch.Tensor, list[tuple[int, int]]]], num_rows: int) -> list[list[int]]:
    """_draft_passes' drafts on the host, each row's in order: one read (the proposal's one wait for the device)."""
    values = torch.cat([tokens for tokens, _ in passes]).tolist()
    drafts: list[list[int]] = [[] for _ in range(num_rows)]
    at_pass = 0
    for tokens, kept in passes:
        for w, at in kept:
            drafts[w].append(values[at_pass + at])
        at_pass += tokens.shape[0]
    return drafts


def _stacked(probs: list[torch.Tensor], num_drafts: int) -> torch.Tensor | None:
    """A row's q of its first num_drafts drafts ([n, V]), or None (greedy, or some draft came without one)."""
    return torch.stack(probs[:num_drafts]) if num_drafts and len(probs) >= num_drafts else None


@dataclass(eq=False)
class _EarlyProposal:
    """Drafts queued on the device from a verify step the host had not read yet (propose_early): still there until
    the first take_early reads them all."""

    passes: list[tuple[torch.Tensor, list[tuple[int, int]]]]
    probs: list[list[torch.Tensor]]
    values: list[list[int]] | None = None

    def drafts(self, w: int) -> list[int]:
        if self.values is None:
            self.values = _read_drafts(self.passes, len(self.probs))
        return self.values[w]


@dataclass(eq=False)
class _Early:
    """One sequence's share of an early proposal: its row w, its token count when it was queued, and whether the
    engine confirmed that the verify step emitted the tokens the device drafted from (confirm_early)."""

    proposal: _EarlyProposal
    w: int
    num_tokens: int
    confirmed: bool = False


# A draft or head runs whole on the engine's device (rank 0's under tensor parallelism): split over the ranks, a small
# model would add a collective to each of its passes (nor its experts over them: a dense draft would be refused the
# flag). Its KV stays in its own device pool: the target's CPU tier (kv_offload_gb) is not the draft's, which would
# otherwise allocate a tier as large again that nothing uses.
WHOLE_ON_ONE_DEVICE = {"tensor_parallel_size": 1, "nnodes": 1, "node_rank": 0, "data_parallel_size": 1,
                       "enable_expert_parallel": False, "kv_offload_gb": 0.0}


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft's config: its own checkpoint, with the target's dtype, device, block size and max_model_len; eager,
    no prefix caching, no speculation of its own. Refuses a vocabulary that differs from the target's."""
    spec = config.speculative
    try:
        check_architecture(read_config_json(spec.model)["architectures"][0])
        args = dataclasses.replace(
            config.args,
            model=spec.model,
            tokenizer=None,
            speculative_config=None,
            enforce_eager=True,
            enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=True,  # its pool and tables are its own, one group
            num_kv_blocks=1,
            quantization=None,
            max_model_len=config.max_model_len,
            async_scheduling=False,
            **WHOLE_ON_ONE_DEVICE,
        )
        draft = args.create_config()
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"speculative_config.model: the draft {spec.model!r}: {exc}") from exc
    if draft.model.vocab_size != config.model.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocab_size {draft.model.vocab_size} differs from the "
            f"target's {config.model.vocab_size}"
        )
    return dataclasses.replace(draft, dtype=config.dtype, device=config.device)


class DraftModelProposer:
    """Loads the draft (before the target's runner, so its weights count as used memory when the target sizes its
    KV pool); `allocate` then gives it a pool of the target's block count."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = self.engine_config(config)
        self.k = config.speculative.num_speculative_tokens
        self.runner = ModelRunner(self.config)  # a one-block placeholder pool until allocate()
        self.block_size = config.args.block_size
        self.max_num_batched_tokens = config.args.max_num_batched_tokens
        # The target's eos ids (min_tokens masks them), so q is made as the target's rows are.
        self.runner.sampler.eos_token_ids = config.model.eos_token_ids
        self.generator = torch.Generator(device=config.device).manual_seed(config.args.seed + 1)
        self.free: list[int] = []
        self.tables: dict[int, list[int]] = {}
        # seq_id -> (n, drafts): the draft's pool holds the KV of the sequence's first n tokens, then of these drafts.
        self.cached: dict[int, tuple[int, list[int]]] = {}
        # seq_id -> q of its latest drafts ([n, V]; None: greedy), replaced with them: drafts a step did not schedule
        # are kept by the sequence until its next proposal, and must still find their own q.
        self.probs: dict[int, torch.Tensor | None] = {}
        self.early: dict[int, _Early] = {}  # seq_id -> its drafts of an early proposal, not taken yet
        self.num_early_taken = 0  # drafts lists taken from early proposals (tests read it)
        self.taken: set[int] = set()  # the sequences whose early drafts the last take_early gave

    @staticmethod
    def engine_config(config: EngineConfig) -> EngineConfig:
        return draft_engine_config(config)

    @property
    def kv_bytes_per_block(self) -> int:
        return bytes_per_block(self.config)

    def allocate(self, num_blocks: int, max_model_len: int, cuda_graphs: bool) -> None:
        """The draft's pool, of the target's block count; then, where the target steps in CUDA graphs, the draft's
        graphs: decode graphs (its k - 1 single-token steps, and a catch-up with one new token a sequence, replay
        them) and prefill graphs up to (k + 1) tokens a sequence (a decode-phase catch-up: the tokens of the last
        verify step; a prompt's catch-up, larger, runs eagerly). They capture the pool as bound now, so only after
        it. Their memory pool is their own (the draft's activations at up to 512 sequences, or (k + 1) x
        max_num_seqs tokens: small for a draft), allocated after the target sized its KV pool."""
        self.runner.kv_cache = allocate_kv_cache(self.config, num_blocks)
        self.runner._bind_kv_cache(self.runner.kv_cache)
        self.free = list(range(num_blocks))
        if cuda_graphs and self.config.device.type == "cuda":
            args, runner = self.config.args, self.runner
            max_blocks = -(-max_model_len // self.block_size)
            # An eager catch-up of a few tokens cost the host several decode steps (issue #43: ~1,400 Triton
            # launches from Python and the prefill planner's map per proposal, at batch 1 of the bundled draft).
            max_tokens = min(args.max_num_batched_tokens, args.max_num_seqs * (self.k + 1))
            prefill = PrefillGraphRunner(runner.model, max_tokens, args.max_num_seqs, max_blocks, self.config.device,
                                         runner.planner)
            pool = prefill.capture()
            graphs = CUDAGraphRunner(runner.model, min(args.max_num_seqs, 512), max_blocks, self.config.device,
                                     runner.planner)
            graphs.capture(pool)
            runner.prefill_graphs, runner.graphs = prefill, graphs

    def draft_probs(self, seq_id: int) -> torch.Tensor | None:
        return self.probs.get(seq_id)

    def release(self, seq_id: int) -> None:
        self.free += self.tables.pop(seq_id, [])
        self.cached.pop(seq_id, None)
        self.probs.pop(seq_id, None)
        self.early.pop(seq_id, None)

    def evict(self, seq_id: int) -> None:
        """Give a sequence's blocks back while it lives on (it is caught up again at its next proposal)."""
        self.release(seq_id)

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow], max_tokens: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in rows]
        work = []  # (index in rows, the row, its draft view, tokens it has not seen, its k)
        # Sequences whose early drafts were taken this step keep their blocks too: their q must reach the verify step.
        decoding = {row.seq_id for row in rows} | self.taken
        for i, (row, cap) in enumerate(zip(rows, max_tokens, strict=True)):
            tokens = row.token_ids  # not copied: only read, and nothing appends to it while the draft runs
            k = min(self.k, cap)
            common = self._num_cached(row.seq_id, tokens)
            table = self.tables.setdefault(row.seq_id, [])
            if not self._grow(table, len(tokens) + k - 1, decoding):
                self.evict(row.seq_id)  # no room: this sequence decodes without drafts this step (q dropped too)
                continue
            self.cached[row.seq_id] = (common, [])
            work.append([i, row, _DraftSeq(row.seq_id, tokens, table), common, k])
        if not work:
            return drafts
        self._catch_up(work)
        entries = [_Entry(view, start, len(view.token_ids) - start, [view]) for _, _, view, start, _ in work]
        logits = self._forward(entries)
        # Each sequence's last position run, and its table: where its single-token passes go on from.
        state = self._decode_state([len(w[2].token_ids) - 1 for w in work], [w[2].block_table for w in work])
        found = self._draft_loop(logits, [w[1] for w in work], [w[4] for w in work], state)
        for (i, row, _, _, _), d in zip(work, found, strict=True):
            drafts[i] = d
            # Its KV now holds its tokens and every draft but the last (all but its last token, without drafts: that
            # one is run again at the next proposal anyway, for its row).
            self.cached[row.seq_id] = (len(row.token_ids), d[:-1]) if d else (len(row.token_ids) - 1, [])
        return drafts

    # -- early proposals (async scheduling): drafted on the device from a verify step the host has not read ----------
    @torch.inference_mode()
    def propose_early(
        self, rows: Sequence[DraftRow], max_tokens: Sequence[int], verified: VerifyStep, at: Sequence[int]
    ) -> None:
        """Queue drafts for the step after `verified`, before the host reads it: rows[i] is its sample at[i], whose
        verify entry had drafts; max_tokens[i] caps its drafts whatever that step accepts. The draft catches up on
        the sequence's unseen tokens and on all of the verify step's row tokens (still on the device; those past
        the accepted ones are written over later), and draws its first draft from the row after the accepted ones,
        picked on the device by the accepted count; its single-token passes go on from there. take_early then gives
        the drafts of the sequences whose verify step emitted just those tokens (confirm_early)."""
        decoding = {row.seq_id for row in rows}
        work = []  # (the row, its entry, its k, the catch-up row of its position L, its sample in `verified`)
        for row, cap, i in zip(rows, max_tokens, at, strict=True):
            tokens = row.token_ids
            n, num_rows, k = len(tokens), len(verified.drafts[i]) + 1, min(self.k, cap)
            common = self._num_cached(row.seq_id, tokens, most=n)
            if common < n - 1:  # not in step with the sequence (evicted, say): a proposal catches it up in chunks
                continue
            table = self.tables.setdefault(row.seq_id, [])
            if not self._grow(table, n + num_rows + k - 1, decoding):  # all accepted: up to n + num_rows + k - 2
                self.evict(row.seq_id)
                continue
            self.cached[row.seq_id] = (common, [])  # until the verify step is read: see _drop_early
            view = _DraftSeq(row.seq_id, tokens, table)
            work.append((row, _Entry(view, common, n + num_rows - common), k, n - common, i))
        if work:
            hidden, first = self._forward_early([w[1] for w in work], verified, [w[4] for w in work])
            accepted = verified.num_accepted()[to_device([w[4] for w in work], torch.int64, self.config.device)]
            # Position n + a: the verify step's token after its a accepted drafts.
            picked = to_device([f + w[3] for f, w in zip(first, work, strict=True)], torch.int64, self.config.device)
            logits = self.runner.model.compute_logits(hidden[picked + accepted])
            state = self._decode_state([len(w[0].token_ids) for w in work], [w[1].seq.block_table for w in work],
                                       shift=accepted)
            self._queue_early([w[0] for w in work], [w[2] for w in work], logits, state)

    def _forward_early(
        self, entries: list[_Entry], verified: VerifyStep, at: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """One pass over `entries` (each a chunk of two tokens or more, whose tokens past the sequence's known ones
        are its rows of verified.row_tokens, sample at[i] there): its hidden states (valid until the next pass) and
        each entry's first row."""
        assert all(e.num_new_tokens > 1 for e in entries)
        prev_rows = {e.seq.seq_id: verified.first_row[i] for e, i in zip(entries, at, strict=True)}
        step = StepInputs.build(_Batch(entries, 0), prev_rows, self.block_size, [], unread_chunks=True)
        hidden, _ = self.runner.forward(step, verified.row_tokens)
        return hidden, step.cu_seqlens_q_cpu[:-1]

    def _queue_early(self, rows: list[DraftRow], ks: list[int], logits: torch.Tensor, state: _DecodeState) -> None:
        passes, probs = self._draft_passes(logits, rows, ks, state)
        proposal = _EarlyProposal(passes, probs)
        for w, row in enumerate(rows):
            self.early[row.seq_id] = _Early(proposal, w, len(row.token_ids))

    def confirm_early(self, seq_id: int) -> None:
        """The verify step the sequence's early drafts were drawn after emitted every token its rows gave (no stop,
        nothing forced): they continue its tokens as a proposal now would."""
        if (early := self.early.get(seq_id)) is not None:
            early.confirmed = True

    def take_early(self, rows: Sequence[DraftRow], max_tokens: Sequence[int]) -> list[list[int] | None]:
        """The confirmed early drafts of rows[i], at most max_tokens[i] (None where it has none: it is proposed for
        as usual). Every early draft not taken is dropped here."""
        out: list[list[int] | None] = []
        self.taken = set()
        for row, cap in zip(rows, max_tokens, strict=True):
            early = self.early.pop(row.seq_id, None)
            if early is None or not early.confirmed:
                if early is not None:
                    self._drop_early(row.seq_id, early)
                out.append(None)
                continue
            drafts = early.proposal.drafts(early.w)[:cap]
            self.probs[row.seq_id] = _stacked(early.proposal.probs[early.w], len(drafts))
            self._take_early(row, drafts)
            self.taken.add(row.seq_id)
            self.num_early_taken += 1
            out.append(drafts)
        for seq_id, early in list(self.early.items()):
            self._drop_early(seq_id, early)
        self.early.clear()
        return out

    def _take_early(self, row: DraftRow, drafts: list[int]) -> None:
        # The pool holds the sequence's tokens (the verify step's accepted ones and the one after) and the drafts.
        self.cached[row.seq_id] = (len(row.token_ids), drafts[:-1])

    def _drop_early(self, seq_id: int, early: _Early) -> None:
        """What the pool surely holds when a sequence's early drafts go unused: its tokens from before the verify
        step (the catch-up wrote those as they are; what came after may not be the sequence's tokens)."""
        self.cached[seq_id] = (early.num_tokens, [])

    def _decode_state(
        self,
        positions: list[int],
        tables: list[list[int]],
        hidden: torch.Tensor | None = None,
        shift: torch.Tensor | None = None,
    ) -> _DecodeState:
        """The single-token passes' inputs (k - 1 passes), from each sequence's position at its sampling catch-up
        pass and its table: one int64 array (positions, slots, then int32 seq_lens, cu_seqlens_q and tables two to a
        slot), one copy a proposal. Each pass made them on the device before, a dozen small kernels a pass.
        shift: [rows] on the device, added to each row's positions there (an early proposal: the accepted counts of
        a verify step the host has not read), its slots then looked up on the device."""
        rows, width, passes, bs = len(tables), max(len(t) for t in tables), self.k - 1, self.block_size
        # Python lists, not numpy: a proposal has few rows, and numpy's fixed cost per call would be most of it.
        pos = [p + j for j in range(1, passes + 1) for p in positions]  # pass by pass
        # A row with fewer drafts (its max_tokens) stops before its table ends: its later slots are never run.
        slots = [t[min(q // bs, len(t) - 1)] * bs + q % bs for q, t in zip(pos, tables * passes, strict=True)]
        num_longs, num_ints = 2 * passes * rows, passes * rows + rows + 1 + rows * width
        host = np.zeros(num_longs + (num_ints + 1) // 2, dtype=np.int64)
        host[:num_longs] = pos + slots
        ints = host[num_longs:].view(np.int32)
        ints[: passes * rows + rows + 1] = [q + 1 for q in pos] + list(range(rows + 1))
        padded = ints[passes * rows + rows + 1 : num_ints].reshape(rows, width)
        for row, table in zip(padded, tables, strict=True):
            row[: len(table)] = table
        dev = to_device(host, torch.int64, self.config.device)
        dev_ints = dev[num_longs:].view(torch.int32)
        state = _DecodeState(
            positions=dev[: passes * rows].view(passes, rows),
            slots=dev[passes * rows : num_longs].view(passes, rows),
            seq_lens=dev_ints[: passes * rows].view(passes, rows),
            cu_seqlens_q=dev_ints[passes * rows : passes * rows + rows + 1],
            block_tables=dev_ints[passes * rows + rows + 1 : num_ints].view(rows, width),
            hidden=hidden,
        )
        if shift is not None:
            state.positions = state.positions + shift
            state.seq_lens = state.seq_lens + shift.to(torch.int32)
            # The table was grown for the largest shift; a row that stops early clamps as the host's lookup does.
            lengths = to_device([len(t) for t in tables], torch.int64, self.config.device)
            pages = torch.minimum(state.positions // bs, lengths - 1)
            state.slots = state.block_tables.long().gather(1, pages.t()).t() * bs + state.positions % bs
        return state

    def _draft_loop(
        self, logits: torch.Tensor, rows: list[DraftRow], ks: list[int], state: _DecodeState
    ) -> list[list[int]]:
        """Up to ks[w] drafts for rows[w] (_draft_passes), read to the host in one go. Sets each row's q
        (self.probs)."""
        passes, probs = self._draft_passes(logits, rows, ks, state)
        drafts = _read_drafts(passes, len(rows))
        for w, row in enumerate(rows):
            self.probs[row.seq_id] = _stacked(probs[w], len(drafts[w]))
        return drafts

    def _draft_passes(
        self, logits: torch.Tensor, rows: list[DraftRow], ks: list[int], state: _DecodeState
    ) -> tuple[list[tuple[torch.Tensor, list[tuple[int, int]]]], list[list[torch.Tensor]]]:
        """Up to ks[w] drafts for rows[w]: the first drawn from `logits` (its catch-up's last row), each next one
        from a single-token pass over the draft before it (_decode_pass, inputs built on the device). The drafts stay
        on the device: the host queues every pass without waiting for the one before, save where a row's penalties
        read its drafts (then each pass's are read). Returns each pass's drawn tokens with (row, index in them) of
        each draft it kept, and each row's q of its drafts."""
        argmax_only = self._argmax_only(rows)
        history = any(row.params.has_penalties for row in rows)
        drafted: list[list[int]] = [[] for _ in rows]  # on the host, kept only for penalties
        passes = []  # per pass: its drawn tokens on the device, and (row, index in them) of each draft it kept
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        live = list(range(len(rows)))
        for j in range(max(ks)):
            # Without penalties only the drafts' count is read (min_tokens): their values need not be on the host.
            if argmax_only:
                tokens, q, failed = self._argmax(logits), None, set()
            else:
                positions = [DraftPosition(rows[w], drafted[w] if history else [None] * j) for w in live]
                tokens, q, failed = self._draw(logits, positions)
            kept = [(w, at) for at, w in enumerate(live) if at not in failed]  # a row whose sampling raised stops
            passes.append((tokens, kept))
            if q is not None:
                for w, at in kept:
                    if q[at] is not None:
                        probs[w].append(q[at])
            if history:
                values = tokens.tolist()
                for w, at in kept:
                    drafted[w].append(values[at])
            going = [at for w, at in kept if j + 1 < ks[w]]
            if not going:
                break
            keep = None if len(going) == len(live) else to_device(going, torch.int64, self.config.device)
            logits = self._decode_pass(state, tokens, keep)
            live = [live[at] for at in going]
        return passes, probs

    @staticmethod
    def _argmax_only(rows: Sequence[DraftRow]) -> bool:
        """Whether every row's draft is the argmax of its raw logits (drafts get no structured masks). Then a pass's
        drafts skip the sampler: its fp32 copy of the logits, each row's DraftPosition."""
        return all(takes_raw_argmax(row.params) for row in rows)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def _decode_pass(self, state: _DecodeState, tokens: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """One single-token pass of the rows `keep` picks (None: all) over `tokens`, the drafts the last pass drew:
        its logits, its other inputs the state's next row (none made on the host). Decode graphs replay it where the
        draft has them."""
        if keep is not None:
            tokens = tokens[keep]
            state.select(keep)
        j, n = state.done, tokens.shape[0]
        state.done += 1
        meta = AttentionMetadata(
            slot_mapping=state.slots[j],
            cu_seqlens_q=state.cu_seqlens_q[: n + 1],
            seq_lens=state.seq_lens[j],
            block_tables=state.block_tables,
            max_seqlen_q=1,
            num_decodes=n,
        )
        return self._decode_logits(tokens, state.positions[j], meta, state)

    def _decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, state: _DecodeState
    ) -> torch.Tensor:
        return self.runner.model.compute_logits(self.runner.run_model(input_ids, positions, meta))

    def _grow(self, table: list[int], num_positions: int, decoding: set[int]) -> bool:
        """Blocks for positions 0 .. num_positions - 1; when the pool runs short, sequences not decoding now
        (waiting, preempted) give theirs back first."""
        needed = -(-num_positions // self.block_size) - len(table)
        if needed > len(self.free):
            for seq_id in [s for s in self.tables if s not in decoding]:
                self.evict(seq_id)
        if needed > len(self.free):
            return False
        for _ in range(max(needed, 0)):
            table.append(self.free.pop())
        return True

    def _forward(self, entries: list[_Entry]) -> torch.Tensor | None:
        """The logits of each entry's last row, in the entries' order (every entry samples, or none does: None).
        Single-token entries go first in the batch, as every step's batch orders them (attention treats its first
        num_decodes sequences as decodes)."""
        order = sorted(range(len(entries)), key=lambda i: entries[i].num_new_tokens != 1)
        batch = [entries[i] for i in order]
        num_decodes = next((n for n, e in enumerate(batch) if e.num_new_tokens != 1), len(batch))
        step = StepInputs.build(_Batch(batch, num_decodes), {}, self.block_size, [])
        _, logits = self.runner.execute(step, None)
        if logits is None or order == sorted(order):
            return logits
        back = sorted(range(len(order)), key=order.__getitem__)  # batch row of each entry
        return logits[back]

    def _catch_up(self, work: list[list]) -> None:
        """Prompts and other unseen tokens beyond one step's token budget go through first, in chunks, without
        sampling: no draft forward is larger than the target's largest, which sized the memory left for activations."""
        while sum(len(w[2].token_ids) - w[3] for w in work) > self.max_num_batched_tokens:
            chunks, left = [], self.max_num_batched_tokens
            for w in work:
                n = min(len(w[2].token_ids) - w[3] - 1, left)  # the last token is left for the sampling pass
                if n > 0:
                    chunks.append((w, n))
                    left -= n
                if not left:
                    break
            if not chunks:
                return
            self._forward([_Entry(w[2], w[3], n) for w, n in chunks])
            for w, n in chunks:
                w[3] += n

    def _num_cached(self, seq_id: int, tokens: list[int], most: int | None = None) -> int:
        """How many of `tokens` the draft's pool holds the KV of, at most all but the last (the draft must see that
        one: its row gives the first draft; an early proposal's comes from a later row, so it takes most=all). A
        sequence's tokens are only ever appended to, so the tokens it had at its last proposal are still its first
        ones; of the drafts cached after them, those it went on with count. Compared a draft at a time: the whole
        prefix, before, cost two copies and a compare of the sequence a step."""
        seen, drafts = self.cached.get(seq_id, (0, []))
        most = len(tokens) - 1 if most is None else most
        n = min(seen, most)
        for draft in drafts:
            if n == most or tokens[n] != draft:
                break
            n += 1
        return n

    def _draw(self, logits: torch.Tensor, rows: list[DraftPosition]) -> tuple[torch.Tensor, list | None, set[int]]:
        """Each row's draft, on the device (argmax of the processed logits, or a draw from q), its q (None: greedy),
        and the rows whose own sampling work raised (their tokens are no drafts). Nothing is read back."""
        sampler = self.runner.sampler
        params = [r.params for r in rows]
        failed: dict[int, Exception] = {}
        processed, _ = sampler.processed(logits, rows, params, None, failed)
        tokens = processed.argmax(dim=-1)
        sampled = [r for r, p in enumerate(params) if p.temperature != 0]
        q_rows: list | None = None
        if sampled:
            at_sampled = to_device(sampled, torch.int64, logits.device)  # not a list index: a blocking copy
            probs = sampler.filtered_probs(
                processed[at_sampled],
                [params[r].temperature for r in sampled],
                [params[r].top_k for r in sampled],
                [params[r].top_p for r in sampled],
                [params[r].min_p for r in sampled],
            )
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for at, r in enumerate(sampled):
                if rows[r].generator is not None:  # a seeded request draws from its own generator
                    try:
                        noise[at].exponential_(generator=rows[r].generator)
                    except Exception as exc:
                        failed.setdefault(r, exc)
            tokens[at_sampled] = (probs / noise).argmax(dim=-1)
            q_rows = [None] * len(rows)
            for at, r in enumerate(sampled):
                q_rows[r] = probs[at]
        return tokens, q_rows, set(failed)
