"""Two-batch overlap for large decode steps, measured: the batch as two halves, one half's attention running while
the other half's projections and small kernels run, against the one-batch step. (GPU only.)

A large decode step is mostly decode attention, which streams the KV cache near the memory's limit; the rest of a
layer (four GEMMs, norms, rotary, SiLU) barely touches memory but runs as a chain of short kernels in series with
attention. Here each half runs its chain on a stream of its own and attention runs on the calling stream, half
after half, so every attention launch has the other half's chain beside it:

    calling stream:  attn(A, 0)  attn(B, 0)     attn(A, 1)     attn(B, 1) ...
    stream A:        pre(A, 0)   post(A, 0) pre(A, 1)     post(A, 1) ...
    stream B:        pre(B, 0)   .......... post(B, 0) pre(B, 1) ...

The half streams have the greatest priority, so a chain's kernel gets SMs as attention's programs free them (graph
capture keeps each kernel's stream priority and PyTorch instantiates graphs to honour it); a variant gives them
the least, one forces one attention split per half, one runs the halves in series on one stream.

Measured on an H100 (2026-11-23, aad7075 + this script; contexts uniform in 200-1600): two halves were slower at
every batch size, 6-7 % at 128-256 and 13-14 % at 64-96. Run in series on one stream the halves cost 13-41 %
more than one batch: at half the rows the GEMMs and small kernels take about as long as at all of them, so the
chain is paid twice, and the overlap wins back only about half of one chain. The streams' priority made no
difference (the variant with the least priority timed the same, within 0.4 %). Wired into the decode graphs from
batch 64 on, it made the throughput recipe's run 7.86 s against 7.40 s (75.0 against 79.8 % of the bound, one
call). It is not in the engine.

Each batch size gets sequences in blocks scattered over the pool and a KV cache of random values; every variant is
captured in a CUDA graph over the engine's own model and replayed in turn (--rounds rounds of --iters replays,
interleaved so that drift hits all alike); medians in ms a step. Every variant's hidden states are compared with
the one-batch graph's: max abs difference, and how many rows' LM-head argmax agree. (Measured: where one attention
split per half matches the one-batch step's split count, at 192 and 256, the hidden states were identical; with
two splits they differed by up to 0.17, and the argmax of 4-10 % of the rows with them.) The last line is one JSON
object.

    python scripts/probe_two_batch.py --model shared/bench-configs/qwen3-0.6b
"""

import argparse
import contextlib
import json
from unittest import mock

import numpy as np
import torch
from torch import nn

from nanoserve.kernels import decode_attention
from nanoserve.layers.attention import AttentionMetadata
from nanoserve.llm import LLM


