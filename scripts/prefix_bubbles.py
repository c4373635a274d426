"""Where a cached prefix request's time to first token goes, without a profiler.

Runs `bench prefix`'s cached requests (a shared prompt, then a unique suffix; one token out; one request at a
time) with step_bubbles.py's instruments, and splits each request's wall time (what bench prefix reports as its
TTFT) into:
- the step's host phases: schedule, launch (prepare, forward, LM head, sampler, copy to host), the wait for the
  samples and the processing after;
- outside: the rest of LLM.generate (adding the request, hashing its blocks, building its output);
- gpu: the step on the device, from its first input copy to the samples' copy back (CUDA events).
The wait (part of the processing's time) is where the host stood idle on the GPU; gpu - wait is how much of the
step the host's launch overlapped.

    python scripts/prefix_bubbles.py --model shared/bench-configs/qwen3-0.6b [--num-requests 100]
Without CUDA (a smoke test: --model nanoserve/assets --shared-len 200 --suffix-len 20 --max-model-len 512) gpu is empty.
Ends with one JSON line of medians in milliseconds.
"""

import argparse
import json
import time

import numpy as np
import torch
from step_bubbles import PHASES, Recorder, instrument  # scripts/ is on sys.path when a script in it runs

from nanoserve.bench.prefix import prefix_prompts
from nanoserve.llm import LLM
from nanoserve.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--shared-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=100)
    p.add_argument("--max-model-len", type=int, default=4096)  # as the prefix recipe runs
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    cuda = torch.cuda.is_available()
    llm = LLM(model=ns.model, load_format="dummy", dtype="bfloat16" if cuda else "float32",
              max_model_len=ns.max_model_len)
    prompts = prefix_prompts(llm.engine.config.model.vocab_size, ns.shared_len, ns.suffix_len,
                             ns.num_requests + 10, ns.seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rec = Recorder(cuda)
    instrument(llm, rec)
    for prompt in prompts[:10]:  # the first fills the cache; the rest warm up
        llm.generate([prompt], params, use_tqdm=False)
    rows = []
    for prompt in prompts[10:]:
        rec.steps.clear()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = [s for s in rec.steps if "start" in s]
        assert len(steps) == 1, f"a one-token request should take one step, took {len(steps)}"
        step = steps[0]
        # Summed over every record: the step's processing may land on a later schedule call's record.
        row = {"wall": wall * 1e3, **{phase: sum(s.get(phase, 0.0) for s in rec.steps) * 1e3 for phase in PHASES}}
        # The wait happens inside the processing (LLMEngine._process asks for the samples), so it is not added again.
        row["outside"] = row["wall"] - sum(row[phase] for phase in ("schedule", "launch", "process"))
        if cuda:
            torch.cuda.synchronize()
            row["gpu"] = step["start"].elapsed_time(step["end"])
        rows.append(row)
    medians = {key: round(float(np.median([r[key] for r in rows])), 3) for key in rows[0]}
    for key, value in medians.items():
        print(f"{key:<10}{value:>10.3f} ms")
    print(json.dumps({"script": "prefix_bubbles", "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "num_requests": ns.num_requests, "shared_len": ns.shared_len, "suffix_len": ns.suffix_len,
                      "median_ms": medians}))


if __name__ == "__main__":
    main()
