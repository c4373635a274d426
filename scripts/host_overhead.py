"""The engine's host time with the model replaced by a stub: what scheduling, input preparation, sampling
bookkeeping and output handling cost per step, on any machine (no GPU needed).

    python scripts/host_overhead.py [--profile]
Three workloads: the throughput recipe's shape (256 requests, prompts and outputs of 100..1024 tokens, greedy),
bench serve's (256 requests of 512 + 128 tokens, with outputs built, encoded and pickled every step) and the prefix
benchmark's (2,100-token prompts whose first 2,000 tokens are cached, one token each).
Ends with one JSON line; --profile prints the top functions of each under cProfile.
"""

import argparse
import cProfile
import json
import pickle
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import bundled_model_dir
from nanoserve.engine.output_delta import DeltaEncoder


class StubModel:
    """Stands in for the model: hidden rows of zeros, logits of zeros (so greedy picks token 0)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, input_ids, positions, meta) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.vocab_size)


def stub_llm(model_dir: Path, **kwargs) -> LLM:
    llm = LLM(model=str(model_dir), load_format="dummy", **kwargs)
    llm.engine.runner.model = StubModel(llm.engine.config.model.vocab_size)
    return llm


def throughput_shape(model_dir: Path, rng: np.random.Generator) -> dict:
    llm = stub_llm(model_dir, num_kv_blocks=40000, max_model_len=2100)
    engine = llm.engine
    for i in range(256):
        engine.add_request(str(i), rng.integers(0, 1000, int(rng.integers(100, 1025))).tolist(),
                           SamplingParams(temperature=0, max_tokens=int(rng.integers(100, 1025)), ignore_eos=True))
    schedule, prefills = engine.scheduler.schedule, []

    def noting_schedule():
        out = schedule()
        prefills.append(any(e.num_new_tokens > 1 for e in out.scheduled))
        return out

    engine.scheduler.schedule = noting_schedule
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step(final_only=True)
        times.append(time.perf_counter() - start)
    # Steps with prompt chunks (the first ~20: up to 8,192 prompt tokens each) apart from the decode steps.
    with_prefill = [t for t, p in zip(times, prefills, strict=True) if p]
    return {"steps": len(times), "ms_per_step": round(1e3 * sum(times) / len(times), 3),
            "prefill_steps": len(with_prefill), "prefill_ms_per_step": round(1e3 * float(np.mean(with_prefill)), 3)}


def serve_shape(model_dir: Path, rng: np.random.Generator) -> dict:
    """bench serve's shape at rate inf: 256 running requests of 512 prompt tokens and 128 outputs, every step's
    outputs built and encoded as the deltas the engine process sends (engine/output_delta.py), and pickled."""
    llm = stub_llm(model_dir, num_kv_blocks=40000, max_model_len=1024, max_num_seqs=256)
    engine, encoder = llm.engine, DeltaEncoder()
    for i in range(256):
        engine.add_request(str(i), rng.integers(0, 1000, 512).tolist(),
                           SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    start, steps, sent = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        sent += len(pickle.dumps(encoder.encode(engine.step())))
        steps += 1
    wall = time.perf_counter() - start
    return {"steps": steps, "ms_per_step": round(1e3 * wall / steps, 3), "bytes_per_step": sent // steps}


def prefix_shape(model_dir: Path, rng: np.random.Generator) -> dict:
    llm = stub_llm(model_dir, num_kv_blocks=4000, max_model_len=4096)
    shared = rng.integers(0, 1000, 2000).tolist()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([shared + [1] * 100], one, use_tqdm=False)  # fills the cache
    prompts = [shared + rng.integers(0, 1000, 100).tolist() for _ in range(200)]
    start = time.perf_counter()
    outs = [llm.generate([p], one, use_tqdm=False)[0] for p in prompts]
    wall = time.perf_counter() - start
    assert all(o.num_cached_tokens == 2000 for o in outs)
    return {"ms_per_request": round(1e3 * wall / len(prompts), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", action="store_true")
    ns = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        # The bundled model's config with a longer context; weights are dummy and never used.
        config = json.loads((Path(bundled_model_dir()) / "config.json").read_text())
        config["max_position_embeddings"] = 4096
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        result = {"bench": "host_overhead"}
        for name, fn in (("throughput", throughput_shape), ("serve", serve_shape), ("prefix", prefix_shape)):
            prof = cProfile.Profile() if ns.profile else None
            if prof:
                prof.enable()
            result[name] = fn(Path(tmp), np.random.default_rng(0))
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
