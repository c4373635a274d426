"""A CPU-only install has no Triton (only CUDA builds of torch bring it): the engine and the server must
import and run without it. Checked in a subprocess where importing triton fails."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
from nanoserve import LLM, SamplingParams
import nanoserve.server.app
out = LLM().generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == 4, out
print("ok")
"""


def test_engine_and_server_import_and_run_without_triton():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
