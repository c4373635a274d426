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
