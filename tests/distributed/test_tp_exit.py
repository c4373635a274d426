"""A tensor-parallel run that ends well ends quietly: `nanoserve generate --tensor-parallel-size 2` exits 0 with no
ERROR line, its ranks stopped by the engine before the interpreter's exit rather than killed by it."""

import os
import subprocess
import sys

# cli.main as `nanoserve` runs it, plus a probe registered before the engine starts: at exit it runs after the
# engine's own stop and before multiprocessing's hook, which would kill ranks still alive (a lost rank's ERROR).
SCRIPT = """
import atexit, multiprocessing, multiprocessing.util, sys
from nanoserve import cli
atexit.register(lambda: print(f"ranks alive at exit: {len(multiprocessing.active_children())}", file=sys.stderr))
sys.exit(cli.main(sys.argv[1:]))
"""


def test_generate_with_two_ranks_exits_quietly(llama_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, "generate", "--model", str(llama_dir), "--device", "cpu",
                           "--tensor-parallel-size", "2", "--prompt", "hi", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 generated" in done.stderr
    assert "ranks alive at exit: 0" in done.stderr, done.stderr[-2000:]
    assert not [line for line in done.stderr.splitlines() if " ERROR " in line], done.stderr[-2000:]
