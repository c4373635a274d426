"""What every benchmark shares: engine flags, the device's name, the commit, the closing JSON line."""

import argparse
import gc
import json
import os
import subprocess
from pathlib import Path

import torch

from nanoserve.cli import add_engine_args, engine_args_from
from nanoserve.config import EngineArgs


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    add_engine_args(p)
    p.set_defaults(dtype="bfloat16")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    return p


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    args = engine_args_from(ns)
    # The shared bench configs carry no weights: random ones of the right shapes then.
    if args.model and args.load_format == "auto" and not any(Path(args.model).glob("*.safetensors")):
        args.load_format = "dummy"
    return args


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


def emit(result: dict) -> None:
    print(json.dumps(result | environment(), sort_keys=True), flush=True)
