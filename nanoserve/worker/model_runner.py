"""ModelRunner: turns a scheduled batch into tensors, runs one forward pass, and samples."""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.group import TensorParallelGroup
from nanoserve.kernels.prefill import PrefillPlanner
from nanoserve.layers.attention import Attention, AttentionMetadata, TritonBackend, backend_for
from nanoserve.layers.sampler import AllowedTokens, SampledTokens, Sampler, SamplerOutput
from nanoserve.layers.step_plan import KernelPlanner
from nanoserve.model.loader import load_model
from nanoserve.spec_decode.rejection import VerifyStep, queue_verify
from nanoserve.worker.batch import ScheduledBatch
from nanoserve.worker.cuda_graphs import CUDAGraphRunner, PrefillGraphRunner, eager_tile_map
from nanoserve.worker.kv_cache import (
    allocate_kv_cache,
    bytes_per_block,
    kv_groups,
    num_blocks_for,
    num_cpu_blocks,
    pool_sizes,
)
from nanoserve.worker.kv_offload import KVOffloader
from nanoserve.worker.kv_ring import KVRing, LongContextAttention
from nanoserve.worker.step_inputs import NO_SAMPLES, StepInputs, prompt_logprob_rows

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose kernels are queued on the device; result() waits for its samples."""

    batch: ScheduledBatch
    sampled: SampledTokens | None  # on the device: the next step reads pending tokens from here
    rows: dict[int, int]  # seq_id -> row of sampled
    host: SampledTokens | None  # the same, being copied to the host
    done: torch.cuda.Event | None
    prompt_logprobs: dict
    deferred_sample: Callable[[], None] | None = None  # queues the sampling, deferred until its token masks are filled
    # A speculative verify step's tokens (spec_decode/rejection.py): queued on the device, read by result().
    verified: VerifyStep | None = None

    def settle(self) -> None:
        """Queue the deferred sampling, if any (it waits for the masks): before anything reads `sampled`."""
        if self.deferred_sample is not None:
            sample, self.deferred_sample = self.deferred_sample, None
            sample()

    def result(self) -> SamplerOutput:
        self.settle()
        if self.verified is not None:
            return self.verified.result()
        if self.host is None:
            return SamplerOutput([], [])
        if self.done is not None:
            self.done.synchronize()
        return self.host.result()


class OtherRanks(Protocol):
    """What rank 0's runner uses of the ranks it drives: worker/tp_worker.py's TensorParallelWorkers, which the
    engine starts and passes in (tp_worker.py runs a ModelRunner in every other rank: it imports this module)."""

    config: EngineConfig  # rank 0's: its device
    tp: TensorParallelGroup

    def check(self) -> None: ...
    def explain(self, exc: Exception) -> Exception: ...
    def stop(self, release_graphs: Callable[[], None]) -> None: ...


class ModelRunner:
    """Runs steps on one rank. Rank 0 (the engine's) packs each step, sends it to the other ranks under tensor
    parallelism, runs it and samples; the other ranks run what they receive (worker/tp_worker.py). Every rank
    makes the same collectives in the same order, from __init__ (profiling, graph capture) on."""

    def __init__(self, config: EngineConfig, tp: TensorParallelGroup | None = None,
                 workers: "OtherRanks | None" = None) -> None:
        """tp: this rank's group (a worker rank's); workers: rank 0's handle on the other ranks, already started."""
        self.workers = workers
        if workers is not None:
            config, tp = workers.config, workers.tp
        self.tp = tp or TensorParallelGroup()
        self.config = config
        self.device = config.device
        self.block_size = config.args.block_size
        torch.manual_seed(config.args.seed)
        self.model = load_model(config, self.tp)
        # EAGLE-3 (worker/eagle3.py): the target hands the head its hidden states at these layers, for every token
        # of every step (aux_hidden_sink, with the step: its slots and block copies); before any graph is captured,
        # so the graphs write them too.
        self.aux_hidden_sink: Callable[[StepInputs, torch.Tensor], None] | None = None
        if config.aux_hidden_state_layers:
            inner = getattr(self.model, "model", None)
            if not hasattr(inner, "capture_aux_hidden_states"):
                raise ValueError(f"speculative_config.method: eagle3 needs a Llama-family target, not "
                                 f"{config.model.architecture}")
            inner.capture_aux_hidden_states(config.aux_hidden_state_layers,
                                            max(config.args.max_num_batched_tokens, config.args.max_num_seqs))
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for index, layer in enumerate(self.attn_layers):
            layer.backend = backend_for(self.device)
            layer.layer_index = index
        # The one place that picks each step's kernels (layers/step_plan.py): graphs ask it once per shape, eager
        # steps once per step. Prefill attention's launches are planned for the model's heads and the device's SMs.
        attn = self.attn_layers[0]
        prefill = None
        if self.device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            prefill = PrefillPlanner(attn.num_heads, attn.num_kv_heads, num_sms)
        self.planner = KernelPlanner(config.args.fused_rope_decode, config.args.pdl,
                                     getattr(self.model, "qk_norm", False), self.device, prefill)
        fixed_pool = config.args.num_kv_blocks is not None
        free = None if fixed_pool else self._free_memory()
        self._size_pools(config, free, fixed_pool)
        self.kv_cache = allocate_kv_cache(config, self.num_kv_blocks, self.kv_groups, self.num_local_blocks)
        self._bind_kv_cache(self.kv_cache)
        self.num_cpu_blocks = num_cpu_blocks(config)
        self.offloader = KVOffloader(self.kv_cache, self.num_cpu_blocks) if self.num_cpu_blocks else None
        # Long-context mode's ring of device slots (outside the pool's budget: 2 x 32 MiB for Llama-3.1-8B).
        self.ring = KVRing(self.offloader, self.block_size) if self.offloader is not None else None
        self.sampler = Sampler(self.device, config.model.eos_token_ids, config.args.seed)
        self.speculative = config.speculative is not None
        # A draft model's distributions of its drafts, by seq_id (worker/draft_model.py; the engine sets it).
        self.draft_probs: Callable[[int], torch.Tensor | None] | None = None
        self.graphs = self.prefill_graphs = None
        if self.device.type == "cuda" and not config.args.enforce_eager:
            args = config.args
            max_blocks = -(-config.max_model_len // self.block_size)
            # Prefill graphs first: their largest bucket makes the memory pool every other graph shares.
            local = self.kv_groups is not None
            self.prefill_graphs = PrefillGraphRunner(self.model, args.max_num_batched_tokens, args.max_num_seqs,
                                                     max_blocks, self.device, self.planner, local)
            pool = self.prefill_graphs.capture()
            self.graphs = CUDAGraphRunner(self.model, min(args.max_num_seqs, 512), max_blocks, self.device,
                                          self.planner, local)
            self.graphs.capture(pool)
        if self.device.type == "cuda":
            self.warm_up_lm_head()

    def _size_pools(self, config: EngineConfig, free: int | None, fixed_pool: bool) -> None:
        """num_kv_blocks, and for sliding-window layers their own pool (kv_groups, num_local_blocks with its null
        block; worker/kv_cache.py; every layer's where all are windowed, the global pool then block ids only). Sized
        from the memory left (free), the pool for the window layers is dropped where it would be as large as the
        global one (max_num_seqs sequences' windows need that much): it would save nothing, and every step would
        build a second table. Every rank decides alike."""
        self.kv_groups = kv_groups(config, [layer.sliding_window for layer in self.attn_layers])
        self.num_local_blocks = 0
        if self.kv_groups is not None:
            self.num_kv_blocks, self.num_local_blocks = pool_sizes(config, free, self.kv_groups)
            saves = fixed_pool or self.num_local_blocks <= self.num_kv_blocks
            if not self.tp.all_reduce_min_host(int(saves)):
                logger.info("sliding-window layers: no pool of their own, since max_num_seqs=%d sequences' windows "
                            "would need as many blocks as the global layers' pool (fewer sequences: more tokens)",
                            config.args.max_num_seqs)
                self.kv_groups, self.num_local_blocks = None, 0
        if self.kv_groups is None:
            self.num_kv_blocks = num_blocks_for(config, free)
        if self.kv_groups is not None:
            for layer, local in zip(self.attn_layers, self.kv_groups.local, strict=True):
                layer.local = local
        if self.tp.size > 1:  # the block tables are the same on every rank: the smallest pool for all
            self.num_kv_blocks = int(self.tp.all_reduce_min_host(self.num_kv_blocks))
            self.num_local_blocks = int(self.tp.all_reduce_min_host(self.num_local_blocks))

    @torch.inference_mode()
    def warm_up_lm_head(self) -> None:
        """Run the LM head once at every row count a step can sample (1 .. max_num_seqs).

        It runs outside the CUDA graphs, and cuBLAS picks its kernel by row count, which changes from step to step
        while prompts are admitted and as a batch drains. The first call at a new row count costs the host ~0.2 ms
        and up to tens of ms (an H100: mostly cuBLAS's per-shape work, lazy kernel loading the rest), during which
        the GPU can run dry; in the throughput recipe that was 0.06 s of GPU idle and a 2 % longer run
        (H100; probes at 275aa23). Paying it here keeps it out of serving.
        """
        cfg = self.config
        rows = torch.zeros(cfg.args.max_num_seqs, cfg.model.hidden_size, dtype=cfg.dtype, device=self.device)
        for n in range(1, rows.shape[0] + 1):
            self.model.compute_logits(rows[:n])
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _bind_kv_cache(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.attn_layers, kv_cache, strict=True):
            layer.k_cache, layer.v_cache = k, v

    def _free_memory(self) -> int | None:
        """Bytes left for the KV pool: the budget, less what weights and a worst-case step use."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        peak = self._profile_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        # Everything already on the device (weights, context, other processes) plus the activation
        # peak of the largest step must fit in the budget alongside the pool.
        return int(total * self.config.args.gpu_memory_utilization) - (total - free) - (peak - weights)

    @torch.inference_mode()
    def _profile_peak(self) -> int:
        """Peak memory of one forward pass over max_num_batched_tokens prompt tokens."""
        cfg, args = self.config, self.config.args
        num_tokens = args.max_num_batched_tokens
        seq_len = min(num_tokens, cfg.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = allocate_kv_cache(cfg, blocks_per_seq)  # every sequence writes the same pages
        self._bind_kv_cache(scratch)
        torch.cuda.reset_peak_memory_stats()
        cu = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.cat([torch.arange(n, device=self.device) for n in lens]),
            cu_seqlens_q=cu, seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks_per_seq, dtype=torch.int32, device=self.device).repeat(len(lens), 1),
            max_seqlen_q=seq_len, num_decodes=0)
        ids = torch.randint(0, cfg.model.vocab_size, (num_tokens,), device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, meta)
        self.model.compute_logits(hidden[:min(args.max_num_seqs, num_tokens)])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del scratch, hidden
        self._bind_kv_cache([(None, None)] * len(self.attn_layers))
        torch.cuda.empty_cache()
        return peak - blocks_per_seq * bytes_per_block(cfg)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None,
               logit_masks: Callable[[list, LaunchedStep | None], AllowedTokens | None] | None = None) -> LaunchedStep:
        """Queue one step's forward pass and sampling on the device without waiting for them. Requests
        that asked for prompt_logprobs get them now, as {request_id: [(target id, logprob, rank,
        top ids, top logprobs), ...]} (that path reads back to the host)."""
        plp_entries, plp_rows, row = [], [], 0
        for entry in batch.scheduled:
            if entry.seq.params.prompt_logprobs is not None and (count := prompt_logprob_rows(entry)):
                plp_entries.append((entry, count))
                plp_rows.append((row, count))
            row += entry.num_new_tokens
        step = StepInputs.build(batch, prev.rows if prev is not None else {}, self.block_size, plp_rows,
                                local=self.kv_groups is not None)
        # Only now, with this step's inputs built, does the previous step's deferred sampling wait for its masks.
        if prev is not None:
            prev.settle()
        if self.workers is not None:
            # Before the mask thread is handed a step: it waits for the previous step's samples, which a lost rank
            # may never let the device finish, and the manager's shutdown waits for it.
            self.workers.check()
        seqs = [s for e in batch.scheduled for s in e.sample_seqs]
        # Speculative decoding: each sample's drafts (a verify entry has one sample), when the step has any.
        drafts = draft_probs = None
        if self.speculative and any(e.draft_token_ids for e in batch.scheduled):
            drafts = [e.draft_token_ids for e in batch.scheduled for _ in e.sample_seqs]
            if self.draft_probs is not None:
                draft_probs = [self.draft_probs(s.seq_id) if d else None for s, d in zip(seqs, drafts, strict=True)]
        # Structured output's token masks: a thread steps the grammars over the previous step's tokens (once its
        # sampling, just queued, is done) and fills the masks, while this thread queues the forward pass and goes on
        # to the previous step's outputs and the next step's inputs. This step's sampling waits for them: it is
        # queued when the next step launches (or when this step's result is read), before that step's forward.
        masks = logit_masks(seqs, prev) if logit_masks is not None and seqs else None
        prev_tokens = prev.sampled.token_ids if prev is not None and prev.sampled is not None else None
        # Under tensor parallelism the other ranks need this step's samples (a later step's pending tokens): they
        # draw them themselves where the batch allows (Sampler.replicable), with no collective; else rank 0
        # broadcasts them. Not the tokens in the next step's message: rank 0 sends that before this step's samples
        # reach its host (async scheduling), and waiting for them would put the host back on the device's path.
        if self.workers is not None and drafts is not None:
            step.replica_call = NO_SAMPLES
        elif self.workers is not None and self.sampler.replicable(seqs, masks):
            step.replica_call = self.sampler.num_calls + 1 if self.sampler.fused else 0
            step.temperatures = [s.params.temperature for s in seqs] if self.sampler.fused else []
        if self.workers is None:
            plp_logits, logits = self.execute(step, prev_tokens)
        else:
            try:
                step.send(self.tp)
                plp_logits, logits = self.execute(step, prev_tokens)
            except RuntimeError as exc:
                raise self.workers.explain(exc) from exc
        if self.aux_hidden_sink is not None:  # before the next step's pass writes over them
            self.aux_hidden_sink(step, self.model.model.aux_hidden[:step.num_tokens])
        prompt_logprobs = self._prompt_logprobs(plp_entries, plp_logits)
        if not seqs:
            return LaunchedStep(batch, None, {}, None, None, prompt_logprobs)
        launched = LaunchedStep(batch, None, {s.seq_id: i for i, s in enumerate(seqs)}, None, None, prompt_logprobs)

        def sample() -> None:
            if drafts is not None:  # read by result(); a draft proposer may draft from it on the device first
                launched.verified = queue_verify(self.sampler, logits, seqs, drafts, masks, draft_probs)
                return
            sampled = self.sampler.sample(logits, seqs, masks)
            assert step.replica_call <= 0 or self.sampler.num_calls == step.replica_call, "the ranks' keys differ"
            if self.workers is not None and step.replica_call < 0:  # the other ranks take pending tokens from them
                try:
                    self.tp.broadcast(sampled.token_ids)
                except RuntimeError as exc:
                    raise self.workers.explain(exc) from exc
            launched.sampled, launched.host = sampled, sampled
            if self.device.type == "cuda":
                launched.host = sampled.to_host()
                launched.done = torch.cuda.Event()
                launched.done.record()

        # Not deferred under tensor parallelism: the other ranks would wait for the samples in a collective, where
        # a stop message could not reach them.
        # Nor when a row's sampling reads its history (min_tokens, penalties): that moves as this thread appends.
        if masks is not None and self.workers is None and \
                not any(s.params.min_tokens or s.params.has_penalties for s in seqs):
            launched.deferred_sample = sample
        else:
            sample()
        return launched

    def execute(self, step: StepInputs, prev_tokens: torch.Tensor | None,
                ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Run one step on this rank: the logits of each prompt-logprob range, and of the rows that sample (None
        when none does)."""
        hidden, logit_rows = self.forward(step, prev_tokens)
        plp_logits = [self.model.compute_logits(hidden[start:start + n]) for start, n in step.prompt_logprob_rows]
        if not step.sample:
            return plp_logits, None
        return plp_logits, self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])

    def forward(self, step: StepInputs, prev_tokens: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward pass over one step: its hidden states (a CUDA graph's output buffer, valid until the
        next pass) and the rows that sample (None: every row, once)."""
        if step.kv_swap_out:  # first: a block going to the CPU tier may be the target of a copy below
            self.offloader.swap(step.kv_swap_out, [])
        local = self.kv_groups.local if self.kv_groups is not None else [False] * len(self.kv_cache)
        for copies, group in ((step.block_copies, False), (step.local_block_copies, True)):
            for src, dst in copies:
                for (k, v), is_local in zip(self.kv_cache, local, strict=True):
                    if is_local == group:
                        k[dst].copy_(k[src])
                        v[dst].copy_(v[src])
        if step.kv_swap_in:
            self.offloader.swap([], step.kv_swap_in)
        input_ids, positions, meta, logit_rows = step.to_device(self.device, prev_tokens)
        if step.long_context:  # streams KV through the ring layer by layer: eager
            meta.long_context = LongContextAttention(self.ring, step.long_context, self.block_size)
        return self.run_model(input_ids, positions, meta), logit_rows

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model over inputs already on the device, in a decode or prefill graph where one fits, else eagerly:
        its hidden states (a graph's output buffer, valid until the next pass). A draft proposer's single-token
        passes come here directly, with inputs it built on the device (worker/draft_model.py)."""
        num_seqs = meta.seq_lens.shape[0]
        if meta.long_context is None and self.graphs is not None and self.graphs.can_run(num_seqs, meta.num_decodes):
            hidden = self.graphs.run(input_ids, positions, meta)
        # A prefill graph's split map is made from the host's lengths: a draft's passes built on the device have
        # none (decodes only, past the decode graphs' 512 sequences), and run eagerly.
        elif meta.long_context is None and self.prefill_graphs is not None and meta.seq_lens_cpu is not None and \
                self.prefill_graphs.can_run(input_ids.shape[0], num_seqs):
            hidden = self.prefill_graphs.run(input_ids, positions, meta)
        else:
            # An eager step gets its plan here (a graph replays the one it was captured with).
            meta.plan = self.planner.plan(num_seqs, meta.num_decodes, input_ids.shape[0],
                                          triton=self.attn_layers[0].backend is TritonBackend,
                                          long_context=meta.long_context is not None)
            if self.planner.prefill is not None:
                eager_tile_map(meta, self.device, self.attn_layers[0].head_dim, self.planner.prefill)
            hidden = self.model(input_ids, positions, meta)
        return hidden

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.stop(self.release_graphs)
            self.workers = None

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs (the runner steps eagerly after this). Every rank must, before NCCL's destroy of
        the group: NCCL waits in it until no graph that captured one of its collectives is left, so on two H100s
        each rank's destroy_process_group waited forever (py-spy, 27a2a45)."""
        for graphs in (self.prefill_graphs, self.graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.prefill_graphs = None

    def _prompt_logprobs(self, entries: list, logits: list[torch.Tensor]) -> dict:
        result = {}
        for (entry, count), step_logits in zip(entries, logits, strict=True):
            seq, n = entry.seq, entry.seq.params.prompt_logprobs
            # Row j predicts token start + j + 1; the prompt's last row predicts the first output.
            logprobs = torch.log_softmax(step_logits.float(), dim=-1)
            targets = torch.tensor(seq.token_ids[entry.start + 1:entry.start + 1 + count], device=self.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top = logprobs.topk(n, dim=1) if n else None
            result[seq.request.request_id] = [
                (t, lp, r, top.indices[j].tolist() if n else [], top.values[j].tolist() if n else [])
                for j, (t, lp, r) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                   strict=True))]
        return result
