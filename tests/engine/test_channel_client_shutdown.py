"""A ChannelEngineClient's channel fd (runtime/process_client.py) is closed only once no thread of the client can
write to it: shutdown waits for its writer, so the holder of the engine's channels (EngineCoreProcess.close) may
close them right after it, and a broken reader hangs the channel up without freeing the fd's number.

The race it closes, seen once in CI: a writer woke to send the Stop of shutdown(), read the fd number and lost the
CPU before its write(2); the test's teardown closed the channel, the next test's engine channel took the freed
number, and the late Stop reached that engine, which closed the channel as a client that had left."""

import multiprocessing
import os
import socket
import time
from multiprocessing.connection import Connection

import pytest

from nanoserve.runtime.channels import Ready, Step
from nanoserve.runtime.engine_core import EngineStats
from nanoserve.runtime.process_client import ChannelEngineClient


class _PreemptedConnection(Connection):
    """Each send reads the fd number, then pauses before writing, as a thread the OS preempted there."""

    def _send(self, buf, write=os.write):
        handle = self._handle
        time.sleep(0.3)  # a window wide enough that a close and a new pipe fit in it on any machine
        write(handle, buf)


def test_no_send_lands_on_the_fd_number_after_shutdown():
    ours, theirs = socket.socketpair()
    theirs.close()  # the engine process has exited (as after a step failure): the Stop's send fails
    conn = _PreemptedConnection(ours.detach())
    fd = conn.fileno()
    client = ChannelEngineClient(conn, Ready(config=None, stats=EngineStats()), tokenizer=None)
    client.shutdown()
    conn.close()  # what EngineCoreProcess.close does to the channels it started
    # The next pipe the process opens takes the lowest free numbers: the freed one (made sure of with dup2).
    reused, peer = multiprocessing.Pipe()
    if reused.fileno() != fd:
        os.dup2(reused.fileno(), fd)
        reused.close()
        reused = Connection(fd)
    client._writer.join()  # its send, if still to come (none once shutdown waits for it), lands before the check
    try:
        assert not peer.poll(), f"a send of the shut-down client reached the new pipe: {peer.recv()!r}"
    finally:
        reused.close()
        peer.close()


def _reader_bug(msg) -> None:
    raise TypeError("a bug in the reader")


def test_a_broken_reader_hangs_up_but_keeps_the_fd_number():
    ours, theirs = multiprocessing.Pipe()
    fd, inode = ours.fileno(), os.fstat(ours.fileno()).st_ino
    client = ChannelEngineClient(ours, Ready(config=None, stats=EngineStats()), tokenizer=None)
    client._on_step = _reader_bug
    theirs.send(Step([], [], EngineStats()))
    client._reader.join()
    # The engine sees its client leave, and its sends fail rather than fill a channel nobody reads ...
    with pytest.raises(EOFError):
        theirs.recv()
    with pytest.raises(BrokenPipeError):
        theirs.send(Step([], [], EngineStats()))
    # ... while the number stays this channel's: the writer may hold it (as in the test above).
    assert os.fstat(fd).st_ino == inode
    client.shutdown()
    assert ours.closed
    theirs.close()