def decode_rows(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """The metadata of sequences start .. end - 1 of an all-decode step (views, no copies)."""
    assert meta.num_decodes == meta.seq_lens.shape[0] and meta.decode_counters is None
    # A decode step's cu_seqlens_q is 0, 1, .., B: its first end - start + 1 entries serve any run of rows.
    return AttentionMetadata(meta.slot_mapping[start:end], meta.cu_seqlens_q[:end - start + 1],
                             meta.seq_lens[start:end], meta.block_tables[start:end], max_seqlen_q=1,
                             num_decodes=end - start)


class TwoBatchStreams:
    """The two high-priority streams the halves' chains run on (created once; a capture reuses them)."""

    def __init__(self, device: torch.device) -> None:
        # The stream priority range is (least, greatest); greater priority is the lower number.
        _, greatest = torch.cuda.Stream.priority_range()
        self.streams = tuple(torch.cuda.Stream(device, priority=greatest) for _ in range(2))


def two_batch_decode(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     streams: TwoBatchStreams | None) -> torch.Tensor:
    """The hidden states of a decode step ([B, hidden]) computed as two halves; `model` is a LlamaModel.
    With streams None everything runs on the current stream, half after half."""
    n = input_ids.shape[0]
    half = n // 2
    rows = ((0, half), (half, n))
    metas = [decode_rows(meta, a, b) for a, b in rows]
    pos = [positions[a:b] for a, b in rows]
    hidden = model.embed_tokens(input_ids)
    xs = [hidden[a:b] for a, b in rows]
    res: list[torch.Tensor | None] = [None, None]
    q: list[torch.Tensor | None] = [None, None]
    main = torch.cuda.current_stream() if streams is not None else None
    side = streams.streams if streams is not None else (None, None)

    def on(i: int):
        return torch.cuda.stream(side[i]) if streams is not None else contextlib.nullcontext()

    def handed_over(t: torch.Tensor, consumer) -> torch.Tensor:
        # A tensor made on one stream and read on another must not be reused by its maker's next allocation
        # while the reader runs: record_stream makes the allocator hold its memory (to the end of a capture).
        if consumer is not None:
            t.record_stream(consumer)
        return t

    ready = [None, None]  # per half: its queries and K/V are ready for attention
    for i in (0, 1):
        if streams is not None:
            side[i].wait_stream(main)
            handed_over(hidden, side[i])
        with on(i):
            q[i], res[i] = model.layers[0].before_attention(pos[i], xs[i], res[i], metas[i])
            ready[i] = _record(side[i])
    for layer_idx, layer in enumerate(model.layers):
        nxt = model.layers[layer_idx + 1] if layer_idx + 1 < len(model.layers) else None
        for i in (0, 1):
            if streams is not None:
                main.wait_event(ready[i])
            out = handed_over(layer.self_attn.attn.attend(handed_over(q[i], main), metas[i]), side[i])
            done = _record(main)
            with on(i):
                if streams is not None:
                    side[i].wait_event(done)
                xs[i], res[i] = layer.after_attention(out, res[i])
                if nxt is not None:
                    q[i], res[i] = nxt.before_attention(pos[i], xs[i], res[i], metas[i])
                    ready[i] = _record(side[i])
                else:
                    xs[i], _ = model.norm(xs[i], res[i])
    if streams is not None:
        for s in side:
            main.wait_stream(s)
        for x in xs:
            handed_over(x, main)
    return torch.cat(xs)


def _record(stream) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def step_inputs(batch: int, lo: int, hi: int, num_blocks: int, block_size: int, vocab: int, rng, device):
    lens = rng.integers(lo, hi + 1, batch)
    width = int(-(-hi // block_size))
    blocks = rng.permutation(num_blocks)[:batch * width].reshape(batch, width)
    pos = lens - 1
    slots = blocks[np.arange(batch), pos // block_size] * block_size + pos % block_size
    t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=device)  # noqa: E731
    meta = AttentionMetadata(t(slots, torch.int64), torch.arange(batch + 1, dtype=torch.int32, device=device),
                             t(lens, torch.int32), t(blocks, torch.int32), max_seqlen_q=1, num_decodes=batch)
    return t(rng.integers(0, vocab, batch), torch.int64), t(pos, torch.int64), meta


def probe_engine(model: str):
    """The engine's runner and config for a probe: dummy bf16 weights, eager (the probe captures its own graphs), and
    a KV pool of random values (never zeros)."""
    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", enforce_eager=True)
    runner = llm.engine.runner
    for k, v in runner.kv_cache:
        k.normal_()
        v.normal_()
    return runner, llm.engine.config


def capture_step(fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn() warmed up (compiles, settles allocations), captured, replayed once; the graph and a copy of its output."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out.clone()


def replay_ms(graphs: dict, rounds: int, iters: int) -> dict[str, float]:
    """Median ms a replay of each graph, over `rounds` rounds of `iters` replays that visit the graphs in turn."""
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, g in graphs.items():
            start.record()
            for _ in range(iters):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / iters)
    return {n: round(float(np.median(t)), 4) for n, t in times.items()}


def against(model: nn.Module, outs: dict, ref: str) -> dict:
    """Each output's max abs difference from outs[ref], and the rows whose LM-head argmax agrees with its."""
    want, top = outs[ref].float(), model.compute_logits(outs[ref]).argmax(-1)
    return {"max_abs_diff": {n: float((o.float() - want).abs().max()) for n, o in outs.items()},
            "argmax_agree": {n: int((model.compute_logits(o).argmax(-1) == top).sum()) for n, o in outs.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="256,192,128,96,64")
    p.add_argument("--context", type=int, nargs=2, default=[200, 1600])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args()
    runner, cfg = probe_engine(ns.model)
    device = cfg.device
    model = runner.model
    rng = np.random.default_rng(0)
    streams = TwoBatchStreams(device)
    _, least = torch.cuda.Stream.priority_range()
    same_priority = TwoBatchStreams(device)
    same_priority.streams = tuple(torch.cuda.Stream(device, priority=least) for _ in range(2))
    one_split = mock.patch.object(decode_attention, "default_num_splits", lambda *a: 1)
    variants = {
        "one_batch": (lambda a: model(*a), None),
        "two_batch": (lambda a: two_batch_decode(model.model, *a, streams), None),
        "two_batch_one_split": (lambda a: two_batch_decode(model.model, *a, streams), one_split),
        "two_batch_same_priority": (lambda a: two_batch_decode(model.model, *a, same_priority), None),
        "two_batch_no_streams": (lambda a: two_batch_decode(model.model, *a, None), None),
    }
    results = []
    with torch.inference_mode():
        for batch in (int(b) for b in ns.batches.split(",")):
            args = step_inputs(batch, *ns.context, runner.num_kv_blocks, runner.block_size, cfg.model.vocab_size,
                               rng, device)
            graphs, outs = {}, {}
            for name, (fn, patch) in variants.items():
                with patch or contextlib.nullcontext():
                    graphs[name], outs[name] = capture_step(lambda fn=fn, a=args: fn(a))
            row = {"batch": batch, "ms": replay_ms(graphs, ns.rounds, ns.iters)}
            row["gain_vs_one_batch"] = {n: round(1 - row["ms"][n] / row["ms"]["one_batch"], 4) for n in graphs}
            row |= against(runner.model, outs, "one_batch")
            print(json.dumps(row), flush=True)
            results.append(row)
            del graphs, outs
            torch.cuda.empty_cache()
    print(json.dumps({"script": "probe_two_batch", "gpu": torch.cuda.get_device_name(), "results": results}))


if __name__ == "__main__":
    main()
