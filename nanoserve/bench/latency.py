"""Decode latency at a fixed batch (1 by default) and memory-bandwidth utilisation (MBU).

    nanoserve bench latency --model DIR [--batch-size 1] [--baseline hf]

DIR: a model directory; with only a config.json in it, the weights are random (--load-format dummy).

MBU = (weight bytes + the KV bytes a step reads) / time per step / measured copy bandwidth. With --batch-size B,
B prompts of random ids (distinct, so no prefix is shared) decode together, and ms_per_token is the time a step.
--profile: one more run of the batch, its decode steps under torch.profiler (bench/device_profile.py); the JSON
line gains the device time a step by kind (collective, attention, matmul, other) and the top kernels.
"""

import copy
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
from nanoserve.bench.device_profile import profile_steps
from nanoserve.bench.lengths import fit_lengths
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams

# On a model with a shorter context both are scaled down (bench/lengths.py).
RECIPE = {"input_len": 128, "output_len": 512}


def main(argv: list[str] | None = None) -> int:
    p = parser("latency", __doc__)
    p.add_argument("--input-len", type=at_least_one, default=None,
                   help="prompt length in tokens; None: 128, scaled down with --output-len where the model's "
                        "context is shorter than both")
    p.add_argument("--output-len", type=at_least_one, default=None,
                   help="tokens decoded per run (eos ignored); None: 512, as --input-len")
    p.add_argument("--batch-size", type=at_least_one, default=1, help="sequences decoding together")
    p.add_argument("--iters", type=int, default=3, help="timed runs (their median counts)")
    p.add_argument("--hf-output-len", type=int, default=64,
                   help="tokens the transformers baseline decodes (it is slow)")
    p.add_argument("--prompt-period", type=at_least_one, default=None,
                   help="prompts repeat a random stretch of this many tokens: a workload that copies its input, "
                        "for --speculative-config ngram on a model that goes on repeating (the bundled one does); "
                        "None: random ids throughout")
    p.add_argument("--draft-every-step", action="store_true",
                   help="with --speculative-config: every decoding step drafts its k tokens (ngram: the last "
                        "token repeated, in place of the lookup; a draft model drafts at every step anyway): on "
                        "random weights they are rejected, so ms_per_step is the cost of a verify step of k + 1 "
                        "tokens (and, with a draft model or an EAGLE-3 head, of its k draft passes, which "
                        "draft_ms_per_pass times alone)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, profile --profile-steps decode steps of one more run")
    p.add_argument("--profile-steps", type=at_least_one, default=32, help="decode steps profiled")
    p.add_argument("--profile-trace", default=None, metavar="FILE",
                   help="with --profile: write the Chrome trace there too (chrome://tracing, Perfetto)")
    ns = p.parse_args(argv)
    args = engine_args(ns)
    bw, _ = ceilings_at_start(args)
    llm = LLM(**vars(args))
    engine, cfg = llm.engine, llm.engine.config
    if ns.draft_every_step:
        if engine.proposer is None:
            p.error("--draft-every-step needs --speculative-config")
        if cfg.speculative.method == "ngram":
            engine.proposer = RepeatLastToken(cfg.speculative.num_speculative_tokens)
    fit_lengths(ns, RECIPE, lambda n: n["input_len"] + n["output_len"], cfg.max_model_len, "latency",
                floors={"output_len": 2})  # a decode step's time is the gap between two tokens
    rng = np.random.default_rng(ns.seed)
    period = ns.prompt_period or ns.input_len
    prompts = [np.resize(rng.integers(0, cfg.model.vocab_size, period), ns.input_len).tolist()
               for _ in range(ns.batch_size)]
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    proposals: list[float] = []  # seconds of each proposal of a draft model or EAGLE-3 head, timed runs only
    # Early drafts (--async-scheduling) are queued behind the verify step and read a step later: a proposal then has
    # no wall time of its own, and only the few made on the host would be timed. Synchronous steps (the default) time
    # them all.
    if cfg.speculative is not None and cfg.speculative.method != "ngram" and not engine.early_drafts:
        engine.proposer.propose = timed(engine.proposer.propose, proposals)
    per_token, per_step, generated = [], [], []
    spec_before = copy.deepcopy(engine.spec_stats)
    for it in range(ns.iters):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"lat-{it}-{i}", prompt, params)
        stamps, lengths = [], []
        while engine.has_unfinished_requests():
            if outs := engine.step():
                stamps.append(time.perf_counter())
                lengths.append(sum(len(o.outputs[0].token_ids) for o in outs) / len(outs))
                generated += [len(o.outputs[0].token_ids) for o in outs if o.finished]
        per_step.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))  # decode steps only
        # A speculative step emits several tokens a sequence: time per token is over the tokens, not the steps.
        per_token.append((stamps[-1] - stamps[0]) / (lengths[-1] - lengths[0]) if spec_before else per_step[-1])
    step_s = float(np.median(per_token))
    # What ran, not what was asked: the engine quietly caps a request's tokens at the room its context leaves.
    output_len = min(generated)
    result = {"bench": "latency", "model": cfg.model_dir, "batch_size": ns.batch_size, "input_len": ns.input_len,
              "output_len": output_len, "ms_per_token": round(step_s * 1e3, 3),
              "tok_s": round(ns.batch_size / step_s, 1), **engine_facts(cfg), **kv_facts(engine.runner),
              "cuda_graphs": engine.runner.graphs is not None, "tensor_parallel_size": cfg.args.tensor_parallel_size,
              "symm_all_reduce": engine.runner.tp.symm is not None}
    if spec_before is not None:
        spec = engine.spec_stats
        drafts = spec.num_drafts - spec_before.num_drafts
        accepted = spec.num_accepted_tokens - spec_before.num_accepted_tokens
        result |= {"speculative_config": cfg.args.speculative_config, "draft_every_step": ns.draft_every_step,
                   "early_drafts": engine.early_drafts,
                   "ms_per_step": round(float(np.median(per_step)) * 1e3, 3), "spec_num_drafts": drafts,
                   "spec_draft_tokens_per_draft": round((spec.num_draft_tokens - spec_before.num_draft_tokens)
                                                        / max(drafts, 1), 2),
                   "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0}
        if proposals:
            # A proposal is k passes of the draft (a catch-up on the tokens since the last, then k - 1 single-token
            # steps); on random weights nothing is accepted, so the catch-up is one token too.
            proposal_s = float(np.median(proposals))
            result |= {"draft_ms_per_proposal": round(proposal_s * 1e3, 3),
                       "draft_ms_per_pass": round(proposal_s * 1e3 / cfg.speculative.num_speculative_tokens, 3)}
    if bw is not None:
        avg_context = ns.input_len + output_len / 2
        step_bytes = roofline.weight_bytes(engine.runner.model).read_by(ns.batch_size) + (
            ns.batch_size * avg_context * roofline.kv_bytes_per_token(cfg))
        # Copy bandwidth counts read + write; a decode step mostly reads, so compare like with like.
        result |= {"bandwidth_tb_s": round(bw / 1e12, 2), "mbu": round(step_bytes / step_s / bw, 3),
                   "bound_tok_s": round(ns.batch_size * bw / step_bytes, 1)}
    if ns.profile:
        result |= profile_decode(engine, prompts, ns.profile_steps, ns.profile_trace)
    if ns.baseline == "hf":
        from nanoserve.bench.hf_baseline import hf_generate_seconds, hf_model

        del llm, engine
        free_device_memory()
        hf = hf_model(cfg.model_dir, cfg.dtype, cfg.device)
        hf_generate_seconds(hf, prompts, 4)  # warm-up
        t1 = hf_generate_seconds(hf, prompts, 1)
        tn = hf_generate_seconds(hf, prompts, ns.hf_output_len)
        hf_step = (tn - t1) / (ns.hf_output_len - 1)
        result |= {"hf_ms_per_token": round(hf_step * 1e3, 3), "speedup_vs_hf": round(hf_step / step_s, 2)}
    emit(result)
    return 0


def timed(propose, seconds: list[float]):
    """propose, appending the wall time of each call to `seconds` (the drafts come back to the host: it waits for
    the device)."""

    def run(rows, max_tokens):
        start = time.perf_counter()
        drafts = propose(rows, max_tokens)
        seconds.append(time.perf_counter() - start)
        return drafts

    return run


class RepeatLastToken:
    """A proposer (spec_decode/proposer.py) that drafts k copies of the last token at every step, whatever the
    tokens: a measurement's stand-in for a method whose drafts always come."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, rows, max_tokens) -> list[list[int]]:
        return [[row.token_ids[-1]] * min(self.k, cap) for row, cap in zip(rows, max_tokens, strict=True)]

    def release(self, seq_id: int) -> None:
        pass


def profile_decode(engine, prompts: list[list[int]], num_steps: int, trace: str | None) -> dict:
    """One more run of the batch: its prefill unprofiled, then num_steps decode steps under the profiler."""
    params = SamplingParams(temperature=0, max_tokens=num_steps + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    while engine.has_unfinished_requests() and not engine.step():  # until the prefill's first tokens
        pass
    result = profile_steps(engine.step, num_steps, engine.config.device, trace)
    while engine.has_unfinished_requests():
        engine.step()
    return result
