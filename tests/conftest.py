"""Shared fixtures: small real checkpoints of every architecture, written once per session."""

import os
from pathlib import Path

import pytest
import torch
from checkpoints import ARCHS, write_checkpoint

# Triton decides between compiler and interpreter when a kernel is defined: before any test imports one.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: write_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"]


@pytest.fixture(scope="module")
def one_thread():
    """One OpenMP thread: on a small shared CPU, more make the bundled tiny model much slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_per_rank():
    """On 2 cores, tensor-parallel ranks that each run torch's default thread count oversubscribe them (a TP=2 step
    took ~50x longer): one thread per process, here and (through the environment) in the spawned ranks."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env
