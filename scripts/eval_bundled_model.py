"""Pass rate of the bundled model on the training script's 50 held-out prompts, through LLM.chat and its
calculator tool loop (greedy, one prompt at a time), and what speculative decoding makes of them. Prints one
JSON line last.

    python scripts/eval_bundled_model.py
    python scripts/eval_bundled_model.py --speculative-config '{"model": "nanoserve/assets/draft",
        "num_speculative_tokens": 3}' --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
    python scripts/eval_bundled_model.py --speculative-config '{"method": "eagle3", "model": "nanoserve/assets/eagle3",
        "num_speculative_tokens": 3}'
    python scripts/eval_bundled_model.py --workload copy --speculative-config ...

Each --speculative-config runs the same prompts on an LLM of its own after the plain run, and reports its pass
rate, output tokens/s, mean acceptance length (1 + accepted drafts / verify steps with drafts, as vLLM's
spec_decode metrics count it) and speed-up: plain decoding's time over its own, the two run prompt by prompt in
turn. Greedy output with speculation must be the plain
run's token for token: a difference is a bug, and the script fails on it. `--workload copy` asks 50 two-operation
questions of 4-digit numbers written without spaces: the calculator call copies the question's expression and the
answer copies the call, which is what n-gram lookup drafts from. The device is the engine's default.
"""

import argparse
import copy
import json
import random
import re
import time
from dataclasses import dataclass, field

import torch
from train_tiny_model import eval_prompts  # the training script beside this one: Python puts its folder on sys.path

from nanoserve import LLM, SamplingParams
from nanoserve.tools.calculator import calculator

MAX_TOKENS = 96


@dataclass
class Run:
    token_ids: list[list[int]]
    passed: int
    seconds: float
    num_drafts: int = 0
    num_accepted_tokens: int = 0
    failures: list[str] = field(default_factory=list)  # "prompt -> text" of each wrong answer

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def summary(self) -> dict:
        out = {
            "passed": self.passed,
            "pass_rate": self.passed / len(self.token_ids),
            "output_tokens": self.num_tokens,
            "output_tokens_per_s": round(self.num_tokens / self.seconds, 1),
        }
        if self.num_drafts:
            out["mean_acceptance_length"] = round(1 + self.num_accepted_tokens / self.num_drafts, 3)
        return out


def copy_prompts(seed: int, n: int = 50) -> list[tuple[str, str, str]]:
    """(user message, expression, expected answer): two operations on 4-digit numbers, typed without spaces, the
    form the training data copies verbatim into the calculator call."""
    rng = random.Random(seed)
    templates = ["What is {e}?", "Compute {e}", "{e}", "Calculate {e}", "what's {e}"]
    items = []
    for i in range(n):
        a, b, c = (rng.randint(1000, 9999) for _ in range(3))
        expr = f"{a}{rng.choice('+-*')}{b}{rng.choice('+-*')}{c}"
        items.append((templates[i % len(templates)].format(e=expr), expr, calculator(expr)))
    return items


def answered(text: str, expected: str) -> bool:
    """The final answer (what follows the tool output) contains the expected number."""
    if "<|output_end|>" not in text:
        return False
    answer = text.split("<|output_end|>")[-1]
    return re.search(rf"(?<![\d.]){re.escape(expected)}(?![\d]|\.\d)", answer) is not None


def chat(llm: LLM, user: str) -> tuple[list[int], str, float]:
    """One prompt alone (batch 1, where speculation pays): its token ids, text and wall-clock seconds."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, skip_special_tokens=False)
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": user}], params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text, time.perf_counter() - start


def run(llms: list[LLM], items: list[tuple[str, str, str]]) -> list[Run]:
    """Each prompt through each LLM in turn: on a machine shared with other work, a busy minute then slows every
    LLM alike instead of whichever ran during it."""
    runs = [Run([], 0, 0.0) for _ in llms]
    befores = []
    # Warm-up, untimed. On a GPU, every prompt once: Triton compiles a kernel the first time it meets new shapes
    # (a draft model's, a verify step's k + 1 tokens, a prompt length), and a first GPU run timed those compiles
    # as speculation's cost (the bundled draft measured 0.22x, 28 kernels compiled inside the timed run).
    warmup = items if torch.cuda.is_available() else items[:1]
    for llm in llms:
        for user, _, _ in warmup:
            chat(llm, user)
        befores.append(copy.deepcopy(llm.engine.spec_stats))
    for user, _, expected in items:
        for r, llm in zip(runs, llms, strict=True):
            token_ids, text, seconds = chat(llm, user)
            r.token_ids.append(token_ids)
            if answered(text, expected):
                r.passed += 1
            else:
                r.failures.append(f"{user!r} -> {text!r}")
            r.seconds += seconds
    for r, llm, before in zip(runs, llms, befores, strict=True):
        if (after := llm.engine.spec_stats) is not None:
            r.num_drafts = after.num_drafts - before.num_drafts
            r.num_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        action="append",
        default=[],
        help="a speculative_config JSON object to compare with plain decoding (repeatable)",
    )
    p.add_argument("--workload", choices=["eval", "copy"], default="eval")
    p.add_argument("--async-scheduling", action="store_true",
                   help="speculative engines draft early (async_scheduling=True); by default steps are synchronous")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    # eval: the seed train_tiny_model.py holds out (its --seed + 1).
    items = eval_prompts(1338) if args.workload == "eval" else copy_prompts(1339)

    # Two engines live at once (plain decoding timed beside each speculative one): a fixed pool each, 32k tokens
    # (batch 1 of a 512-token model needs 32 blocks), instead of the GPU default where the first takes 90 % of memory.
    plain_llm = LLM(num_kv_blocks=2048)
    plain = run([plain_llm], items)[0]
    for failure in plain.failures:
        print(f"FAIL {failure}")
    summary = {"workload": args.workload, "prompts": len(items), **plain.summary(), "speculative": []}
    print(json.dumps({k: v for k, v in summary.items() if k != "speculative"}), flush=True)
    for spec in args.speculative_config:
        llm = LLM(speculative_config=spec, num_kv_blocks=2048,
                  **({"async_scheduling": True} if args.async_scheduling else {}))
        # Timed against plain decoding again, prompt by prompt, for a speed-up measured under the same load.
        again, result = run([plain_llm, llm], items)
        for i, (want, got) in enumerate(zip(plain.token_ids, result.token_ids, strict=True)):
            assert got == want, f"greedy output differs with {spec} on {items[i][0]!r}: {got} != {want}"
        entry = {"speculative_config": spec, "early_drafts": llm.engine.early_drafts, **result.summary(),
                 "speedup": round(again.seconds / result.seconds, 3)}
        print(json.dumps(entry), flush=True)
        summary["speculative"].append(entry)
        llm.shutdown()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
