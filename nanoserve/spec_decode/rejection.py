"""Verification: the target's logits at every drafted position -> the tokens to emit, the target's distribution kept.

A sequence with k drafts d_1..d_k brings k + 1 rows of logits: row j is the target's next-token distribution after
its tokens and d_1..d_j. Each row is first made what the plain sampler would make of it at that position
(Sampler.processed: min_tokens, logit_bias, penalties over the tokens before it, drafts included; then temperature
and top-k/top-p/min-p), so speculation changes no request's distribution:

- greedy rows: d_{j+1} is accepted while it is the row's argmax; the first row that disagrees emits its argmax;
- sampled rows (speculative sampling): d_{j+1}, drawn from the draft's distribution q, is accepted with probability
  min(1, p(d_{j+1}) / q(d_{j+1})); on rejection the row emits a draw from max(p - q, 0), normalized. For n-gram drafts
  q is a point mass on d_{j+1} (accepted with probability p(d_{j+1}), a rejection draws from p without d_{j+1}); a
  draft model passes its rows of q, made with the same parameters;
- when all k are accepted, row k emits a bonus token drawn from it as the plain sampler would.

So a sequence emits a + 1 tokens, a the accepted count. Every draw of a seeded request comes from its own generator,
in a fixed order, so its output is reproducible whatever shares its batch.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from nanoserve.layers.sampler import AllowedTokens, Sampler, SamplerOutput, SamplingRow
from nanoserve.sampling_params import SamplingParams
from nanoserve.utils import to_device


def takes_raw_argmax(params: SamplingParams) -> bool:
    """Whether a row's token is the argmax of its raw logits: greedy, and nothing in Sampler.processed changes them
    (no logit_bias, min_tokens or penalties; a structured mask is the caller's to check). Its fp32 copy of the logits
    is then skipped (a bf16 value converts to fp32 exactly, so the argmax, first on ties, is the same)."""
    return params.temperature == 0 and not params.logit_bias and not params.min_tokens and not params.has_penalties


@dataclass(eq=False)
class DraftPosition:
    """A sequence as the sampler sees it at one verified position: with the drafts before that position appended."""

    seq: SamplingRow
    drafts: list[int]  # the drafted tokens before this position

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.seq.generator

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


@dataclass
class _RowMasks:
    """A step's grammar masks with their rows moved to the verify rows (constrained sequences have no drafts)."""

    rows: list[int]
    bits: torch.Tensor
    failed: dict[int, Exception] = field(default_factory=dict)

    def wait(self) -> None:
        pass  # the masks it was made from were waited for


def rejection_sample(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: (accepted [R] bool, token to emit on rejection [R]).

    probs [R, V] the target's (filtered) distributions; drafts [R] the token drafted at each row (-1: none, the
    bonus row); uniforms [R] in [0, 1); noise [R, V] Exp(1) draws; draft_probs [R, V] the distributions q the drafts
    were drawn from (zeros at a bonus row), None for point masses. A draft is accepted when u < p(draft) / q(draft)
    (u * q < p: no division); the replacement is argmax(max(p - q, 0) / noise), a draw from the normalized remainder
    (the exponential race: scaling a row does not change its argmax, so no normalizing is needed)."""
    has_draft = drafts >= 0
    index = drafts.clamp(min=0)[:, None]
    p_draft = probs.gather(1, index)[:, 0]
    if draft_probs is None:
        accepted = has_draft & (uniforms < p_draft)
        # The draft's probability zeroed; a bonus row (no draft) writes its own p back at index 0, unchanged.
        remainder = probs.scatter(1, index, torch.where(has_draft, 0.0, p_draft)[:, None].to(probs.dtype))
    else:
        q_draft = draft_probs.gather(1, index)[:, 0]
        accepted = has_draft & (uniforms * q_draft < p_draft)
        remainder = (probs - draft_probs).clamp(min=0)
    return accepted, (remainder / noise).argmax(dim=-1)


@dataclass(eq=False)
class VerifyStep:
    """A verify step queued on the device, not read yet. row_tokens [R] holds, at each of a sequence's rows, the
    token that row emits if it is reached (row j, the token after its tokens and d_1..d_j: d_{j+1} where accepted);
    num_accepted() the accepted count of each sequence, on the device too. A proposer drafts the next step from them
    before the host reads this one (engine/llm_engine.py's early proposal); result() reads it."""

    row_tokens: torch.Tensor
    first_row: list[int]  # each sequence's first row in row_tokens
    _read: Callable[[], SamplerOutput]
    _accepted_rows: Callable[[], torch.Tensor]  # [R] bool on the device: row j's draft d_{j+1} accepted
    drafts: Sequence[list[int]]
    _out: SamplerOutput | None = None
    _num_accepted: torch.Tensor | None = None

    def result(self) -> SamplerOutput:
        if self._out is None:
            self._out = self._read()
        return self._out

    def num_accepted(self) -> torch.Tensor:
        """[S] int64 on the device: how many of its drafts each sequence's verification accepted (a leading run)."""
        if self._num_accepted is None:
            accepted = self._accepted_rows()
            most = max((len(d) for d in self.drafts), default=0)
            if most == 0:
                self._num_accepted = torch.zeros(len(self.drafts), dtype=torch.int64, device=accepted.device)
            else:
                # Each sequence's draft rows, padded with a row that is never accepted: the leading run of trues.
                pad = accepted.shape[0]
                index = [[start + j if j < len(d) else pad for j in range(most)]
                         for start, d in zip(self.first_row, self.drafts, strict=True)]
                padded = torch.cat([accepted, accepted.new_zeros(1)])
                rows = padded[to_device(index, torch.int64, accepted.device)]
                self._num_accepted = rows.long().cumprod(dim=1).sum(dim=1)
        return self._num_accepted


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    seqs: Sequence[SamplingRow],
    drafts: Sequence[list[int]],
    masks: AllowedTokens | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> SamplerOutput:
    """The tokens each of `seqs` emits from its 1 + len(drafts[i]) rows of `logits` (in order), read to the host.
    SamplerOutput.offsets says where each sequence's tokens (accepted drafts, then one more) lie in token_ids.
    draft_probs[i]: the distributions sequence i's drafts were drawn from ([>= len(drafts[i]), V]; None: point
    masses, as when draft_probs is None); greedy rows ignore them."""
    return queue_verify(sampler, logits, seqs, drafts, masks, draft_probs).result()


def queue_verify(
    sampler: Sampler,
    logits: torch.Tensor,
    seqs: Sequence[SamplingRow],
    drafts: Sequence[list[int]],
    masks: AllowedTokens | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> VerifyStep:
    """verify(), queued on the device and read when its result() is asked for. Every random draw is made here, in
    the order verify() makes them."""
    first_row, at = [], 0
    for d in drafts:
        first_row.append(at)
        at += len(d) + 1
    if masks is None and all(takes_raw_argmax(s.params) and s.params.logprobs is None for s in seqs):
        argmax = logits.argmax(dim=-1)

        def accepted_greedy() -> torch.Tensor:
            draft_of_row = [t for d in drafts for t in (*d, -1)]
            return argmax == to_device(draft_of_row, torch.int64, argmax.device)

        host, done = _copy_to_host(argmax)

        def read_greedy() -> SamplerOutput:
            if done is not None:
                done.synchronize()
            return _verify_greedy(host, drafts)

        return VerifyStep(argmax, first_row, read_greedy, accepted_greedy, drafts)
    device = logits.device
    rows: list[DraftPosition] = []
    draft_of_row: list[int] = []
    for seq, seq_drafts in zip(seqs, drafts, strict=True):
        rows += [DraftPosition(seq, seq_drafts[:j]) for j in range(len(seq_drafts) + 1)]
        draft_of_row += [*seq_drafts, -1]
    seq_of_row = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
    failed: dict[int, Exception] = {}
    row_masks = None
    if masks is not None:
        masks.wait()
        assert all(not drafts[i] for i in masks.rows), "a constrained sequence is never drafted for"
        row_masks = _RowMasks([first_row[i] for i in masks.rows], masks.bits)
        failed.update({first_row[i]: exc for i, exc in masks.failed.items()})
    params = [r.params for r in rows]
    processed, raw_logprobs = sampler.processed(logits, rows, params, row_masks, failed)
    draft_tokens = to_device(draft_of_row, torch.int64, device)
    tokens = processed.argmax(dim=-1)  # greedy rows keep these
    accepted = (tokens == draft_tokens) & (draft_tokens >= 0)
    sampled = [r for r, p in enumerate(params) if p.temperature != 0]
    if sampled:
        probs = sampler.filtered_probs(
            processed[sampled] if len(sampled) < len(rows) else processed,
            [params[r].temperature for r in sampled],
            [params[r].top_k for r in sampled],
            [params[r].top_p for r in sampled],
            [params[r].min_p for r in sampled],
        )
        uniforms = torch.rand(len(sampled), device=device, generator=sampler.generator)
        noise = torch.empty_like(probs).exponential_(generator=sampler.generator)
        _seeded_draws(sampled, rows, seq_of_row, uniforms, noise, failed)
        picked = to_device(sampled, torch.int64, device)
        q = _draft_rows(sampled, seq_of_row, drafts, draft_probs, probs)
        row_accepted, replacement = rejection_sample(probs, draft_tokens[picked], uniforms, noise, q)
        accepted[picked] = row_accepted
        tokens[picked] = replacement
    emitted = torch.where(accepted, draft_tokens, tokens)
    queued = sampler.token_logprobs(raw_logprobs, emitted, params)
    accepted_copy, done = _copy_to_host(accepted)
    if done is not None:
        queued = queued.to_host()
        done.record()  # after the logprobs' copies too

    def read() -> SamplerOutput:
        if done is not None:
            done.synchronize()
        out = queued.result()
        accepted_host = accepted_copy.tolist()
        keep: list[int] = []
        offsets = [0]
        for start, seq_drafts in zip(first_row, drafts, strict=True):
            count = 1
            while count <= len(seq_drafts) and accepted_host[start + count - 1]:
                count += 1
            offsets.append(offsets[-1] + count)
            keep += range(start, start + count)
        seq_failed: dict[int, Exception] = {}
        for r, exc in failed.items():
            seq_failed.setdefault(seq_of_row[r], exc)
        return SamplerOutput([out.token_ids[r] for r in keep], [out.logprobs[r] for r in keep], seq_failed, offsets)

    return VerifyStep(emitted, first_row, read, lambda: accepted, drafts)


def _copy_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`values` copied to the host behind the kernels queued so far, and the event that says the copy is done (None
    on the CPU: nothing to wait for). A read of the tensor itself would wait for the whole stream, the early
    proposal's draft passes queued after the verify step included."""
    if values.device.type != "cuda":
        return values, None
    host = values.to("cpu", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _verify_greedy(argmax_rows: torch.Tensor, drafts: Sequence[list[int]]) -> SamplerOutput:
    """verify() where every row emits the argmax of its raw logits (takes_raw_argmax, no logprobs, no masks): a draft
    is accepted while it is its row's argmax, so the argmaxes are the tokens to emit, read in one go and the drafts
    checked against them on the host. (Checked on the device, it took seven more small tensor ops and a second read a
    step: the host's step time is the step time of a small model, issue #43.)"""
    argmax = argmax_rows.tolist()
    token_ids: list[int] = []
    offsets = [0]
    row = 0
    for seq_drafts in drafts:
        count = 1  # the accepted drafts and the token after them
        for draft in seq_drafts:
            if argmax[row + count - 1] != draft:
                break
            count += 1
        token_ids += argmax[row : row + count]
        offsets.append(len(token_ids))
        row += len(seq_drafts) + 1
    return SamplerOutput(token_ids, [None] * len(token_ids), {}, offsets)


def _draft_rows(
    sampled: list[int],
    seq_of_row: list[int],
    drafts: Sequence[list[int]],
    draft_probs: Sequence[torch.Tensor | None] | None,
    probs: torch.Tensor,
) -> torch.Tensor | None:
    """q at each sampled row ([len(sampled), V]): the draft's rows at a sequence's drafted positions, zeros at its
    bonus row, point masses where its drafts came without distributions. None when no sequence has them (all point
    masses). A sequence's rows are adjacent and all sampled or none (one sequence, one set of parameters), so this
    goes a sequence at a time, in one concatenation."""
    if draft_probs is None or all(draft_probs[seq_of_row[r]] is None for r in sampled):
        return None
    zero = probs.new_zeros(1, probs.shape[1])
    pieces = []
    at = 0
    while at < len(sampled):
        i = seq_of_row[sampled[at]]
        count = len(drafts[i])
        if count:
            seq_q = draft_probs[i]
            if seq_q is None:
                index = torch.tensor(drafts[i], device=probs.device)
                pieces.append(torch.nn.functional.one_hot(index, probs.shape[1]).to(probs.dtype))
            else:
                pieces.append(seq_q[:count].to(probs.dtype))
        pieces.append(zero)
        at += count + 1
    return torch.cat(pieces)


def _seeded_draws(
    sampled: list[int],
    rows: list[DraftPosition],
    seq_of_row: list[int],
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    failed: dict[int, Exception],
) -> None:
    """A seeded sequence's uniforms and noise redrawn from its own generator, one sequence's rows at a time (its
    rows are adjacent), so what it draws depends on nothing else in the batch."""
    at = 0
    while at < len(sampled):
        end = at
        while end < len(sampled) and seq_of_row[sampled[end]] == seq_of_row[sampled[at]]:
            end += 1
        generator = rows[sampled[at]].generator
        if generator is not None:
            try:
                # Uniforms for its drafts only: without drafts it draws what the plain sampler draws (one row of
                # noise), so whether others in its batch have drafts changes nothing of its output.
                if end - at > 1:
                    uniforms[at : end - 1] = torch.rand(end - at - 1, device=uniforms.device, generator=generator)
                noise[at:end].exponential_(generator=generator)
            except Exception as exc:
                failed.setdefault(sampled[at], exc)
        at = end
