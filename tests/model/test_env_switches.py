"""Environment switches of the model code are checked when it is imported: a typo must not silently pick a path."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("value,ok", [("auto", True), ("0", True), ("1", True), ("yes", False), ("", False)])
def test_fused_rope_decode_switch(value, ok):
    env = {**os.environ, "NANOSERVE_FUSED_ROPE_DECODE": value}
    done = subprocess.run([sys.executable, "-c", "import nanoserve.model.llama as m; print(m.FUSED_ROPE_DECODE)"],
                          env=env, capture_output=True, text=True)  # fmt: skip
    if ok:
        assert done.returncode == 0 and done.stdout.strip() == value
    else:
        assert done.returncode != 0
        assert "ValueError: NANOSERVE_FUSED_ROPE_DECODE must be auto, 0 or 1" in done.stderr
