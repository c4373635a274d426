"""Offline throughput (the nano-vllm recipe) against the roofline bound measured in the same run.

    nanoserve bench throughput --model DIR [--baseline hf] [--json-schema FILE]

DIR: a model directory; with only a config.json in it, the weights are random (--load-format dummy).
--json-schema FILE: the same recipe again with every request constrained by that JSON schema (structured output),
reported beside the unconstrained run of the same call: its tok/s, the ratio, the host's mask time per step, and how
long of it the engine's thread waited for (the masks are filled beside it: structured/manager.py).
It needs a tokenizer (--tokenizer DIR for a config-only model directory). eos stays ignored, so both runs generate
the same number of tokens: once a sample's object is complete its grammar allows only eos, which it then repeats
(`grammar_open_fraction`: the share of tokens generated while the grammar was still open).
"""

import json
import time

import numpy as np

from nanoserve.args import at_least_one
from nanoserve.bench import roofline
from nanoserve.bench.common import (
    ceilings_at_start,
    emit,
    engine_args,
    engine_facts,
    free_device_memory,
    kv_facts,
    parser,
)
from nanoserve.bench.lengths import fit_lengths, flag
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.manager import MaskStats
from nanoserve.structured.params import StructuredOutputs

# nano-vllm's recipe; on a model with a shorter context both ranges are scaled down (bench/lengths.py).
RECIPE = {"input_len": [100, 1024], "output_len": [100, 1024]}


def workload(num: int, lo_in: int, hi_in: int, lo_out: int, hi_out: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(lo_in, hi_in + 1, num)
    out_lens = rng.integers(lo_out, hi_out + 1, num)
    prompts = [rng.integers(0, vocab, n).tolist() for n in in_lens]
    return prompts, out_lens.tolist()


def main(argv: list[str] | None = None) -> int:
    p = parser("throughput", __doc__)
    p.add_argument("--num-prompts", type=int, default=256, help="requests, all submitted at once")
    p.add_argument("--input-len", type=at_least_one, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX]; None: 100 1024, scaled down with --output-len "
                        "where the model's context is shorter than both MAXes")
    p.add_argument("--output-len", type=at_least_one, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="output lengths (eos ignored), uniform in [MIN, MAX]; None: 100 1024, as --input-len")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run every request constrained by this JSON schema; None: unconstrained only")
    ns = p.parse_args(argv)
    constraint = None
    if ns.json_schema is not None:
        with open(ns.json_schema) as f:
            constraint = StructuredOutputs(json=json.load(f))
    args = engine_args(ns)
    bw, flops = ceilings_at_start(args, matmul=True)
    llm = LLM(**vars(args))
    cfg = llm.engine.config
    fit_lengths(ns, RECIPE, lambda n: n["input_len"][1] + n["output_len"][1], cfg.max_model_len, "throughput")
    for name in RECIPE:
        low, high = getattr(ns, name)
        if low > high:
            raise ValueError(f"{flag(name)}: MIN {low} is over MAX {high}")
    prompts, out_lens = workload(ns.num_prompts, *ns.input_len, *ns.output_len, cfg.model.vocab_size, ns.seed)
    params = [SamplingParams(temperature=ns.temperature, ignore_eos=True, max_tokens=n, seed=None)
              for n in out_lens]
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    result = {"bench": "throughput", "model": cfg.model_dir, "num_prompts": len(prompts), "wall_s": round(wall, 2),
              "output_tok_s": round(n_out / wall, 1), "total_tok_s": round((n_out + n_in) / wall, 1),
              "output_tokens": n_out, "prompt_tokens": n_in, "input_len": ns.input_len,
              "output_len": ns.output_len, **engine_facts(cfg),
              "tensor_parallel_size": cfg.args.tensor_parallel_size,
              "symm_all_reduce": llm.engine.runner.tp.symm is not None,  # small all-reduces off NCCL (TP on GPUs)
              # What the KV pool held: a pool that fits few sequences (a 70B shape on two cards) keeps the batch
              # small and the figure far under the bound, which assumes every request decodes together.
              "num_kv_blocks": llm.engine.runner.num_kv_blocks,
              **kv_facts(llm.engine.runner),  # what fits (kv_cache_dtype, and the window layers' own pool)
              "preemptions": llm.engine.scheduler.num_preemptions}
    if bw is not None:
        model = llm.engine.runner.model
        bound = roofline.decode_bound_seconds([len(p) for p in prompts], out_lens, roofline.weight_bytes(model),
                                              roofline.kv_bytes_per_token(cfg), bw)
        bound += roofline.prefill_bound_seconds(n_in, roofline.model_params(model), flops)
        del model  # it holds the KV pool through its attention layers
        result |= {"bandwidth_tb_s": round(bw / 1e12, 2), "matmul_tflop_s": round(flops / 1e12, 1),
                   "bound_output_tok_s": round(n_out / bound, 1), "fraction_of_bound": round(bound / wall, 3)}
    if ns.baseline == "hf":
        from nanoserve.bench.hf_baseline import hf_generate_seconds, hf_model

        del llm, outs
        free_device_memory()
        hf = hf_model(cfg.model_dir, cfg.dtype, cfg.device)
        # One batch of every prompt, run to the longest output; only the requested tokens count.
        hf_s = hf_generate_seconds(hf, prompts, max(out_lens))
        result |= {"hf_output_tok_s": round(n_out / hf_s, 1), "hf_wall_s": round(hf_s, 2),
                   "speedup_vs_hf": round(hf_s / wall, 2)}
    if constraint is not None:
        result |= structured_run(llm, prompts, params, constraint, ns.json_schema, result["output_tok_s"])
    emit(result)
    return 0


def structured_run(llm: LLM, prompts: list, params: list[SamplingParams], constraint: StructuredOutputs,
                   path: str, plain_tok_s: float) -> dict:
    """The same workload with every request under `constraint`, after a warm-up that compiles the grammar."""
    constrained = [SamplingParams(**{**vars(p), "structured_outputs": constraint}) for p in params]
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True, structured_outputs=constraint),
                 use_tqdm=False)
    stats = llm.engine.structured.stats = MaskStats()
    start = time.perf_counter()
    outs = llm.generate(prompts, constrained)
    wall = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    eos = set(llm.engine.config.model.eos_token_ids)
    # A sample's grammar is open until its first eos (after that it allows only eos).
    open_tokens = sum(next((i for i, t in enumerate(o.outputs[0].token_ids) if t in eos),
                           len(o.outputs[0].token_ids)) for o in outs)
    valid = sum(_parses(o.outputs[0].text) for o in outs)
    tok_s = n_out / wall
    return {"json_schema": path, "structured_wall_s": round(wall, 2), "structured_output_tok_s": round(tok_s, 1),
            "structured_vs_plain": round(tok_s / plain_tok_s, 3), "mask_ms_per_step": round(stats.ms_per_step, 3),
            "mask_wait_ms_per_step": round(stats.per_step(stats.waited), 3),
            "mask_rows_per_step": round(stats.rows / max(stats.steps, 1), 1),
            "grammar_open_fraction": round(open_tokens / max(n_out, 1), 3), "structured_valid_json": valid}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
