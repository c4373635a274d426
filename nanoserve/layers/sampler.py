"""Sampler: one batched pass that applies each row's own sampling parameters.

Sampling is argmax(probs / q) with q ~ Exp(1) (the exponential-race form of drawing from probs), so a
seeded row draws its noise from its own generator and samples the same tokens whatever else is in
the batch. On CUDA, a batch that asks for nothing but temperatures (no top-k/top-p/min-p, no seeds, no
penalties: the common case) samples in one Triton pass instead (kernels/sampling.py, the Gumbel-max
form of the same draw), which reads the logits once instead of about nine times.

A row is anything with SamplingRow's fields: the engine passes its own sequences (engine/request.py), which
the per-row loop reads in place, with no per-row copy.

Structured output: the rows a grammar constrains come with a bitmask of allowed tokens (AllowedTokens, computed
on the host while the device runs the forward pass, nanoserve/structured/), applied last before the draw, after
logit_bias and penalties, so that top-k / top-p / min-p choose among allowed tokens only; greedy rows take the best
allowed token.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from nanoserve.sampling_params import SamplingParams
from nanoserve.utils import to_device


class SamplingRow(Protocol):
    """What the sampler reads of the sample behind one row of logits (engine.request.Sequence is one)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def generator(self) -> torch.Generator | None: ...  # a seeded sample's own generator
    @property
    def token_ids(self) -> list[int]: ...  # prompt, then generated tokens (repetition penalty)
    @property
    def output_token_ids(self) -> list[int]: ...  # presence / frequency penalties
    @property
    def num_output_tokens(self) -> int: ...  # min_tokens: generated so far, any still in flight included


class AllowedTokens(Protocol):
    """The tokens each constrained row may take (structured/manager.py's TokenBitmask): bit t % 32 of word t // 32
    set allows token t."""

    rows: list[int]  # the rows of the batch it constrains, in order
    bits: torch.Tensor  # [len(rows), words] int32 on the host (pinned when bound for a GPU)
    failed: dict[int, Exception]  # row -> why its grammar could not give a mask

    def wait(self) -> None: ...  # until `bits` is filled, when another thread fills it


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when logprobs were asked: (top ids, top logprobs, sampled logprob, sampled rank).
    logprobs: list[tuple[list[int], list[float], float, int] | None]
    failed: dict[int, Exception] = field(default_factory=dict)  # row -> what raised while sampling it alone
    # Speculative verification (spec_decode/rejection.py): row r emits token_ids[offsets[r]:offsets[r + 1]] (and
    # those logprobs). None: one token a row.
    offsets: list[int] | None = None

    @property
    def counts(self) -> list[int]:
        """Tokens each row emits."""
        if self.offsets is None:
            return [1] * len(self.token_ids)
        return [b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False)]


