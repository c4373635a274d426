"""Where the GPU waits for the host in the throughput recipe, and where the host was meanwhile.

Runs `bench throughput`'s workload with light instruments instead of a profiler (which slows the host and so
moves the very gaps it should measure):
- On the device, a CUDA event before each step's first kernel (its input copies) and one after its last (the
  samples' copy to the host). The time between one step's last event and the next step's first is what the GPU
  sat idle between them: about zero when the host queued the next step in time.
- Each step's bound as bench throughput counts the run (its decodes' weights and K/V at the copy rate, its
  prompt tokens at the matmul rate, both measured at the start): gpu - bound, by group, is where the run loses
  to the roofline.
- On the host, each phase's time: schedule; the launch's prepare (inputs and their copies), forward (graph replay
  or eager model), LM head, sampler and copy to host; then processing the previous step, split into the wait for
  its samples and the work after.
A launch phase that takes milliseconds of host time is one the host was blocked in (a launch that waits for
room on the device, an allocation that synchronizes), not one that worked that long.

    python scripts/step_bubbles.py --model shared/bench-configs/qwen3-0.6b [--no-lm-head-warm-up | --pageable-copies]
        [--decode-options '{"BLOCK_N": 128, "num_stages": 3}'] [--decode-splits 1] [--decode-options-min-batch 129]
--no-lm-head-warm-up skips ModelRunner.warm_up_lm_head (the LM head run at every row count at start), to see
what the first call at each new row count costs during the run. --pageable-copies makes pin_memory() a no-op, so
the step inputs' copies go from pageable memory, as before nanoserve.utils.to_device pinned them.
--decode-options tries a decode attention launch configuration in the whole run (scripts/sweep_decode_config.py
times one in isolation). Without CUDA
(a smoke test: --model nanoserve's bundled model with --num-prompts 8 --max-len 64) the device columns are
empty. Ends with one JSON line.
"""

import argparse
import json
import time
from collections import defaultdict
from functools import wraps

import numpy as np
import torch

from nanoserve.bench import roofline
from nanoserve.bench.throughput import workload
from nanoserve.kernels import decode_attention, decode_rope_attention
from nanoserve.layers.sampler import SampledTokens
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams
from nanoserve.worker.model_runner import LaunchedStep, ModelRunner

LAUNCH_PHASES = ("prepare", "forward", "lm_head", "sample", "to_host")
PHASES = ("schedule", *LAUNCH_PHASES, "launch", "wait", "process")


