"""LLMEngine: add requests, step the scheduler and the model, and hand back outputs."""

import atexit
import logging
import time
from collections.abc import Callable

import torch

from nanoserve.config import EngineArgs, EngineConfig
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.detokenizer import IncrementalDetokenizer
from nanoserve.engine.frontend import EngineFrontend, check_token_ids, engine_config, load_tokenizer
from nanoserve.engine.local_blocks import LocalBlocks
from nanoserve.engine.request import Request, SeqStatus, Sequence
from nanoserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from nanoserve.layers.sampler import SamplerOutput
from nanoserve.outputs import CompletionOutput, Logprob, RequestOutput
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec_decode.ngram import NgramProposer
from nanoserve.spec_decode.proposer import Proposer
from nanoserve.spec_decode.stats import SpecDecodeStats
from nanoserve.structured.backend import GrammarCompiler
from nanoserve.structured.manager import StructuredOutputManager
from nanoserve.worker.draft_model import DraftModelProposer
from nanoserve.worker.eagle3 import Eagle3Proposer
from nanoserve.worker.kv_cache import prefix_load_pays
from nanoserve.worker.model_runner import LaunchedStep, ModelRunner
from nanoserve.worker.tp_worker import TensorParallelWorkers

logger = logging.getLogger(__name__)


