"""What every benchmark shares: engine flags, the device's name, the commit, the closing JSON line."""

import argparse
import gc
import json
import math
import os
import subprocess
from pathlib import Path

import torch

from nanoserve.args import HelpFormatter, add_engine_args, engine_args_from
from nanoserve.bench import roofline
from nanoserve.config import EngineArgs, EngineConfig, resolve_device


def parser(kind: str, description: str) -> argparse.ArgumentParser:
    """The flags of `nanoserve bench <kind>`: the engine's, and a baseline to compare with."""
    p = argparse.ArgumentParser(prog=f"nanoserve bench {kind}", description=description, formatter_class=HelpFormatter)
    # dtype stays auto, as serve resolves it (the checkpoint's on CUDA: bfloat16 for every config in
    # benchmarks/configs; float32 on the CPU), and the JSON line reports the one that ran.
    add_engine_args(p, serving=False)
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run transformers (hf) on the same work, to compare")
    return p


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    args = engine_args_from(ns)
    # benchmarks/configs carry no weights: random ones of the right shapes then.
    if args.model and args.load_format == "auto" and not any(Path(args.model).glob("*.safetensors")):
        args.load_format = "dummy"
    return args


def ceilings_at_start(args: EngineArgs, matmul: bool = False) -> tuple[float | None, float | None]:
    """The roofline's ceilings, copy bandwidth and (with matmul) the bf16 matmul rate, measured at the start of the
    run, as the roofline bound needs them: on an idle device, before the engine takes its memory. (None, None) off CUDA.

    Measured after the engine's run instead (before c0ef833), the copy read 4.04-4.22 TB/s on one H200 from run to
    run, which moved a batch-1 MBU by 4 % at the same ms/token (84.5 and 88.2 % at 4.523 and 4.526 ms). At the
    start it has read 4.12-4.25 on H200s and 2.95-2.99 on H100s (2026-11-24).
    """
    if resolve_device(args.device).type != "cuda":
        return None, None
    device = torch.device("cuda")
    bandwidth = roofline.measure_bandwidth(device)
    flops = roofline.measure_matmul(device) if matmul else None
    free_device_memory()  # so that the engine sizes its KV pool as it would without the measurement
    return bandwidth, flops


def free_device_memory() -> None:
    """Give back a dropped engine's memory now: its objects refer to each other, so only gc frees them."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment() -> dict:
    commit = os.environ.get("NANOSERVE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=False).stdout.strip() or None
        except OSError:
            commit = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "commit": commit, "torch": torch.__version__}


def engine_facts(config: EngineConfig) -> dict:
    """What the engine ran with that flags may not say: its dtype, its KV cache's, and context (lengths are fitted to
    it)."""
    return {"dtype": str(config.dtype).removeprefix("torch."), "kv_cache_dtype": str(config.kv_dtype).removeprefix(
        "torch."), "max_model_len": config.max_model_len}


def kv_facts(runner) -> dict:
    """What the KV pools hold (worker/model_runner.py's ModelRunner, rank 0's share under tensor parallelism):
    kv_cache_tokens, the global pool's tokens (the longest context that fits; where every layer is windowed, the
    block ids of max_num_seqs sequences of max_model_len, which hold no KV); kv_window_pool_tokens, the
    sliding-window layers' own pool's (None: one pool for every layer); kv_cache_bytes, every pool's; and
    kv_bytes_per_token, those bytes over kv_cache_tokens: a model whose window layers free their out-of-window blocks
    pays for them only in the window pool, so its figure is well under one pool's
    (--disable-hybrid-kv-cache-manager)."""
    block = runner.block_size
    tokens = runner.num_kv_blocks * block
    total = sum(t.numel() * t.element_size() for pair in runner.kv_cache for t in pair)
    window = (runner.num_local_blocks - 1) * block if runner.kv_groups is not None else None
    return {"kv_cache_tokens": tokens, "kv_window_pool_tokens": window, "kv_cache_bytes": total,
            "kv_bytes_per_token": round(total / tokens, 1)}


def json_line(result: dict, sort_keys: bool = False) -> str:
    """One JSON object on one line, a NaN or infinity (a mean of nothing, a ratio over zero) written as null:
    json.dumps would write NaN, which JSON does not have."""
    return json.dumps(_finite(result), sort_keys=sort_keys, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def emit(result: dict) -> None:
    print(json_line(result | environment(), sort_keys=True), flush=True)
