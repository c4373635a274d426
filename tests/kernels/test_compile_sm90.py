"""Every Triton kernel compiles for sm_90 (Hopper, the GPUs nanoserve is measured on) in the variants the engine
launches, checked on the CPU: the kernel tests here run under TRITON_INTERPRET=1, which accepts code that compiled
Triton rejects (b2e5343's prefill kernel passed them all and failed to compile on an H200).

The compiles run in one subprocess (tests/kernels/sm90_compile.py, variants in sm90_variants.py) without
TRITON_INTERPRET: conftest.py has set it in this process, and the kernel modules bind interpreter or compiler at
import. Triton's cache goes to a temporary directory, so every run compiles afresh.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("sm90_compile.py")
REPO = Path(__file__).resolve().parents[2]


def _nvidia_backend_missing() -> str | None:
    """Why sm_90 code cannot be built here, if it cannot: Triton without its NVIDIA backend or its ptxas."""
    from triton.backends import backends

    if "nvidia" not in backends:
        return "this Triton install has no NVIDIA backend"
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not (bundled.is_file() or os.environ.get("TRITON_PTXAS_PATH")):
        return "no ptxas: this Triton install bundles none and TRITON_PTXAS_PATH is unset"
    return None


def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    if reason := _nvidia_backend_missing():
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"the compile run failed:\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout)["results"]

    for r in results:
        if "skipped" in r:
            warnings.warn(f"sm_90 compile of {r['variant']} skipped: {r['skipped']}", stacklevel=1)
    failures = [f"{r['variant']}:\n  {failure}" for r in results for failure in r["failures"]]
    assert not failures, f"{len(failures)} kernel variant(s) do not compile for sm_90:\n" + "\n".join(failures)
    assert all(r["compiled"] or "skipped" in r for r in results), "a variant launched no kernel"
