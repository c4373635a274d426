"""ShmBroadcast: one writer hands byte messages to the other processes of its node through a ring of slots in shared
memory (rank 0's step inputs to the other tensor-parallel ranks of its node).

A gloo broadcast of each step costs a round of TCP messages through the kernel on the host's critical path; here the
writer copies the message into a slot and bumps a counter, and each reader sees the counter change by polling.

Layout (all int64 counters, then the slots):
  writer pid | reader pids [num_readers] | per slot: written [1], acked [num_readers] | slot payloads
A message is cut into chunks of at most slot_bytes - 16; chunk k (1, 2, ...) goes to slot (k - 1) % num_slots, as a
16-byte header (the message's total length, or STOP; the chunk's length) and its bytes. The writer publishes chunk k
by setting the slot's `written` to k after the bytes are in; reader r releases it by setting its `acked` to k. The
writer reuses a slot for chunk k only when every reader has acked chunk k - num_slots. Each counter has one writing
process, so no lock is needed; that the bytes are visible before the counter relies on the CPU keeping stores in
order (x86-64; vLLM's shm broadcast relies on the same).

Waiting polls (yielding the core to anything else runnable) for SPIN_S, then sleeps with a growing interval, up to
MAX_SLEEP_S, so that an idle rank does not burn a core. The polling window is long against a step (a few ms): while
the engine is busy, the next step's inputs come within it, and a reader that slept would wake up to a millisecond
late, with its GPU idle meanwhile. A waiter checks that its
peers are alive while it sleeps: a dead writer or reader raises PeerGone instead of leaving the other side waiting
forever; `timeout` bounds a wait in any case.
"""

import os
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

_CHUNK_HEADER = 16  # total length (or _STOP), this chunk's length: two int64
_STOP = -1
SPIN_S = 0.05  # polling before the first sleep
MAX_SLEEP_S = 1e-3  # an idle reader wakes at most this often
PEER_CHECK_S = 0.5  # how often a waiter looks for dead peers


class PeerGone(RuntimeError):
    """The process on the other side of the ring has exited."""


