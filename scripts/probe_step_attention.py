"""How fast decode attention reads K/V in the throughput recipe's own steps, against the whole step. Runs the recipe
(bench throughput's workload) until --decode-steps steps of all 256 sequences have run (there are about 100: the
shortest output is 100 tokens), then, on that step's inputs
as the decode graph holds them (the engine's KV pool, block tables and lengths), times in CUDA graphs:
- the batch-256 decode graph itself (a replay rewrites the step's new K/V in place: harmless);
- decode attention alone over the 28 layers' caches, longest first as the graph runs it;
- the same with each sequence's blocks renumbered to lie in order in a copy of the pool (what block allocation
  leaves behind versus a contiguous layout), and the copy rate of the pool.
GB/s count the K/V bytes read (the bound's count).

    python scripts/probe_step_attention.py --model shared/bench-configs/qwen3-0.6b [--decode-steps 50]
Ends with one JSON line.
"""

import argparse
import json

import torch
from bench_decode_attention import time_fn, time_graph

from nanoserve.bench import roofline
from nanoserve.bench.throughput import workload
from nanoserve.kernels.decode_attention import decode_attention
from nanoserve.kernels.decode_order import longest_first_order
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def measure(engine, bs: int) -> dict:
    runner = engine.runner
    graphs = runner.graphs
    seq_lens, tables = graphs.seq_lens[:bs].clone(), graphs.block_tables[:bs].clone()
    lens = seq_lens.tolist()
    cfg = engine.config.model
    kv_bytes = sum(lens) * roofline.kv_bytes_per_token(engine.config) // cfg.num_hidden_layers  # one layer
    q = torch.randn(bs, cfg.num_attention_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    order = longest_first_order(seq_lens, torch.empty(bs, dtype=torch.int64, device="cuda"))
    layers = runner.kv_cache
    scale = cfg.head_dim ** -0.5

    def attention(tables=tables, layers=layers):
        for k, v in layers:
            decode_attention(q, k, v, seq_lens, tables, scale, out=out, order=order)

    result = {"batch": bs, "mean_len": round(sum(lens) / bs, 1), "min_len": min(lens), "max_len": max(lens)}
    us = time_fn(attention, len(layers))
    result["attention_us"] = round(us, 2)
    result["attention_gb_s"] = round(kv_bytes / us / 1e3, 1)
    # The same keys with each sequence's blocks in order: copy them into a fresh pool laid out sequence by sequence.
    blocks = [-(-n // 16) for n in lens]
    in_order = torch.zeros_like(tables)
    at = 0
    for b, n in enumerate(blocks):
        in_order[b, :n] = torch.arange(at, at + n, dtype=torch.int32)
        at += n
    src = tables.long()
    rows = torch.cat([src[b, :n] for b, n in enumerate(blocks)])  # the old block of each new one, in order
    fresh = [(k[rows].contiguous(), v[rows].contiguous()) for k, v in layers[:4]]  # past L2; cycled over 28 calls
    cycled = [fresh[i % len(fresh)] for i in range(len(layers))]
    us = time_fn(lambda: attention(in_order, cycled), len(layers))
    result["in_order_gb_s"] = round(kv_bytes / us / 1e3, 1)
    result["copy_tb_s"] = round(roofline.measure_bandwidth(torch.device("cuda")) / 1e12, 3)
    # The whole step as the engine replays it.
    graph, _ = graphs.graphs[bs]
    result["step_graph_ms"] = round(time_graph(graph, 1) / 1e3, 3)
    result["attention_share"] = round(result["attention_us"] * len(layers) / 1e3 / result["step_graph_ms"], 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--decode-steps", type=int, nargs="+", default=[50])
    ns = p.parse_args()
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16")
    engine = llm.engine
    prompts, out_lens = workload(256, 100, 1024, 100, 1024, engine.config.model.vocab_size, 0)
    for i, (prompt, n) in enumerate(zip(prompts, out_lens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    rows, full_steps = [], 0
    targets = sorted(ns.decode_steps)
    while engine.has_unfinished_requests() and targets:
        engine.step(final_only=True)
        running = engine.scheduler.running
        if len(running) == 256 and all(s.num_computed_tokens >= s.num_prompt_tokens for s in running):
            full_steps += 1
            if full_steps == targets[0]:
                torch.cuda.synchronize()
                rows.append({"decode_steps": full_steps, **measure(engine, 256)})
                print(rows[-1], flush=True)
                targets.pop(0)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    print(json.dumps({"bench": "probe_step_attention", "rows": rows}))


if __name__ == "__main__":
    main()
