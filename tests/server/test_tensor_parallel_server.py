"""The server with tensor parallelism (gloo on the CPU): the official client gets the same tokens as without it,
in both engine placements and with several API servers, and a lost rank ends the server non-zero, not in a hang."""

import os
import signal
import time

import httpx
import pytest
from processes import child_pids, is_alive


def _greedy(server, prompt: str, stream: bool) -> str:
    kwargs = dict(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
    if not stream:
        return server.client().completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in server.client().completions.create(**kwargs, stream=True) if c.choices)


@pytest.fixture(scope="module")
def reference(shared_server) -> dict[str, str]:
    server = shared_server("--no-engine-process")  # the shared server[thread]: one rank, nothing else
    return {p: _greedy(server, p, stream=False) for p in ("Hello world", "The quick brown fox")}


def _assert_matches(server, reference: dict[str, str]) -> None:
    for prompt, want in reference.items():
        assert _greedy(server, prompt, stream=False) == want
        assert _greedy(server, prompt, stream=True) == want


# The engine in a process of its own (--engine-process) is checked by test_killed_rank_ends_the_server_non_zero's
# process case, on the server it then ends; a clean stop of a TP engine in its own process, by two-api-servers'.
@pytest.mark.parametrize("flags", [["--no-engine-process"], ["--api-server-count", "2"]],
                         ids=["thread", "two-api-servers"])
def test_tensor_parallel_server_matches_one_rank(launch, reference, flags):
    server = launch("--tensor-parallel-size", "2", *flags)
    _assert_matches(server, reference)
    assert server.stop() == 0


def _tp_worker(server) -> int:
    """The pid of the rank-1 process: a child of the server (or of its engine process) running spawn_main."""
    for pid in [server.proc.pid, *child_pids(server.proc.pid)]:
        for child in child_pids(pid) if is_alive(pid) else []:
            cmdline = open(f"/proc/{child}/cmdline", "rb").read()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                if not child_pids(child) or pid != server.proc.pid:
                    return child
    raise AssertionError("no tensor-parallel worker process found")


@pytest.mark.parametrize("flags", [["--no-engine-process"], ["--engine-process"]], ids=["thread", "process"])
def test_killed_rank_ends_the_server_non_zero(launch, reference, flags):
    server = launch("--tensor-parallel-size", "2", *flags)
    _assert_matches(server, reference)
    os.kill(_tp_worker(server), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2},
                       timeout=5)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    assert server.proc.poll() == 1, server.log()[-3000:]
    assert "tensor-parallel rank 1 exited" in server.log()
