"""Helpers for tests that watch or break the server's processes (tests/ is on sys.path via its conftest)."""

import itertools
from pathlib import Path

import pytest


def child_pids(pid: int) -> list[int]:
    """Pids of pid's child processes, read from /proc (the test is skipped where there is none)."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        pytest.skip("needs /proc to find the server's child processes")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def fail_from_step(engine, n: int) -> None:
    """Installed in the engine process through setup(): step() raises from its n-th call on. (Module-level, so
    the engine process can unpickle it.)"""
    real_step, calls = engine.step, itertools.count(1)

    def step(*args, **kwargs):
        if next(calls) >= n:
            raise RuntimeError("boom")
        return real_step(*args, **kwargs)

    engine.step = step