@dataclass(frozen=True)
class ShmHandle:
    """What a reader needs to attach (picklable: it goes to a spawned process as an argument)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not attached yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent's wait is missing
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class ShmBroadcast:
    """One end of the ring: create() makes the writer's, attach() a reader's. Not thread-safe: one thread an end."""

    def __init__(self, shm: shared_memory.SharedMemory, handle: ShmHandle, reader: int | None) -> None:
        self.shm, self.handle, self.reader = shm, handle, reader
        n, slots = handle.num_readers, handle.num_slots
        counters = np.ndarray((1 + n + slots * (1 + n),), np.int64, shm.buf)
        self._pids = counters[: 1 + n]
        per_slot = counters[1 + n :].reshape(slots, 1 + n)
        self._written, self._acked = per_slot[:, 0], per_slot[:, 1:]
        self._data = np.ndarray((slots, handle.slot_bytes), np.uint8, shm.buf, offset=counters.nbytes)
        self._next = 1  # the next chunk to write or read
        self._pids[0 if reader is None else 1 + reader] = os.getpid()

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 4, slot_bytes: int = 1 << 20) -> "ShmBroadcast":
        """The writer's end: a new ring for num_readers readers. Raises OSError where shared memory is unavailable."""
        if num_readers < 1 or num_slots < 1 or slot_bytes <= _CHUNK_HEADER or slot_bytes % 8:
            raise ValueError(
                f"ShmBroadcast: num_readers {num_readers}, num_slots {num_slots}, slot_bytes "
                f"{slot_bytes}: need at least one reader and slot, and slots of 8-byte words > 16 bytes"
            )
        size = 8 * (1 + num_readers + num_slots * (1 + num_readers)) + num_slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = bytes(size)
        return cls(shm, ShmHandle(shm.name, num_readers, num_slots, slot_bytes), None)

    @classmethod
    def attach(cls, handle: ShmHandle, reader: int) -> "ShmBroadcast":
        """Reader `reader` (0 .. num_readers - 1)'s end of the writer's ring."""
        if not 0 <= reader < handle.num_readers:
            raise ValueError(f"ShmBroadcast: reader {reader} of {handle.num_readers}")
        # Not registered with Python's resource tracker, which would unlink the segment when this process exits, or
        # (a tracker shared with the writer, as spawned children share it) drop the writer's registration: the
        # writer owns it. track= exists from Python 3.13.
        try:
            shm = shared_memory.SharedMemory(name=handle.name, track=False)
        except TypeError:
            register = resource_tracker.register
            resource_tracker.register = lambda name, rtype: None
            try:
                shm = shared_memory.SharedMemory(name=handle.name)
            finally:
                resource_tracker.register = register
        return cls(shm, handle, reader)

    # -- writer ------------------------------------------------------------------------------------------------
    def write(self, message: bytes | memoryview | np.ndarray, timeout: float | None = None) -> None:
        """Hand `message` to every reader, in chunks when it is larger than a slot; returns once it is in the ring
        (not when the readers have it). Waits while the ring is full."""
        data = np.frombuffer(memoryview(message).cast("B"), np.uint8)
        room = self.handle.slot_bytes - _CHUNK_HEADER
        at = 0
        while True:
            n = min(room, len(data) - at)
            self._put(len(data), data[at : at + n], timeout)
            at += n
            if at >= len(data):
                return

    def stop(self, timeout: float | None = None) -> None:
        """Tell every reader that no message follows: their read() returns None."""
        self._put(_STOP, np.empty(0, np.uint8), timeout)

    def _put(self, total: int, chunk: np.ndarray, timeout: float | None) -> None:
        assert self.reader is None, "a reader cannot write"
        k, slots = self._next, self.handle.num_slots
        slot = (k - 1) % slots
        self._wait(lambda: self._acked[slot].min() >= k - slots, timeout, "readers to release a slot")
        header = self._data[slot, :_CHUNK_HEADER].view(np.int64)
        header[0], header[1] = total, len(chunk)
        self._data[slot, _CHUNK_HEADER : _CHUNK_HEADER + len(chunk)] = chunk
        self._written[slot] = k  # last: publishes the chunk
        self._next = k + 1

    # -- reader ------------------------------------------------------------------------------------------------
    def read(self, timeout: float | None = None) -> bytearray | None:
        """The next message (a copy: its slots are released before this returns), or None once the writer stopped."""
        assert self.reader is not None, "the writer cannot read"
        out, at = None, 0
        while True:
            k = self._next
            slot = (k - 1) % self.handle.num_slots
            self._wait(lambda slot=slot, k=k: self._written[slot] >= k, timeout, "the writer's next message")
            total, n = self._data[slot, :_CHUNK_HEADER].view(np.int64).tolist()
            if total == _STOP:
                out = None
            else:
                if out is None:
                    out = bytearray(total)
                out[at : at + n] = self._data[slot, _CHUNK_HEADER : _CHUNK_HEADER + n].data  # straight from the slot
                at += n
            self._acked[slot, self.reader] = k  # after the copy: releases the slot
            self._next = k + 1
            if out is None or at >= total:
                return out

    # -- both --------------------------------------------------------------------------------------------------
    def _wait(self, ready, timeout: float | None, what: str) -> None:
        if ready():
            return
        start = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now - start > SPIN_S:
                break
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"ShmBroadcast: waited {timeout:g} s for {what}")
            os.sched_yield()
        else:
            return
        sleep, last_check = 2e-5, start
        while not ready():
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"ShmBroadcast: waited {timeout:g} s for {what}")
            if now - last_check > PEER_CHECK_S:
                last_check = now
                self._check_peers(what)
            time.sleep(sleep)
            sleep = min(2 * sleep, MAX_SLEEP_S)

    def _check_peers(self, what: str) -> None:
        if self.reader is None:
            peers = [(f"reader {r}", int(p)) for r, p in enumerate(self._pids[1:].tolist())]
        else:
            peers = [("the writer", int(self._pids[0]))]
        for who, pid in peers:
            if not _pid_alive(pid):
                raise PeerGone(f"ShmBroadcast: {who} (pid {pid}) exited while waiting for {what}")

    def close(self) -> None:
        """Detach; the writer also removes the segment (readers that are still attached keep their mapping)."""
        if self.shm is None:
            return
        # numpy views pin the mapping: drop them before closing it.
        self._pids = self._written = self._acked = self._data = None
        self.shm.close()
        if self.reader is None:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
        self.shm = None
