"""Probe (deleted after its result went to BENCHMARKS.md table 7): host mask time a step for ROWS samples of one
JSON-schema grammar on Qwen3's vocabulary, each consuming a random allowed token a step (as a random-weight model
under the grammar does), with THREADS mask threads and at most LANES lanes (1 = one shared lexer, as before 87b9b73).
The median is over the second half of STEPS steps (masks cost more deeper into the document).

    python scripts/qwen3_tokenizer.py .ab/qwen3-tok
    python scripts/mask_lanes_probe.py THREADS LANES [ROWS [STEPS]]
"""
import json, os, sys, time, random
import torch
from transformers import AutoTokenizer
from nanoserve.structured.backend import GrammarCompiler, GrammarState
from nanoserve.structured.params import StructuredOutputs

tok = AutoTokenizer.from_pretrained(os.environ.get("QWEN3_TOKENIZER", ".ab/qwen3-tok"))
schema = json.load(open("nanoserve/bench/schemas/records.json"))
grammar = StructuredOutputs(json=schema).compiled
threads = int(sys.argv[1]); lanes = int(sys.argv[2]); rows = int(sys.argv[3]) if len(sys.argv) > 3 else 64
comp = GrammarCompiler(tok, [tok.eos_token_id], 151936, num_threads=threads)
cg = comp.compile(grammar)
cg.max_lanes = lanes
states = [GrammarState(cg) for _ in range(rows)]
mask = torch.zeros(rows, comp.mask_words, dtype=torch.int32)
rng = random.Random(0)
times = []
for step in range(int(sys.argv[4]) if len(sys.argv) > 4 else 40):
    t = time.perf_counter()
    comp.fill(states, mask)
    times.append(time.perf_counter() - t)
    bits = mask.numpy().view("uint32")
    for i, s in enumerate(states):  # consume a random allowed token
        words = bits[i].nonzero()[0]
        w = rng.choice(list(words)); b = [k for k in range(32) if bits[i][w] >> k & 1]
        tid = int(w) * 32 + rng.choice(b)
        assert s.matcher.consume_token(tid), tid
times = sorted(times[len(times)//2:])
print(json.dumps({"threads": threads, "lanes": len(cg.lanes), "rows": rows, "ms_per_step_median": round(times[len(times)//2] * 1e3, 2),
                  "us_per_row": round(times[len(times)//2] * 1e6 / rows, 1)}))