class LLMEngine(EngineFrontend):
    """The frontend (config, tokenizer, prompt checks) plus what runs requests: the model runner, the
    scheduler and the block manager."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, load_tokenizer(config.tokenizer_dir))
        if self.tokenizer is None:
            logger.warning("no tokenizer in %s (no tokenizer.json or tokenizer.model): prompts must be token ids, "
                           "and chat needs --tokenizer DIR", config.tokenizer_dir)
        if not config.model.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            config.model.eos_token_ids = [self.tokenizer.eos_token_id]
        # Under tensor parallelism this process is rank 0: it starts the node's other ranks, which the runner drives.
        workers = TensorParallelWorkers.start(config) if config.args.tensor_parallel_size > 1 else None
        # A draft model (or EAGLE-3 head) is loaded first: its weights are then in use when the target's runner sizes
        # the KV pool.
        draft = None
        if config.speculative is not None and config.speculative.method in ("draft_model", "eagle3"):
            draft = (Eagle3Proposer if config.speculative.method == "eagle3" else DraftModelProposer)(config)
            config.draft_kv_bytes_per_block = draft.kv_bytes_per_block
        self.runner = ModelRunner(config, workers=workers)
        if isinstance(draft, Eagle3Proposer):
            draft.attach(self.runner)
        if draft is not None:
            draft.allocate(self.runner.num_kv_blocks, config.max_model_len, self.runner.graphs is not None)
            logger.info("speculative decoding: %s %s, its KV pool %d blocks (%.1f MiB, out of the KV budget), "
                        "decode steps %s", "EAGLE-3 head" if isinstance(draft, Eagle3Proposer) else "draft model",
                        config.speculative.model, self.runner.num_kv_blocks,
                        self.runner.num_kv_blocks * draft.kv_bytes_per_block / 2**20,
                        "in CUDA graphs" if draft.runner.graphs is not None else "eager")
            self.runner.draft_probs = draft.draft_probs
        if workers is not None:
            # Stopped before the interpreter exits, whoever forgets to shut the engine down (nanoserve generate, a
            # script's LLM): otherwise multiprocessing's own exit hook, registered earlier and so run after this
            # one, kills the ranks and rank 0's watcher reports a lost rank after a run that went well.
            atexit.register(self.shutdown)
        # A sequence longer than the GPU pool runs in long-context mode, its older blocks in the CPU pool.
        config.fit_kv_pool(self.runner.num_kv_blocks + self.runner.num_cpu_blocks)
        groups = self.runner.kv_groups
        local = None
        if groups is not None:  # the sliding-window layers' own pool, which frees blocks out of their window
            local = LocalBlocks(self.runner.num_local_blocks, config.args.block_size, groups.window,
                                config.args.enable_prefix_caching)
        logger.info("%s", config.summary(self.runner.num_kv_blocks,
                                         local and (local.num_blocks - 1, local.window, groups.all_local)))
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.args.block_size,
                                          config.args.enable_prefix_caching, self.runner.num_cpu_blocks,
                                          cpu_prefix_tier=prefix_load_pays(config), local=local)
        self.scheduler = Scheduler(self.block_manager, config.args.max_num_seqs,
                                   config.args.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0
        self.step_hooks: list[Callable[[list[RequestOutput]], list[RequestOutput]]] = []  # add_step_hook
        # Tokens after which a hook may force tokens (the tool loop: <|python_end|>): a verify step appends no
        # accepted draft past one, or the forced tokens would land after drafts the model never saw them before.
        self.force_after_token_ids: set[int] = set()
        asked = config.args.async_scheduling
        self.async_scheduling = config.device.type == "cuda" if asked is None else asked
        # Speculative decoding (spec_decode/): the host reads each step before it schedules the next (its accepted
        # count sets the next step's positions and blocks). With async scheduling asked for (async_scheduling=True,
        # not its CUDA default) a draft model or EAGLE-3 head drafts for the next step on the device right after the
        # verify step is queued, from its results there (early_drafts): the host reads the verify step and appends
        # its tokens while the device drafts. Not by default: on an H200 the bundled model's draft ran 0.93x plain
        # decoding with early drafts against 1.32x with synchronous steps (docs/speculative_decoding.md).
        self.proposer: Proposer | None = None  # spec_decode/proposer.py: n-gram or a draft model
        self.spec_stats: SpecDecodeStats | None = None
        self.early_drafts = False
        if (spec := config.speculative) is not None:
            self.proposer = draft or NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max,
                                                   spec.prompt_lookup_min)
            self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens)
            why = ("the n-gram lookup runs on the host, over the tokens the last step emitted" if draft is None else
                   "tensor parallelism" if workers is not None else
                   "the CPU KV tier (kv_offload_gb)" if self.runner.num_cpu_blocks else None)
            self.early_drafts = bool(asked) and why is None
            if asked and why is not None:
                logger.warning("async_scheduling: speculative steps are synchronous with %s", why)
            self.async_scheduling = False
        self.in_flight: LaunchedStep | None = None
        self.last_batch: SchedulerOutput | None = None  # the batch the last step() scheduled (the web page shows it)
        # Structured output (nanoserve/structured/): grammars compiled off this loop, token masks, matcher states.
        self.structured = StructuredOutputManager(
            lambda: GrammarCompiler(self.tokenizer, config.model.eos_token_ids, config.model.vocab_size,
                                    num_threads=config.args.mask_threads), config.device)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(engine_config(args))

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        prompt_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_ids)
        if params.n > self.config.args.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs={self.config.args.max_num_seqs}")
        vocab = self.config.model.vocab_size
        check_token_ids("stop_token_ids", params.stop_token_ids, vocab)
        check_token_ids("logit_bias", params.logit_bias or (), vocab)
        room = self.max_model_len - len(prompt_ids)
        request = Request(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params,
                          max_tokens=min(params.max_tokens or room, room), priority=priority)
        if params.n > 1 and self.block_manager.exceeds_gpu_pool(len(prompt_ids) + 1):
            raise ValueError(f"n: a request longer than the GPU KV pool ({self.block_manager.num_blocks} blocks) runs "
                             "in long-context mode, which takes one sample (n=1)")
        # Every sample is built before the request is registered: a failure leaves the engine as it was.
        first, *request.unforked = [self._new_sequence(request, i) for i in range(params.n)]
        request.seqs.append(first)
        self.requests[request_id] = request
        if self.structured.admit(request):  # else it waits for its grammar's compile (_admit_compiled)
            self.scheduler.add(first)
        return request

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            # Sample i of a seeded request draws from seed + i: sample 0 matches the same seed with n=1.
            generator = torch.Generator(device=self.config.device).manual_seed(params.seed + index)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                       params.stop)
        return Sequence(request, index, list(request.prompt_token_ids), len(request.prompt_token_ids), detok,
                        generator, logprobs=[] if params.logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self._end_request(request_id, "abort")

    def _fail_request(self, request: Request, exc: Exception) -> RequestOutput | None:
        """Finish `request` alone with finish_reason "error", after something raised while working on it."""
        logger.error("request %s failed: %s: %s", request.request_id, type(exc).__name__, exc, exc_info=exc)
        request.error = f"{type(exc).__name__}: {exc}"
        return self._end_request(request.request_id, "error")

    def _end_request(self, request_id: str, reason: str) -> RequestOutput | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in self.scheduler.abort_request(request):
            seq.finish_reason = reason
            if self.proposer is not None:
                self.proposer.release(seq.seq_id)
        request.aborted = True
        request.metrics.finished_time = time.monotonic()
        return self._output(request)

    def shutdown(self) -> None:
        """Stop what the engine started beside itself (tensor-parallel workers); idempotent."""
        atexit.unregister(self.shutdown)
        self.runner.shutdown()
        self.structured.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self.structured.has_waiting

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar has compiled since; fail those whose compile failed."""
        ready, failed = self.structured.take_ready(block=not self.scheduler.has_unfinished)
        for request in ready:
            self.scheduler.add(request.seqs[0])
        return [out for request, exc in failed if (out := self._fail_request(request, exc)) is not None]

    # -- one step -----------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One forward pass. Returns an output for each request that got tokens (only for the ones
        that finished with final_only: offline callers skip building the rest).

        With async scheduling (on CUDA) the step launched here is read back by the next call: this
        call returns the previous step's tokens, so the host's work overlaps the GPU's."""
        compiled = self._admit_compiled() if self.structured.has_waiting else []
        outputs = []
        # Before scheduling: a sample that finishes on these tokens must not be in the batch (its blocks are freed).
        if self.in_flight is not None and self.scheduler.needs_host_tokens:
            outputs = self._process(self.in_flight, final_only)
            self.in_flight = None
        if self.proposer is not None:
            self._propose()
        batch = self.last_batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.scheduled else None
        if self.early_drafts and launched is not None:
            self._propose_early(launched)
        if self.in_flight is not None:
            outputs = self._process(self.in_flight, final_only)
        self.in_flight = launched
        if not self.async_scheduling and self.in_flight is not None:
            outputs = self._process(self.in_flight, final_only)
            self.in_flight = None
        outputs = compiled + outputs if compiled else outputs
        for hook in self.step_hooks:
            outputs = hook(outputs)
        return outputs

    def _propose(self) -> None:
        """Drafts for the running samples about to decode, capped so that no sample can emit past max_tokens or
        max_model_len. Not for a constrained sample (a draft would need its grammar's masks at every position), nor for
        the prompt's last token of a request still to fork into its n samples (the verify entry would hold one sample's
        rows for n of them)."""
        rows, caps = [], []
        for seq in self.scheduler.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_pending or seq.cpu_blocks is not None or \
                    seq.grammar is not None or seq.params.structured_outputs is not None or seq.request.needs_fork:
                continue
            # A verify step emits accepted drafts + 1 tokens.
            cap = min(seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if cap >= 1:
                rows.append(seq)
                caps.append(cap)
        # Drafts an early proposal made on the device while the host read the last step (_propose_early).
        found = self.proposer.take_early(rows, caps) if self.early_drafts else [None] * len(rows)
        late = [i for i, drafts in enumerate(found) if drafts is None]
        if late:
            proposed = self.proposer.propose([rows[i] for i in late], [caps[i] for i in late])
            for i, drafts in zip(late, proposed, strict=True):
                found[i] = drafts
        for seq, drafts in zip(rows, found, strict=True):
            seq.spec_token_ids = drafts

    def _propose_early(self, launched: LaunchedStep) -> None:
        """Queue the draft's proposal for the step after `launched` on the device, before the host reads it: for each
        drafted sample, from the verify step's tokens there, as many drafts as whatever that step accepts leaves
        room for. Not for the samples whose proposal reads their tokens on the host (penalties, min_tokens) or that
        are never drafted for (_propose). The next _propose takes the drafts of the samples whose verify step
        emitted every token the device drafted from (_append_verified)."""
        launched.settle()  # the verify step is queued (a deferred one waits for its structured masks)
        if launched.verified is None:
            return
        rows, caps, at = [], [], []
        sample = 0
        for entry in launched.batch.scheduled:
            for seq in entry.sample_seqs:
                num_drafts = len(entry.draft_token_ids)
                if num_drafts and seq.grammar is None and seq.params.structured_outputs is None and \
                        not seq.params.has_penalties and not seq.params.min_tokens and seq.cpu_blocks is None:
                    # At least one token comes of the verify step; positions reach len + num_drafts + cap - 1.
                    known = len(seq.token_ids)
                    cap = min(seq.request.max_tokens - (known - seq.num_prompt_tokens) - 2,
                              self.max_model_len - known - max(num_drafts, 2))
                    if cap >= 1:
                        rows.append(seq)
                        caps.append(cap)
                        at.append(sample)
                sample += 1
        if rows:
            self.proposer.propose_early(rows, caps, launched.verified, at)

    def _launch(self, batch: SchedulerOutput) -> LaunchedStep:
        now = time.monotonic()
        # The sampler reads num_output_tokens (min_tokens), so pending counts move only after the launch.
        # Until a constrained request has come (its grammar compiler exists), no step looks for constrained rows.
        masks = self.structured.logit_masks if self.structured.compiler is not None else None
        launched = self.runner.launch(batch, self.in_flight, masks)
        for entry in batch.scheduled:
            metrics = entry.seq.request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                self.num_prompt_tokens += len(entry.seq.request.prompt_token_ids)
            for seq in entry.sample_seqs:
                seq.num_pending += 1
        return launched

    def _process(self, launched: LaunchedStep, final_only: bool) -> list[RequestOutput]:
        """Read a launched step's samples and append them: stop checks, detokenizing, outputs. Whatever
        raises while one request's tokens are handled fails that request alone."""
        sampled = launched.result()
        touched: dict[str, Request] = {}
        failed: list[RequestOutput] = []
        row = 0
        for entry in launched.batch.scheduled:
            request = entry.seq.request
            rows = range(row, row + len(entry.sample_seqs))
            row = rows.stop
            try:
                if request.aborted:  # aborted or failed since the launch
                    continue
                if sampled.failed and (errors := [sampled.failed[r] for r in rows if r in sampled.failed]):
                    raise errors[0]
                if self._append_sampled(entry, launched, sampled, rows):
                    touched[request.request_id] = request
            except Exception as exc:
                touched.pop(request.request_id, None)
                if request.request_id in self.requests:
                    failed.append(self._fail_request(request, exc))
        outputs = failed
        for request in touched.values():
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = time.monotonic()
            finished = request.finished
            if finished or not final_only:
                outputs.append(self._output(request))
            if finished:
                request.metrics.finished_time = time.monotonic()
                del self.requests[request.request_id]
        return outputs

    def _append_sampled(self, entry: ScheduledSeq, launched: LaunchedStep, sampled: SamplerOutput,
                        rows: range) -> bool:
        """Append one scheduled entry's sampled tokens; returns whether any sample got one."""
        seq = entry.seq
        request = seq.request
        if request.request_id in launched.prompt_logprobs:
            self._add_prompt_logprobs(request, launched.prompt_logprobs[request.request_id])
        # Before the sampled token is appended: a sample it finishes frees its blocks.
        self.block_manager.cache_full_blocks(seq)
        appended = False
        for s, r in zip(entry.sample_seqs, rows, strict=True):
            if s.is_finished:  # finished or aborted since the launch: the token is not wanted
                continue
            if s.num_stale:  # forced over since the launch (they arrive in launch order)
                s.num_stale -= 1
                continue
            s.num_pending -= 1
            if sampled.offsets is None:
                self._append_token(s, sampled.token_ids[r], sampled.logprobs[r])
            else:  # a speculative step: its accepted drafts and one more
                self._append_verified(s, entry, sampled, range(sampled.offsets[r], sampled.offsets[r + 1]))
            appended = True
        return appended

    def _append_verified(self, seq: Sequence, entry: ScheduledSeq, sampled: SamplerOutput, at: range) -> None:
        """A speculative step's tokens for one sample: its accepted drafts and the token after them, each through the
        stop checks (none is appended past a stop, eos or max_tokens); then its lookahead slots past them are free."""
        accepted = len(at) - 1
        known = len(seq.token_ids)
        for n, i in enumerate(at):
            self._append_token(seq, sampled.token_ids[i], sampled.logprobs[i])
            if seq.is_finished:  # a stop, eos or max_tokens: what came after was never emitted
                accepted = min(accepted, n + 1)
                break
            if sampled.token_ids[i] in self.force_after_token_ids:
                accepted = min(accepted, n + 1)  # the drafts after it are dropped: counted as rejected
                break
        if entry.draft_token_ids:
            self.spec_stats.observe(len(entry.draft_token_ids), accepted)
        if seq.is_finished:
            return
        if self.early_drafts and len(seq.token_ids) - known == len(at):
            self.proposer.confirm_early(seq.seq_id)  # its early drafts follow the tokens it has now
        # The KV of every token but the last is in the cache now; a rejected draft's slot is written over next step.
        seq.num_computed_tokens = len(seq.token_ids) - 1
        self.block_manager.trim(seq)

    def _append_token(self, seq: Sequence, token: int, logprobs) -> None:
        if seq.is_finished:
            return
        seq.token_ids.append(token)
        if seq.grammar is not None:  # raises if the grammar refuses it: this request fails alone
            seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens)
        self.num_generation_tokens += 1
        if logprobs is not None:
            self._add_logprobs(seq, token, logprobs)
        stop_string = seq.detokenizer.add_token(token)
        params = seq.params
        # Tokens known so far: pending ones come later and are dropped if this one finishes the sample.
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        if stop_string is not None:
            self._finish(seq, "stop", stop_string)
        elif n_out >= params.min_tokens and token in params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif n_out >= params.min_tokens and not params.ignore_eos and token in self.config.model.eos_token_ids:
            self._finish(seq, "stop", None)
        elif n_out >= seq.request.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.release(seq.seq_id)

    def _add_logprobs(self, seq: Sequence, token: int, logprobs) -> None:
        top_ids, top_values, chosen, rank = logprobs
        seq.logprobs.append(self._logprob_entry(token, chosen, rank, top_ids, top_values))
        seq.cumulative_logprob += chosen

    def _add_prompt_logprobs(self, request: Request, rows: list) -> None:
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]  # the first prompt token has nothing before it
        request.prompt_logprobs += [self._logprob_entry(*row) for row in rows]

    def _logprob_entry(self, token: int, logprob: float, rank: int, top_ids: list[int],
                       top_values: list[float]) -> dict[int, Logprob]:
        """The chosen token and the top-N, each with its logprob and rank."""
        entry = {token: Logprob(logprob, rank, self._decode_one(token))}
        for r, (tid, value) in enumerate(zip(top_ids, top_values, strict=True), start=1):
            entry.setdefault(tid, Logprob(value, r, self._decode_one(tid)))
        return entry

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else ""

    def _output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            finished = seq.status == SeqStatus.FINISHED
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.visible_text(finished),
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                # Copies: the caller may read them on another thread while the engine appends.
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished,
                             prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs else None,
                             num_cached_tokens=request.seqs[0].num_cached_tokens,
                             metrics=request.metrics, error=request.error)

    # -- tool use (chat_engine.py) ------------------------------------------------------------------
    def add_step_hook(self, hook: Callable[[list[RequestOutput]], list[RequestOutput]]) -> None:
        """Pass every step's outputs through `hook` before step() returns them. The tool loop forces a
        tool's output into a sample there: inside the step, so no later step can sample past the call."""
        self.step_hooks.append(hook)

    def force_tokens(self, request_id: str, index: int, token_ids: list[int]) -> RequestOutput:
        """Append `token_ids` to sample `index` of a running request as if it had generated them: the
        detokenizer, stop checks and max_tokens see them (forcing stops early if one finishes the sample).
        The scheduler computes them as a prefill chunk in the next step(s), and the token sampled after
        them continues the sample; the other samples are untouched. Returns the request's output."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"request_id: {request_id!r} is not running")
        if not 0 <= index < len(request.seqs) or request.seqs[index].is_finished:
            raise ValueError(f"index: sample {index} of {request_id!r} is not running")
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"token_ids: ids must be in [0, {vocab})")
        seq = request.seqs[index]
        # A token sampled after the call's last token is still in flight (async scheduling): the forced
        # tokens replace it. Its step did compute the KV of the token before it, which stays valid.
        seq.num_stale += seq.num_pending
        seq.num_pending = 0
        for token in token_ids:
            if seq.is_finished:
                break
            if seq.logprobs is not None:  # forced, so certain: logprob 0, rank 1, no alternatives
                seq.logprobs.append({token: Logprob(0.0, 1, self._decode_one(token))})
            self._append_token(seq, token, None)
        output = self._output(request)
        if request.finished:
            request.metrics.finished_time = time.monotonic()
            del self.requests[request_id]
        return output
