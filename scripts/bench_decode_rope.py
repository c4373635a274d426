"""Decode attention with q/k norm, rotary and the KV store done inside it (decode_rope_attention, one launch) against
the unfused pair (qkv_rope_store, then decode_attention), replayed from CUDA graphs on the GPU.

    python scripts/bench_decode_rope.py           # every shape below
    python scripts/bench_decode_rope.py --quick   # batch 1 and 4 only

Shapes: Qwen3-0.6B (16 query / 8 kv heads, q/k norm) and Llama-3.1-8B (32 / 8, no norm), head_dim 128, bf16,
16-token pages, block tables as wide as max_model_len 8192 (so num_splits is a decode graph's), batch 1, 4, 64 and
256 at 128, 512 or 2048 keys or a mix of 128-2048. As in bench_decode_attention.py (whose inputs and timer this
reuses) a graph holds one call per layer or more, cycling over enough KV caches that the keys come from DRAM; the
counters (splits merged in the same launch) are given up to the batch at which the decode graphs give them.

Paths: `unfused` (what NANOSERVE_FUSED_ROPE_DECODE=0 runs), `fused` (decode_rope_attention as the model calls it),
`fused_pf` / `fused_nopf` (its first key tile loaded before the PDL wait, or not, whatever it would decide).
Two timings per path, in microseconds per call: `attn`, the calls back to back, and `layer`, each call after the
qkv projection that feeds it (the skinny GEMM at batch 1-2, cuBLAS above), as in the model, where that GEMM is the
kernel whose tail the PDL wait overlaps. Outputs and stored K/V of every path are checked against the unfused
path's (and the reference's at batch <= 4). Ends with one JSON line.
"""

import argparse
import itertools
import json
import statistics

import torch
from bench_decode_attention import make_inputs, time_graph  # scripts/ is on sys.path when a script in it runs

from nanoserve.kernels.decode_attention import decode_attention, default_num_splits
from nanoserve.kernels.decode_rope_attention import decode_rope_attention, decode_rope_attention_ref
from nanoserve.kernels.qkv_rope_store import qkv_rope_store
from nanoserve.layers.linear import Linear
from nanoserve.worker.cuda_graphs import FUSED_DECODE_MERGE_MAX_BATCH

BLOCK_SIZE, MAX_MODEL_LEN, HEAD_DIM, EPS = 16, 8192, 128, 1e-6
# query heads, kv heads, layers, q/k norm, hidden size
MODELS = {"qwen3-0.6b": (16, 8, 28, True, 1024), "llama-3.1-8b": (32, 8, 32, False, 4096)}
BATCHES = [1, 4, 64, 256]
CONTEXTS = [(128, 128), (512, 512), (2048, 2048), (128, 2048)]
PATHS = {"unfused": None, "fused": None, "fused_pf": True, "fused_nopf": False}  # path -> prefetch
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
WEIGHT_SET_BYTES = 256 << 20  # distinct projection weights until above L2, as a model's layers are


