"""Temporary probe (issue #43): where a batch-1 step of the bundled model goes on the GPU, plain and with its
draft (or n-gram): cProfile of 20 prompts after every prompt is warmed up."""

import cProfile
import pstats
import sys
import time

from train_tiny_model import eval_prompts

from nanoserve import LLM, SamplingParams

spec = {"model": "nanoserve/assets/draft", "num_speculative_tokens": 3}
if len(sys.argv) > 1 and sys.argv[1] == "ngram":
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
items = [u for u, _, _ in eval_prompts(1338)]
params = SamplingParams(temperature=0.0, max_tokens=96, skip_special_tokens=False)
for name, kwargs in (("plain", {}), ("spec", {"speculative_config": spec})):
    llm = LLM(num_kv_blocks=2048, **kwargs)
    for u in items:
        llm.chat([{"role": "user", "content": u}], params, use_tqdm=False)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    n = 0
    for u in items[:20]:
        n += len(llm.chat([{"role": "user", "content": u}], params, use_tqdm=False)[0].outputs[0].token_ids)
    prof.disable()
    sec = time.perf_counter() - start
    print(f"== {name}: {n} tokens in {sec:.3f} s = {1000 * sec / n:.3f} ms/token (profiled)")
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(r"nanoserve", 45)
    st.sort_stats("tottime").print_stats(20)
    llm.shutdown()