@dataclass
class SampledTokens:
    """A batch's samples as tensors: on the device when sampled, then copied to the host without
    waiting (to_host), so the host reads them (result) only when it needs them."""

    token_ids: torch.Tensor  # [rows] int64
    num_logprobs: list[int | None]  # per row, what the request asked for
    chosen: torch.Tensor | None = None  # [rows] the sampled token's logprob
    ranks: torch.Tensor | None = None  # [rows]
    top_ids: torch.Tensor | None = None  # [rows, max n]
    top_values: torch.Tensor | None = None
    failed: dict[int, Exception] = field(default_factory=dict)  # rows whose own sampling work raised

    def to_host(self) -> "SampledTokens":
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            # From the GPU, non_blocking lands in pinned memory: the copy runs behind the step's kernels.
            return None if t is None else t.to("cpu", non_blocking=True)

        return SampledTokens(copy(self.token_ids), self.num_logprobs, copy(self.chosen), copy(self.ranks),
                             copy(self.top_ids), copy(self.top_values), self.failed)

    def result(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        if self.chosen is None:
            return SamplerOutput(token_ids, [None] * len(token_ids), self.failed)
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[]] * len(token_ids)
        top_values = self.top_values.tolist() if self.top_values is not None else [[]] * len(token_ids)
        logprobs = [None if n is None else (top_ids[i][:n], top_values[i][:n], chosen[i], ranks[i])
                    for i, n in enumerate(self.num_logprobs)]
        return SamplerOutput(token_ids, logprobs, self.failed)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: list[int], seed: int) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # The fused kernel's noise key: from the engine's seed, and new at every call.
        self.fused = device.type == "cuda"
        self.seed = seed
        self.num_calls = 0
        # Byte k of a bitmask viewed as uint8 holds tokens 8k .. 8k + 7 (little-endian words), one per bit value.
        self.bit_values = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SamplingRow],
                 masks: AllowedTokens | None = None) -> SamplerOutput:
        return self.sample(logits, seqs, masks).result()

    def sample(self, logits: torch.Tensor, seqs: Sequence[SamplingRow],
               masks: AllowedTokens | None = None) -> SampledTokens:
        """Sample one token per row, without reading anything back to the host. Per-row work that raises
        (a sequence's own generator, its penalties, its grammar) marks that row failed instead of failing the
        batch. `masks`: the allowed tokens of the rows a grammar constrains."""
        if masks is not None:  # its failed rows are known once it is filled
            masks.wait()
        # One pass over the rows: this runs every step for every sequence, on the host's critical path.
        params = [s.params for s in seqs]
        sampled_rows, temps, top_k, top_p, min_p = [], [], [], [], []
        plain = self.fused
        for i, p in enumerate(params):
            if p.temperature != 0:
                sampled_rows.append(i)
                temps.append(p.temperature)
                top_k.append(p.top_k)
                top_p.append(p.top_p)
                min_p.append(p.min_p)
                plain = plain and p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 and seqs[i].generator is None
            plain = plain and not p.has_penalties and not p.logit_bias
        if plain:
            out = self._sample_fused(logits, seqs, params, masks)
            out.failed = dict(masks.failed) if masks is not None else {}
            return out
        failed: dict[int, Exception] = dict(masks.failed) if masks is not None else {}
        logits, raw_logprobs = self.processed(logits, seqs, params, masks, failed)
        everyone_samples = len(sampled_rows) == len(seqs)
        tokens = None if everyone_samples else logits.argmax(dim=-1)
        if sampled_rows:
            if everyone_samples:  # the common all-sampled batch: no gather, no scatter
                rows = None
                probs = self.filtered_probs(logits, temps, top_k, top_p, min_p)
            else:
                rows = to_device(sampled_rows, torch.int64, self.device)
                probs = self.filtered_probs(logits[rows], temps, top_k, top_p, min_p)
            q = torch.empty_like(probs).exponential_(generator=self.generator)
            seeded = [(j, i) for j, i in enumerate(sampled_rows) if seqs[i].generator is not None]
            _each_row(seeded, lambda ji: q[ji[0]].exponential_(generator=seqs[ji[1]].generator), failed,
                      row=lambda ji: ji[1])
            picked = (probs / q).argmax(dim=-1)
            if rows is None:
                tokens = picked
            else:
                tokens[rows] = picked
        out = self.token_logprobs(raw_logprobs, tokens, params)
        out.failed = failed
        return out

    def processed(self, logits: torch.Tensor, seqs: Sequence[SamplingRow], params: list[SamplingParams],
                  masks: AllowedTokens | None, failed: dict[int, Exception],
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits each row's parameters make of its raw logits before temperature and the draw (fp32, a copy):
        eos and stop ids masked below min_tokens, logit_bias, penalties, grammar masks; and the raw logprobs when a
        row asks for logprobs (else None). Rows whose own work raises land in `failed`. Speculative verification
        (spec_decode/rejection.py) takes its target distributions from here too."""
        # .float() copies bf16 logits; fp32 ones are cloned, since the masks below write in place.
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._mask_stop_tokens(logits, seqs, params)
        self._apply_logit_bias(logits, params)
        _each_row([i for i, p in enumerate(params) if p.has_penalties],
                  lambda i: self._apply_penalties(logits[i], seqs[i]), failed)
        if masks is not None:
            self._apply_bitmask(logits, masks)
        return logits, raw_logprobs

    def _sample_fused(self, logits: torch.Tensor, seqs: Sequence[SamplingRow], params: list,
                      masks: AllowedTokens | None) -> SampledTokens:
        from nanoserve.kernels.sampling import gumbel_max_sample

        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        if masks is not None or any(p.min_tokens for p in params):
            logits = logits.clone()  # the caller's logits stay as they came
            self._mask_stop_tokens(logits, seqs, params)
            if masks is not None:
                self._apply_bitmask(logits, masks)
        temps = to_device([p.temperature for p in params], torch.float32, self.device)
        self.num_calls += 1
        return self.token_logprobs(raw_logprobs, gumbel_max_sample(logits, temps, self._key(self.num_calls)), params)

    def _key(self, call: int) -> int:
        return (self.seed * 0x9E3779B1 + call * 0x632BE5AB) & 0xFFFFFFFF

    # -- tensor parallelism: the other ranks draw rank 0's tokens themselves ------------------------------------
    def replicable(self, seqs: Sequence[SamplingRow], masks: AllowedTokens | None) -> bool:
        """Whether this batch's tokens are a function of the logits, the rows' temperatures and the next call's key
        alone, so that another rank holding the same logits draws the same tokens (sample_replica) with nothing
        but the temperatures sent: on CUDA the fused kernel's batches, on the CPU all-greedy ones. Anything that
        reads a sequence's host state (its own seed's generator, its history for penalties and min_tokens, its
        grammar) or the engine generator's running state is not."""
        if masks is not None or not seqs:
            return False
        for s in seqs:
            p = s.params
            if p.has_penalties or p.logit_bias or p.min_tokens:
                return False
            if p.temperature != 0 and not (self.fused and p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0
                                           and s.generator is None):
                return False
        return True

    def sample_replica(self, logits: torch.Tensor, temperatures: list[float], call: int) -> torch.Tensor:
        """The tokens rank 0's sample() drew from the same logits for a replicable batch, whose fused call was
        number `call` (temperatures: the rows', only when fused)."""
        if self.fused:
            from nanoserve.kernels.sampling import gumbel_max_sample

            self.num_calls = call
            return gumbel_max_sample(logits, to_device(temperatures, torch.float32, self.device), self._key(call))
        return (logits.float() if logits.dtype != torch.float32 else logits).argmax(dim=-1)

    def _mask_stop_tokens(self, logits: torch.Tensor, seqs: Sequence[SamplingRow], params: list) -> None:
        rows, cols = [], []
        for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
            # Not under a grammar: once it is complete it allows only eos, and masking that leaves no token at all.
            if p.min_tokens and s.num_output_tokens < p.min_tokens and p.structured_outputs is None:
                ids = self.eos_token_ids + p.stop_token_ids
                rows += [i] * len(ids)
                cols += ids
        if rows:
            logits[to_device(rows, torch.int64, self.device), to_device(cols, torch.int64, self.device)] = -float("inf")

    def _apply_logit_bias(self, logits: torch.Tensor, params: list) -> None:
        """OpenAI's logit_bias: each listed token's logit moves by its bias, before penalties and sampling."""
        rows, cols, biases = [], [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                rows += [i] * len(p.logit_bias)
                cols += p.logit_bias.keys()
                biases += p.logit_bias.values()
        if rows:
            # (row, token) pairs are unique (dict keys per row), so a plain indexed add is exact.
            index = (to_device(rows, torch.int64, self.device), to_device(cols, torch.int64, self.device))
            logits.index_put_(index, to_device(biases, torch.float32, self.device), accumulate=True)

    def _apply_bitmask(self, logits: torch.Tensor, masks: AllowedTokens) -> None:
        """-inf on every token the constrained rows' grammars do not allow (ids past the bitmask included)."""
        bits = masks.bits.to(self.device, non_blocking=True)
        # Unpacked one byte at a time: [rows, words * 4, 8] booleans, one per token, in token order.
        allowed = ((bits.view(torch.uint8)[:, :, None] & self.bit_values) != 0).view(bits.shape[0], -1)
        vocab = logits.shape[1]
        if allowed.shape[1] < vocab:
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        forbidden = ~allowed[:, :vocab]
        if len(masks.rows) == logits.shape[0]:  # every row constrained: in place, no gather
            logits.masked_fill_(forbidden, -float("inf"))
        else:
            rows = to_device(masks.rows, torch.int64, self.device)
            logits[rows] = logits[rows].masked_fill(forbidden, -float("inf"))

    def _apply_penalties(self, row: torch.Tensor, seq: SamplingRow) -> None:
        p = seq.params
        if p.repetition_penalty != 1:
            # As in Hugging Face (CTRL): over prompt and output, shrink positive logits, grow negative.
            seen = torch.tensor(seq.token_ids, dtype=torch.long, device=self.device).unique()
            picked = row[seen]
            row[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            # As in OpenAI's API: over generated tokens only.
            out_ids = torch.tensor(seq.output_token_ids, dtype=torch.long, device=self.device)
            counts = torch.bincount(out_ids, minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def filtered_probs(self, logits: torch.Tensor, temps: list[float], top_k: list[int], top_p: list[float],
                        min_p: list[float]) -> torch.Tensor:
        logits = logits / to_device(temps, torch.float32, self.device)[:, None]
        need_top_k = any(k > 0 for k in top_k)
        need_top_p = any(p < 1 for p in top_p)
        need_min_p = any(p > 0 for p in min_p)
        if not (need_top_k or need_top_p or need_min_p):
            return torch.softmax(logits, dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_top_k:
            k = to_device([k if k > 0 else vocab for k in top_k], torch.int64, self.device)
            remove |= torch.arange(vocab, device=self.device)[None, :] >= k[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(remove, -float("inf")), dim=-1)
        if need_top_p:
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            remove |= (probs.cumsum(dim=-1) - probs) >= to_device(top_p, torch.float32, self.device)[:, None]
        if need_min_p:
            remove |= probs < to_device(min_p, torch.float32, self.device)[:, None] * probs[:, :1]
        remove[:, 0] = False
        mask = torch.empty_like(remove).scatter_(1, order, remove)
        return torch.softmax(logits.masked_fill(mask, -float("inf")), dim=-1)

    @staticmethod
    def token_logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, params: list) -> SampledTokens:
        num_logprobs = [p.logprobs for p in params]
        if raw is None:
            return SampledTokens(tokens, num_logprobs)
        # One batched top-k for all rows, read back with the tokens: not a sync per request.
        max_n = max(n or 0 for n in num_logprobs)
        chosen = raw.gather(1, tokens[:, None])
        ranks = (raw > chosen).sum(dim=1) + 1
        top = raw.topk(max_n, dim=1) if max_n else None
        return SampledTokens(tokens, num_logprobs, chosen[:, 0], ranks, top.indices if top is not None else None,
                             top.values if top is not None else None)


def _each_row(items: list, fn: Callable, failed: dict[int, Exception], row: Callable = lambda i: i) -> None:
    """fn(item) for each item; one that raises is recorded as its row's failure, and the others go on."""
    for item in items:
        try:
            fn(item)
        except Exception as exc:
            failed.setdefault(row(item), exc)