class Case:
    def __init__(self, model: str, batch: int, lo: int, hi: int):
        self.hq, self.hkv, self.layers, norm, hidden = MODELS[model]
        self.batch = batch
        inp = make_inputs(batch, lo, hi, self.hq, self.hkv, MAX_MODEL_LEN // BLOCK_SIZE)
        self.caches, self.tables, self.seq_lens = inp["caches"], inp["tables"], inp["seq_lens"]
        self.calls = max(self.layers, len(self.caches))
        # The new token sits at position seq_len - 1, in the slot the table gives it.
        self.positions = self.seq_lens.long() - 1
        block = self.tables.gather(1, (self.positions // BLOCK_SIZE)[:, None])[:, 0].long()
        self.slots = block * BLOCK_SIZE + self.positions % BLOCK_SIZE
        width = (self.hq + 2 * self.hkv) * HEAD_DIM
        self.qkv = torch.randn(batch, width, dtype=torch.bfloat16, device="cuda")
        freqs = torch.rand(MAX_MODEL_LEN, HEAD_DIM // 2, device="cuda") * 100
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.weights = [torch.randn(HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)] if norm \
            else [None, None]
        self.counters = torch.zeros(batch * self.hkv, dtype=torch.int32, device="cuda")
        self.use_counters = batch <= FUSED_DECODE_MERGE_MAX_BATCH
        self.x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        with torch.device("cuda"):
            self.projs = [Linear(hidden, width, bias=False).to(torch.bfloat16)
                          for _ in range(min(self.calls, -(-WEIGHT_SET_BYTES // (hidden * width * 2))))]

    def call(self, path: str, i: int, qkv: torch.Tensor, out: torch.Tensor, caches=None) -> None:
        """Call i (its KV cache is i's, cycling) on qkv, into out."""
        k, v = caches or self.caches[i % len(self.caches)]
        rope = (qkv, self.hq, self.hkv, self.positions, self.cos, self.sin, *self.weights, EPS, k, v, self.slots)
        counters = self.counters if self.use_counters else None
        if path == "unfused":
            qkv_rope_store(*rope)
            q = qkv[:, :self.hq * HEAD_DIM].view(self.batch, self.hq, HEAD_DIM)
            decode_attention(q, k, v, self.seq_lens, self.tables, HEAD_DIM**-0.5, out=out, counters=counters)
        else:
            decode_rope_attention(*rope, self.seq_lens, self.tables, HEAD_DIM**-0.5, out=out, counters=counters,
                                  prefetch=PATHS[path])

    def graph(self, path: str, with_projection: bool, outs: torch.Tensor) -> torch.cuda.CUDAGraph:
        def step() -> None:
            for i in range(self.calls):
                qkv = self.projs[i % len(self.projs)](self.x) if with_projection else self.qkv
                self.call(path, i, qkv, outs[i])

        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph

    def check(self) -> dict:
        """Each path once on copies of the same qkv and first cache: outputs and stored K/V against the unfused."""
        got = {}
        for path in PATHS:
            caches = tuple(c.clone() for c in self.caches[0])
            out = torch.full((self.batch, self.hq, HEAD_DIM), float("nan"), dtype=torch.bfloat16, device="cuda")
            self.call(path, 0, self.qkv.clone(), out, caches)
            got[path] = (out, *caches)
        want = got["unfused"]
        for path, (out, k, v) in got.items():
            assert torch.isfinite(out).all(), path
            torch.testing.assert_close(out, want[0], **BF16_TOL)
            torch.testing.assert_close(k, want[1], **BF16_TOL)
            assert torch.equal(v, want[2]), path
        if self.batch <= 4:
            rope = (self.qkv, self.hq, self.hkv, self.positions, self.cos, self.sin, *self.weights, EPS,
                    *(c.clone() for c in self.caches[0]), self.slots)
            ref = decode_rope_attention_ref(*rope, self.seq_lens, self.tables, HEAD_DIM**-0.5)
            torch.testing.assert_close(got["fused"][0], ref, **BF16_TOL)
        assert (self.counters == 0).all()
        return {"bitwise_equal_out": torch.equal(got["fused"][0], want[0]),
                "max_abs_diff": (got["fused"][0].float() - want[0].float()).abs().max().item()}


def run_case(model: str, batch: int, lo: int, hi: int) -> dict:
    case = Case(model, batch, lo, hi)
    result = {"splits": default_num_splits(batch, case.hkv, MAX_MODEL_LEN), "calls_per_graph": case.calls,
              "counters": case.use_counters, **case.check()}
    for mode, with_projection in (("attn", False), ("layer", True)):
        outs = torch.empty(case.calls, batch, case.hq, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        graphs = {path: case.graph(path, with_projection, outs) for path in PATHS}
        # Interleaved repeats, so clock or thermal drift hits every path alike; the median of each.
        times = {path: [] for path in PATHS}
        for _ in range(5):
            for path, graph in graphs.items():
                times[path].append(time_graph(graph, case.calls))
        us = {path: round(statistics.median(t), 2) for path, t in times.items()}
        assert (case.counters == 0).all(), "a counter was left non-zero"
        result[mode] = {**{f"{path}_us": t for path, t in us.items()},
                        "saved_us": round(us["unfused"] - us["fused"], 2),
                        "speedup": round(us["unfused"] / us["fused"], 3)}
        del graphs
    return result


def case_keys(batches: list[int]) -> list[tuple[str, int, int, int]]:
    """(model, batch, lo, hi) for every shape; one sequence takes fixed lengths only (a range is just another)."""
    return [(model, batch, lo, hi) for model, batch, (lo, hi) in itertools.product(MODELS, batches, CONTEXTS)
            if batch > 1 or lo == hi]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4 only")
    batches = BATCHES[:2] if parser.parse_args().quick else BATCHES
    cases = {}
    for model, batch, lo, hi in case_keys(batches):
        key = f"{model}_b{batch}_ctx{lo}-{hi}"
        cases[key] = run_case(model, batch, lo, hi)
        print(key, cases[key], flush=True)
        torch.cuda.empty_cache()

    def geomean(mode: str, batch: int) -> float:
        return round(statistics.geometric_mean([r[mode]["speedup"] for k, r in cases.items() if f"_b{batch}_" in k]), 3)

    summary = {f"{mode}_speedup_geomean_by_batch": {batch: geomean(mode, batch) for batch in batches}
               for mode in ("attn", "layer")}
    print(json.dumps({"bench": "decode_rope_attention", "device": torch.cuda.get_device_name(), "cases": cases,
                      **summary}))


if __name__ == "__main__":
    main()
