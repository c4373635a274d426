"""`nanoserve bench ...` as a user runs it, on the CPU with the bundled model: config errors in one line (exit 2),
lengths fitted to the model's 512-token context, and only what ran in the JSON line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.cli import main

REPO = Path(__file__).resolve().parents[1]


def nanoserve(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("kind", ["throughput", "multi-turn"])
def test_a_config_error_is_one_line_and_exit_2(kind: str) -> None:
    run = nanoserve("bench", kind, "--model", "no/such/dir")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == "error: model: 'no/such/dir' is not a directory (no model hub is used; give a " \
                                 "local path)", run.stderr


def test_a_given_length_over_the_context_names_its_flag() -> None:
    run = nanoserve("bench", "latency", "--device", "cpu", "--input-len", "600", "--iters", "1")
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --input-len 600: need 602 tokens") and "max_model_len 512" in last
    assert "Traceback" not in run.stderr


def test_a_model_without_weights_names_the_cli_flag(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((REPO / "nanoserve" / "assets" / "config.json").read_text())
    run = nanoserve("generate", "--model", str(tmp_path), "--prompt", "Hi", "--load-format", "auto")
    assert run.returncode == 2 and "(use --load-format dummy" in run.stderr, run.stderr


def test_throughput_defaults_are_scaled_to_the_bundled_models_context(capsys: pytest.CaptureFixture) -> None:
    # The input lengths given, the output lengths left to the recipe (100-1024): scaled to what is left of 512.
    assert main(["bench", "throughput", "--num-prompts", "3", "--input-len", "400", "420"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["input_len"] == [400, 420] and result["output_len"][1] <= 512 - 420
    assert result["output_tokens"] > 0 and result["max_model_len"] == 512
    assert "scaled by" in err and "--output-len" in err


def test_latency_reports_the_lengths_and_dtype_that_ran(capsys: pytest.CaptureFixture) -> None:
    # --input-len 500 leaves the recipe's 512 output tokens room for 12: that is what ran, and what is reported.
    assert main(["bench", "latency", "--input-len", "500", "--iters", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["input_len"] == 500 and result["output_len"] == 12
    assert result["dtype"] == "float32"  # what serve runs on the CPU, not bfloat16


def _help(capsys: pytest.CaptureFixture, command: str) -> str:
    # In this process: a subprocess per --help spent its ~2.5 s importing; the subprocess runs above show the CLI
    # as a user starts it.
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_lists_only_the_flags_that_apply(capsys: pytest.CaptureFixture, command: str) -> None:
    text = _help(capsys, command)
    assert "--max-num-seqs" in text and "--temperature" in text
    for serving_only in ("--host", "--port", "--api-key", "--engine-process", "--profile-engine",
                         "--api-server-count", "--served-model-name"):
        assert serving_only not in text, serving_only
    assert "--engine-process" in _help(capsys, "serve")