class Recorder:
    """Host time per phase of the current step, and the step's device events."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.steps: list[dict] = []
        self.current: dict = {}

    def timed(self, phase: str, fn):
        @wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - start

        return wrapper

    def event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev


def instrument(llm: LLM, rec: Recorder) -> None:
    engine, runner = llm.engine, llm.engine.runner
    schedule = engine.scheduler.schedule

    def recording_schedule():
        rec.current = {}
        rec.steps.append(rec.current)
        out = schedule()
        rec.current["decodes"] = sum(1 for e in out.scheduled if e.num_new_tokens == 1)
        rec.current["prefill_tokens"] = sum(e.num_new_tokens for e in out.scheduled if e.num_new_tokens > 1)
        rec.current["sampled"] = sum(len(e.sample_seqs) for e in out.scheduled)
        # Keys the step's decodes attend to (each one's context, its new token included): the K/V it reads.
        rec.current["kv_tokens"] = sum(e.start + 1 for e in out.scheduled if e.num_new_tokens == 1)
        return out

    engine.scheduler.schedule = rec.timed("schedule", recording_schedule)
    launch = runner.launch

    def recording_launch(batch, prev=None):
        rec.current["start"] = rec.event()
        out = launch(batch, prev)
        rec.current["end"] = rec.event()
        return out

    runner.launch = rec.timed("launch", recording_launch)
    runner.prepare = rec.timed("prepare", runner.prepare)
    for graphs in (runner.graphs, runner.prefill_graphs):
        if graphs is not None:
            graphs.run = rec.timed("forward", graphs.run)
    model = runner.model
    model.forward = rec.timed("forward", model.forward)  # eager steps (nn.Module.__call__ looks up self.forward)
    model.compute_logits = rec.timed("lm_head", model.compute_logits)
    runner.sampler.sample = rec.timed("sample", runner.sampler.sample)
    to_host = SampledTokens.to_host
    SampledTokens.to_host = rec.timed("to_host", to_host)
    result = LaunchedStep.result
    LaunchedStep.result = rec.timed("wait", result)
    # _process runs after the next step's launch, so its time lands on that step's record: the host work that
    # sits between two launches.
    engine._process = rec.timed("process", engine._process)


def group_of(step: dict) -> str:
    if step["prefill_tokens"]:
        return "prefill>0"
    return f"decode {1 << max(step['decodes'] - 1, 0).bit_length():>3}"


def override_decode_options(options: dict, splits: int | None, min_batch: int) -> None:
    """Merge options into every decode split launch of at least min_batch sequences, and give those launches
    `splits` splits if set (both attention modules import plan_split_launch by name, so both names are replaced;
    the model never passes num_splits, so every launch asks default_num_splits)."""
    plan, default_splits = decode_attention.plan_split_launch, decode_attention.default_num_splits

    def splits_for(batch_size: int, num_kv_heads: int, max_context_len: int) -> int:
        if splits is not None and batch_size >= min_batch:
            return splits
        return default_splits(batch_size, num_kv_heads, max_context_len)

    def patched(*args, **kwargs):
        launch = plan(*args, **kwargs)
        if launch is None or launch.grid[0] < min_batch:
            return launch
        return launch._replace(options=launch.options | options)

    decode_attention.plan_split_launch = decode_rope_attention.plan_split_launch = patched
    decode_attention.default_num_splits = splits_for


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and output (shortest: 100 or less)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-lm-head-warm-up", action="store_true")
    p.add_argument("--pageable-copies", action="store_true")
    p.add_argument("--decode-options", type=json.loads, default={},
                   help='JSON merged into decode attention launch options: {"BLOCK_N": 128, "num_stages": 3}')
    p.add_argument("--decode-splits", type=int, help="decode attention's splits per sequence, in place of the default")
    p.add_argument("--decode-options-min-batch", type=int, default=1,
                   help="apply --decode-options and --decode-splits only to launches of at least this many sequences")
    p.add_argument("--dump", help="write every step's record here, one JSON object a line, for a look later")
    ns = p.parse_args()
    if ns.no_lm_head_warm_up:
        ModelRunner.warm_up_lm_head = lambda self: None
    if ns.pageable_copies:
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    if ns.decode_options or ns.decode_splits:
        override_decode_options(ns.decode_options, ns.decode_splits, ns.decode_options_min_batch)
    cuda = torch.cuda.is_available()
    # The ceilings bench throughput measures at its start, for each step's bound (the bound column).
    bw, flops = (roofline.measure_bandwidth(torch.device("cuda")), roofline.measure_matmul(torch.device("cuda"))) \
        if cuda else (None, None)
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16" if cuda else "float32")
    engine, cfg = llm.engine, llm.engine.config
    model = engine.runner.model
    weight_bytes, params = roofline.model_bytes(model), roofline.model_params(model)
    kv_per_token = roofline.kv_bytes_per_token(cfg)
    lo = min(100, ns.max_len)
    prompts, out_lens = workload(ns.num_prompts, lo, ns.max_len, lo, ns.max_len, cfg.model.vocab_size, ns.seed)
    rec = Recorder(cuda)
    instrument(llm, rec)
    llm.generate(prompts[:8], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    rec.steps.clear()
    for i, (prompt, n) in enumerate(zip(prompts, out_lens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step(final_only=True)
    wall = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()

    groups: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    rows = []  # per step, in milliseconds
    prev_end = None
    for step in rec.steps:
        if "start" not in step:  # scheduled nothing: no launch
            continue
        row = {k: step[k] for k in ("decodes", "prefill_tokens", "sampled")}
        row |= {phase: round(step.get(phase, 0.0) * 1e3, 4) for phase in PHASES}
        if cuda:
            row["gpu"] = step["start"].elapsed_time(step["end"])
            row["idle"] = prev_end.elapsed_time(step["start"]) if prev_end is not None else 0.0
            # As bench throughput bounds the run: a step with decodes reads every weight and their K/V at the
            # copy rate; prompt tokens cost 2 FLOPs a parameter at the matmul rate.
            decode_bytes = (weight_bytes + kv_per_token * step["kv_tokens"]) if step["decodes"] else 0
            row["bound"] = 1e3 * (decode_bytes / bw + 2 * params * step["prefill_tokens"] / flops)
        prev_end = step["end"]
        rows.append(row)
        g = groups[group_of(step)]
        g["steps"] += 1
        for col in (*PHASES, "gpu", "idle", "bound"):
            g[col] += row.get(col, 0.0)
    if ns.dump:
        with open(ns.dump, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    cols = ("steps", "gpu", "bound", "idle", *PHASES)
    print(f"{'group':<12}" + "".join(f"{c:>10}" for c in cols))
    print(f"{'':<12}{'':>10}" + "".join(f"{'ms/step':>10}" for _ in cols[1:]))
    for key in sorted(groups):
        g = groups[key]
        n = g["steps"]
        print(f"{key:<12}{int(n):>10}" + "".join(f"{g[c] / n:>10.3f}" for c in cols[1:]))
    total = {c: sum(g[c] for g in groups.values()) for c in cols}
    n_out = sum(out_lens)
    print(json.dumps({
        "script": "step_bubbles", "lm_head_warm_up": not ns.no_lm_head_warm_up,
        "pinned_copies": not ns.pageable_copies, "decode_options": ns.decode_options,
        "decode_splits": ns.decode_splits, "decode_options_min_batch": ns.decode_options_min_batch,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "wall_s": round(wall, 3), "output_tok_s": round(n_out / wall, 1), "steps": int(total["steps"]),
        "gpu_busy_s": round(total["gpu"] / 1e3, 3) if cuda else None,
        "gpu_idle_s": round(total["idle"] / 1e3, 3) if cuda else None,
        "bound_s": round(total["bound"] / 1e3, 3) if cuda else None,
        # GPU time over the bound, by group: where the run loses to the roofline.
        "over_bound_by_group_s": {k: round((g["gpu"] - g["bound"]) / 1e3, 3) for k, g in sorted(groups.items())}
        if cuda else None,
        "idle_by_group_s": {k: round(g["idle"] / 1e3, 3) for k, g in sorted(groups.items())} if cuda else None,
        "host_s": {c: round(total[c] / 1e3, 3) for c in PHASES},
        "lm_head_rows_distinct": len({s["sampled"] for s in rec.steps if s.get("sampled")}),
        "max_phase_ms": {c: round(1e3 * float(np.max([s.get(c, 0.0) for s in rec.steps])), 2) for c in PHASES},
    }))


if __name__ == "__main__":
    main()
