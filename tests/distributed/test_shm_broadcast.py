"""ShmBroadcast between real processes (spawned, as tensor-parallel ranks are): every reader gets every message, in
order, whatever its size (chunked through a ring of small slots), over many rounds that wrap the ring; stop ends the
readers; a dead writer or reader raises in the one left waiting instead of hanging it. The children are in
shm_children.py."""

import dataclasses
import multiprocessing as mp
from multiprocessing import resource_tracker

import numpy as np
import pytest
from shm_children import reader_main, sleeping_writer

from nanoserve.distributed.shm_broadcast import PeerGone, ShmBroadcast, ShmHandle

SLOT = 256  # bytes: tiny slots, so that the sizes below span one slot, several, and more than the whole ring
SIZES = [0, 1, 100, SLOT - 16, SLOT - 15, 3 * SLOT, 10 * SLOT + 7]
ROUNDS = 60


def message(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_readers_get_every_message_in_order():
    ctx = mp.get_context("spawn")
    writer = ShmBroadcast.create(num_readers=2, num_slots=3, slot_bytes=SLOT)
    results = ctx.Queue()
    procs = [ctx.Process(target=reader_main, args=(dataclasses.astuple(writer.handle), r, results)) for r in range(2)]
    for p in procs:
        p.start()
    sent = [message(i, SIZES[i % len(SIZES)]) for i in range(ROUNDS)]
    for i, msg in enumerate(sent):
        # Some as numpy arrays of int64, as StepInputs sends them.
        writer.write(np.frombuffer(msg, np.uint8) if i % 2 else msg, timeout=30)
    writer.write(np.arange(5, dtype=np.int64), timeout=30)
    writer.stop(timeout=30)
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    want = sent + [np.arange(5, dtype=np.int64).tobytes()]
    assert sorted(got) == [0, 1]
    for r in range(2):
        assert got[r] == want
    # The readers are gone: once the ring is full, the writer says so instead of waiting for them forever.
    for _ in range(3):
        writer.write(b"z")
    with pytest.raises(PeerGone, match="reader 0"):
        writer.write(b"z", timeout=30)
    writer.close()


def test_dead_writer_fails_the_reader():
    # The child shares this process's resource tracker (started first), so that the segment it leaves is unlinked
    # here, below, rather than reported as leaked at exit.
    resource_tracker.ensure_running()
    ctx = mp.get_context("spawn")
    handles = ctx.Queue()
    proc = ctx.Process(target=sleeping_writer, args=(handles,))
    proc.start()
    reader = ShmBroadcast.attach(ShmHandle(*handles.get(timeout=60)), 0)
    proc.kill()
    proc.join()
    with pytest.raises(PeerGone, match="the writer"):
        reader.read(timeout=30)
    reader.shm.unlink()
    reader.close()


def test_timeouts_and_bad_arguments():
    writer = ShmBroadcast.create(num_readers=1, num_slots=1, slot_bytes=SLOT)
    reader = ShmBroadcast.attach(writer.handle, 0)
    with pytest.raises(TimeoutError, match="writer's next message"):
        reader.read(timeout=0.05)
    writer.write(b"x")
    with pytest.raises(TimeoutError, match="release a slot"):
        writer.write(b"y", timeout=0.05)
    assert reader.read() == b"x"
    writer.write(b"y")  # the slot is free again
    assert reader.read() == b"y"
    with pytest.raises(ValueError, match="reader 1 of 1"):
        ShmBroadcast.attach(writer.handle, 1)
    with pytest.raises(ValueError, match="slot_bytes"):
        ShmBroadcast.create(num_readers=1, slot_bytes=12)
    reader.close()
    writer.close()
