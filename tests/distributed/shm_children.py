"""The processes test_shm_broadcast.py spawns. They load nanoserve/distributed/shm_broadcast.py alone, by its path:
importing it as nanoserve.distributed.shm_broadcast runs the package's __init__, which imports torch (seconds a
process on a 2-core machine, most of the test's time). Handles travel as plain tuples for the same reason."""

import dataclasses
import importlib.util
import time
from pathlib import Path

RING_FILE = Path(__file__).resolve().parents[2] / "nanoserve" / "distributed" / "shm_broadcast.py"


def ring_module():
    spec = importlib.util.spec_from_file_location("shm_broadcast_alone", RING_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reader_main(handle: tuple, index: int, results) -> None:
    """Read every message until the writer stops, then report them."""
    ring_mod = ring_module()
    ring = ring_mod.ShmBroadcast.attach(ring_mod.ShmHandle(*handle), index)
    got = []
    while (msg := ring.read(timeout=30)) is not None:
        got.append(bytes(msg))
    ring.close()
    results.put((index, got))


def sleeping_writer(handles) -> None:
    """Make a ring for one reader, give its handle, and never write (until killed)."""
    writer = ring_module().ShmBroadcast.create(num_readers=1, num_slots=2, slot_bytes=256)
    handles.put(dataclasses.astuple(writer.handle))
    time.sleep(60)
