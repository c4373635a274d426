"""`nanoserve chat` in a pseudo-terminal: the bundled model answers through the calculator."""

import os
import sys
from pathlib import Path

import pexpect

REPO = Path(__file__).resolve().parents[1]


def test_chat_answers_through_the_calculator():
    # One OpenMP thread: on a small shared CPU, more make this tiny model much slower.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "nanoserve.cli", "chat", "--max-tokens", "48"], cwd=REPO,
                          env=env, encoding="utf-8", timeout=120)
    try:
        child.expect_exact("> ")
        child.sendline("What is 123*456?")
        child.expect_exact("What is 123*456?\r\n")  # the terminal's echo of the question
        child.expect_exact("\n> ")  # the streamed reply ends with the next prompt
        reply = child.before
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    # The tool call as the model wrote it, and the calculator's result forced into the answer.
    assert "[calculator: " in reply and "56088" in reply, reply
