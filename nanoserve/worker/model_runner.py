"""ModelRunner: turns a scheduled batch into tensors, runs one forward pass, and samples."""

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.config import EngineConfig
from nanoserve.kernels.prefill import PrefillPlanner
from nanoserve.layers.attention import Attention, AttentionMetadata, TritonBackend, backend_for
from nanoserve.layers.sampler import SampledTokens, Sampler, SamplerOutput
from nanoserve.layers.step_plan import KernelPlanner
from nanoserve.model.loader import load_model
from nanoserve.utils import to_device
from nanoserve.worker.batch import ScheduledBatch
from nanoserve.worker.cuda_graphs import CUDAGraphRunner, PrefillGraphRunner, eager_tile_map
from nanoserve.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for


def chunk_slots(block_table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The KV cache slots of positions start .. start + n - 1 through the sequence's block table."""
    # Whole pages at once: a per-position Python loop cost ~0.6 ms of host time for an 8,192-token chunk.
    pages = np.asarray(block_table[start // block_size:(start + n - 1) // block_size + 1], dtype=np.int64)
    first = start % block_size
    assert len(pages) * block_size >= first + n, "the block table must cover the chunk"
    return (pages[:, None] * block_size + np.arange(block_size)).ravel()[first:first + n].tolist()


@dataclass
class LaunchedStep:
    """A step whose kernels are queued on the device; result() waits for its samples."""

    batch: ScheduledBatch
    sampled: SampledTokens | None  # on the device: the next step reads pending tokens from here
    rows: dict[int, int]  # seq_id -> row of sampled
    host: SampledTokens | None  # the same, being copied to the host
    done: torch.cuda.Event | None
    prompt_logprobs: dict

    def result(self) -> SamplerOutput:
        if self.host is None:
            return SamplerOutput([], [])
        if self.done is not None:
            self.done.synchronize()
        return self.host.result()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        self.block_size = config.args.block_size
        torch.manual_seed(config.args.seed)
        self.model = load_model(config)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            layer.backend = backend_for(self.device)
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
        self.num_kv_blocks = num_blocks_for(config, None if fixed_pool else self._free_memory())
        self.kv_cache = allocate_kv_cache(config, self.num_kv_blocks)
        self._bind_kv_cache(self.kv_cache)
        self.sampler = Sampler(self.device, config.model.eos_token_ids, config.args.seed)
        self.graphs = self.prefill_graphs = None
        if self.device.type == "cuda" and not config.args.enforce_eager:
            args = config.args
            max_blocks = -(-config.max_model_len // self.block_size)
            # Prefill graphs first: their largest bucket makes the memory pool every other graph shares.
            self.prefill_graphs = PrefillGraphRunner(self.model, args.max_num_batched_tokens, args.max_num_seqs,
                                                     max_blocks, self.device, self.planner)
            pool = self.prefill_graphs.capture()
            self.graphs = CUDAGraphRunner(self.model, min(args.max_num_seqs, 512), max_blocks, self.device,
                                          self.planner)
            self.graphs.capture(pool)
        if self.device.type == "cuda":
            self.warm_up_lm_head()

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

    def prepare(self, batch: ScheduledBatch, prev: LaunchedStep | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
        """input_ids, positions, attention metadata, and the hidden rows to sample from (None: every row,
        once). A token that `prev` sampled and the host has not read yet is taken from prev's device tensor."""
        input_ids, positions, slots, cu, lens, tables, logit_rows = [], [], [], [0], [], [], []
        pending_at, pending_rows = [], []
        bs = self.block_size
        for entry in batch.scheduled:
            seq, start, n = entry.seq, entry.start, entry.num_new_tokens
            table = seq.block_table
            if n == 1:  # a decode: the common case, without slices and ranges
                if start < len(seq.token_ids):
                    input_ids.append(seq.token_ids[start])
                else:  # sampled by the previous step, not read yet: it is taken on the device
                    assert prev is not None and seq.seq_id in prev.rows
                    pending_at.append(len(input_ids))
                    pending_rows.append(prev.rows[seq.seq_id])
                    input_ids.append(0)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                # Only a decode's one new token can still be on the device (async scheduling).
                assert start + n <= len(seq.token_ids)
                input_ids += seq.token_ids[start:start + n]
                positions += range(start, start + n)
                slots += chunk_slots(table, start, n, bs)
            cu.append(cu[-1] + n)
            lens.append(start + n)
            tables.append(table)
            if entry.sample_seqs:
                logit_rows += [cu[-1] - 1] * len(entry.sample_seqs)
        width = max(len(t) for t in tables)
        num_seqs, num_tokens = len(tables), len(input_ids)
        sample_all = logit_rows == list(range(num_tokens))  # every row samples once: no gather needed
        longs = input_ids + positions + slots + pending_at + pending_rows + ([] if sample_all else logit_rows)
        # One host-to-device copy for the whole step: the int64 values, then the int32 ones two to a slot, sliced
        # (and viewed as int32) into its tensors on the device. At batch 1 a step is ~1 ms of GPU work, and each
        # separate small copy (its pinned staging buffer, its copy call, the kernels that consumed it) sat on
        # the host's path and the stream's.
        # Through numpy: it converts a long list of Python ints ~3x faster than torch.as_tensor (1.3 vs 0.4 ms for
        # an 8,192-token step's 24,576 values on this 2-core CPU).
        num_ints = 2 * num_seqs + 1 + num_seqs * width  # cu_seqlens_q, seq_lens, block tables
        host = np.zeros(len(longs) + (num_ints + 1) // 2, dtype=np.int64)
        host[:len(longs)] = longs
        ints = host[len(longs):].view(np.int32)
        ints[:num_seqs + 1] = cu
        ints[num_seqs + 1:2 * num_seqs + 1] = lens
        block_tables = ints[2 * num_seqs + 1:num_ints].reshape(num_seqs, width)
        for row, table in zip(block_tables, tables, strict=True):
            row[:len(table)] = table
        dev = to_device(host, torch.int64, self.device)
        ids, pos, slot_mapping = dev[:num_tokens], dev[num_tokens:2 * num_tokens], dev[2 * num_tokens:3 * num_tokens]
        at, n_pending = 3 * num_tokens, len(pending_at)  # where pending_at, then pending_rows, then the rows start
        rows_d = dev[at + 2 * n_pending:len(longs)]
        ints = dev[len(longs):].view(torch.int32)[:num_ints]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            cu_seqlens_q=ints[:num_seqs + 1],
            seq_lens=ints[num_seqs + 1:2 * num_seqs + 1],
            block_tables=ints[2 * num_seqs + 1:].view(num_seqs, width),
            max_seqlen_q=max(e.num_new_tokens for e in batch.scheduled),
            num_decodes=batch.num_decodes,
            seq_lens_cpu=lens,
            cu_seqlens_q_cpu=cu,
        )
        if n_pending:
            ids[dev[at:at + n_pending]] = prev.sampled.token_ids[dev[at + n_pending:at + 2 * n_pending]]
        return ids, pos, meta, None if sample_all else rows_d

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step's forward pass and sampling on the device without waiting for them. Requests
        that asked for prompt_logprobs get them now, as {request_id: [(target id, logprob, rank,
        top ids, top logprobs), ...]} (that path reads back to the host)."""
        for src, dst in batch.block_copies:
            for k, v in self.kv_cache:
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])
        input_ids, positions, meta, logit_rows = self.prepare(batch, prev)
        num_seqs = len(batch.scheduled)
        if self.graphs is not None and self.graphs.can_run(num_seqs, meta.num_decodes):
            hidden = self.graphs.run(input_ids, positions, meta)
        elif self.prefill_graphs is not None and self.prefill_graphs.can_run(input_ids.shape[0], num_seqs):
            hidden = self.prefill_graphs.run(input_ids, positions, meta)
        else:
            # An eager step gets its plan here (a graph replays the one it was captured with).
            meta.plan = self.planner.plan(num_seqs, meta.num_decodes, input_ids.shape[0],
                                          triton=self.attn_layers[0].backend is TritonBackend)
            if self.planner.prefill is not None:
                eager_tile_map(meta, self.device, self.attn_layers[0].head_dim, self.planner.prefill)
            hidden = self.model(input_ids, positions, meta)
        prompt_logprobs = self._prompt_logprobs(batch, hidden, meta.cu_seqlens_q_cpu)
        seqs = [s for e in batch.scheduled for s in e.sample_seqs]
        if not seqs:
            return LaunchedStep(batch, None, {}, None, None, prompt_logprobs)
        logits = self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
        sampled = self.sampler.sample(logits, seqs)
        done = None
        if self.device.type == "cuda":
            host = sampled.to_host()
            done = torch.cuda.Event()
            done.record()
        else:
            host = sampled
        rows = {s.seq_id: i for i, s in enumerate(seqs)}
        return LaunchedStep(batch, sampled, rows, host, done, prompt_logprobs)

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor, cu: list[int]) -> dict:
        result = {}
        for i, entry in enumerate(batch.scheduled):
            seq, n = entry.seq, entry.seq.params.prompt_logprobs
            if n is None or seq.num_output_tokens or seq.index:
                continue
            # Row j predicts token start + j + 1; the prompt's last row predicts the first output.
            start = entry.start
            count = min(entry.num_new_tokens, seq.num_prompt_tokens - 1 - start)
            if count <= 0:
                continue
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[cu[i]:cu[i] + count]).float(), dim=-1)
            targets = torch.tensor(seq.token_ids[start + 1:start + 1 + count], device=self.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top = logprobs.topk(n, dim=1) if n else None
            result[seq.request.request_id] = [
                (t, lp, r, top.indices[j].tolist() if n else [], top.values[j].tolist() if n else [])
                for j, (t, lp, r) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                   strict=True))]
        return result
