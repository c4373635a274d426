"""Helpers for tests that watch or break the server's processes (tests/ is on sys.path via its conftest)."""

import itertools
import time
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


def _raise_when(engine, condition) -> None:
    """engine.step raises RuntimeError("boom") whenever condition() is true, before stepping."""
    real_step = engine.step

    def step(*args, **kwargs):
        if condition():
            raise RuntimeError("boom")
        return real_step(*args, **kwargs)

    engine.step = step


def fail_from_step(engine, n: int) -> None:
    """Installed in the engine process through setup(): step() raises from its n-th call on. (Module-level, so
    the engine process can unpickle it.)"""
    calls = itertools.count(1)
    _raise_when(engine, lambda: next(calls) >= n)


def fail_once_running(engine, n: int) -> None:
    """Installed through setup(): step() raises once n sequences are running, that is, after a step that ran them
    all has published its stats (a step count would race requests that reach the engine late)."""
    _raise_when(engine, lambda: len(engine.scheduler.running) >= n)


def pace_steps(engine, seconds: float) -> None:
    """Installed in the engine process through setup(): every step() first sleeps `seconds`, so a test's requests
    are still running when it acts on them however fast the machine decodes; 0 puts the real step() back."""
    vars(engine).pop("step", None)
    if seconds > 0:
        real_step = engine.step

        def step(*args, **kwargs):
            time.sleep(seconds)
            return real_step(*args, **kwargs)

        engine.step = step
