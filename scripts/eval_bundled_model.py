"""Pass rate of the bundled model on the training script's 50 held-out prompts, through nanoserve's own
Engine and tool loop (greedy). Prints one JSON line last.

    python scripts/eval_bundled_model.py
"""

import json
import re

import torch
from train_tiny_model import eval_prompts  # the training script beside this one: Python puts its folder on sys.path

from nanoserve import LLM
from nanoserve.chat_engine import Engine


def main() -> None:
    torch.set_num_threads(1)
    llm = LLM()
    engine = Engine(llm)
    items = eval_prompts(1338)  # the seed train_tiny_model.py holds out (its --seed + 1)
    passed = 0
    for user, _, expected in items:
        prompt = llm.apply_chat_template([{"role": "user", "content": user}])
        results, masks = engine.generate_batch(prompt, max_tokens=96, temperature=0.0)
        text = llm.tokenizer.decode(results[0][len(prompt):], skip_special_tokens=False)
        answer = text.split("<|output_end|>")[-1] if "<|output_end|>" in text else ""
        ok = 0 in masks[0] and re.search(rf"(?<![\d.]){re.escape(expected)}(?![\d]|\.\d)", answer) is not None
        passed += ok
        if not ok:
            print(f"FAIL {user!r} -> {text!r}")
    print(json.dumps({"prompts": len(items), "passed": passed, "pass_rate": passed / len(items)}))


if __name__ == "__main__":
    main()
