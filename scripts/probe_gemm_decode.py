"""Decode steps with every linear layer on the Triton skinny GEMM (kernels/gemv.py, under PDL, M tiled) against
cuBLAS, in the engine's own model and KV pool, captured in CUDA graphs. (GPU only.)

Each variant patches layers/linear.py to send every captured linear layer of up to 256 rows to the skinny GEMM,
with rows up to gemv.MAX_M on gemv._config's rule and more on one block configuration of a CONFIGS set
(--configs), some also with the fused prologues (residual add + RMSNorm before qkv and gate_up, SiLU-and-mul
before down); they are compared with cuBLAS from 3 rows on (SKINNY_MAX_ROWS patched to 2) and with the engine's
default. For each batch size: contexts uniform in --context, blocks scattered over the pool, a KV cache of random
values; every variant's step is captured and replayed in turn (--rounds rounds of --iters replays, interleaved);
medians in ms a step, and each variant's hidden states against cuBLAS's (max abs difference; rows whose LM-head
argmax agrees: bf16 logits tie often, so a changed summation order flips some). The last line is one JSON object.

Measured on an H100 (2026-11-23; then gemv.MAX_M was 16 and SKINNY_MAX_ROWS 2), ms a step, cuBLAS -> best:
- Qwen3-0.6B, --configs narrow (up to 16 rows its three variants run the same code: their range is noise):
  3 rows 1.326 -> 1.293-1.302, 4: 1.408 -> 1.385-1.389, 6: 1.486 -> 1.415-1.416, 8: 1.477 -> 1.382-1.386,
  12: 1.623 -> 1.483-1.486, 16: 1.811 -> 1.705-1.706; 24: 2.151 -> 2.090 (32-row tiles, the rule's slabs; 2.111
  with 64-column slabs), 32: 2.396 -> 2.373 (2.353); 48: 3.132, every skinny config slower (3.251-3.663).
- Llama-3.1-8B (its qkv and o_proj; the MLP's weights are over SKINNY_MAX_WEIGHT_BYTES), same code to 16 rows:
  4 rows 5.994 -> 5.875-5.904, 8: 6.212 -> 6.107-6.110, 16: 6.597 -> 6.452-6.460, 32: 7.390 -> 7.291 (7.281).
- Qwen3-0.6B, --configs wide: at 64-256 rows cuBLAS won (e.g. 256: 10.600 against 10.820-11.377 ms), and the
  fused prologues lost everywhere from 4 rows (e.g. 16: 2.267 against 1.750; 256: 12.385-13.752), since every
  program redoes the norm or SiLU over all its rows.
So the skinny GEMM now takes 1-32 rows (SKINNY_MAX_ROWS) and its prologues stay at one row.

    python scripts/probe_gemm_decode.py --model shared/bench-configs/qwen3-0.6b [--batches 16,64,128,256]
"""

import argparse
import contextlib
import json
from unittest import mock

import numpy as np
import torch
from probe_two_batch import against, capture_step, probe_engine, replay_ms, step_inputs  # scripts/ is on sys.path

from nanoserve.kernels import gemv
from nanoserve.layers import linear

# (block_m, block_n, block_k, warps, stages) for rows over 16; block_n None: gemv._config's rule for it.
CONFIGS = {
    "wide": [(64, 64, 128, 4, 4), (64, 128, 128, 8, 3), (128, 64, 128, 4, 3), (32, 64, 256, 4, 4),
             (64, 64, 256, 4, 3)],
    "narrow": [(32, None, 256, 4, 4), (32, None, 128, 4, 4), (32, 64, 256, 4, 4)],
}
FUSED_CONFIGS = {"wide": [0, 1], "narrow": []}  # indices into CONFIGS also run with the fused prologues


def triton_everywhere(cfg: tuple, fused: bool):
    """Patches that send every captured linear layer of up to 256 rows to the skinny GEMM with this config."""
    default, rule_max = gemv._config, gemv.MAX_M  # the shipped rule, for the rows it was fitted to

    def config(m: int, n: int, k: int, elem_size: int):
        if m <= rule_max:
            return default(m, n, k, elem_size)
        block_m, block_n, block_k, warps, stages = cfg
        return gemv._Config(True, block_m, block_n or default(16, n, k, elem_size).block_n, min(block_k, k), warps,
                            stages)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(gemv, "MAX_M", 256))
    stack.enter_context(mock.patch.object(gemv, "_config", config))
    stack.enter_context(mock.patch.object(linear, "SKINNY_MAX_ROWS", 256))
    if fused:
        stack.enter_context(mock.patch.object(
            linear, "takes_fused_prologue", lambda x, w: x.dim() == 2 and linear.takes_skinny_gemm(x, w)))
    return stack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="4,16,32,64,128,192,256")
    p.add_argument("--context", type=int, nargs=2, default=[200, 1600])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--configs", choices=list(CONFIGS), default="wide")
    ns = p.parse_args()
    runner, cfg = probe_engine(ns.model)
    model = runner.model
    rng = np.random.default_rng(0)
    # cuBLAS from 3 rows on (the rule before the skinny GEMM took up to 32), and the engine as it is.
    variants = {"cublas": lambda: mock.patch.object(linear, "SKINNY_MAX_ROWS", 2), "default": contextlib.nullcontext}
    for i, c in enumerate(CONFIGS[ns.configs]):
        name = "m{}n{}k{}w{}s{}".format(*c)
        variants[name] = lambda c=c: triton_everywhere(c, False)
        if i in FUSED_CONFIGS[ns.configs]:
            variants[name + "_fused"] = lambda c=c: triton_everywhere(c, True)
    results = []
    with torch.inference_mode():
        for batch in (int(b) for b in ns.batches.split(",")):
            args = step_inputs(batch, *ns.context, runner.num_kv_blocks, runner.block_size, cfg.model.vocab_size,
                               rng, cfg.device)
            graphs, outs, failed = {}, {}, {}
            for name, patches in variants.items():
                try:
                    with patches():
                        graphs[name], outs[name] = capture_step(lambda a=args: model(*a))
                except Exception as exc:  # a config that does not compile or fit (shared memory, registers)
                    failed[name] = f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0]
            ms = replay_ms(graphs, ns.rounds, ns.iters)
            best = min(ms, key=ms.get)
            row = {"batch": batch, "ms": ms, "best": best, "gain_best": round(1 - ms[best] / ms["cublas"], 4),
                   **against(model, outs, "cublas"), "failed": failed}
            print(json.dumps(row), flush=True)
            results.append(row)
            del graphs, outs
            torch.cuda.empty_cache()
    print(json.dumps({"script": "probe_gemm_decode", "gpu": torch.cuda.get_device_name(), "results": results}))


if __name__ == "__main__":
    main()
