"""nanoserve.bench.serve against the test server (every request completes, one JSON line last), its summary of
failed requests, and `--launch` as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

from nanoserve.bench import serve
from nanoserve.bench.launch import free_port

REPO = Path(__file__).resolve().parents[2]


def test_bench_serve_reports_a_json_line(server, capsys):
    summary = serve.run(["--base-url", server.url, "--num-prompts", "6", "--input-len", "20", "--output-len",
                          "8", "--request-rate", "50", "--no-progress"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_throughput"] > 0 and summary["p99_itl_ms"] >= summary["p50_itl_ms"] > 0


def test_a_run_with_failures_says_how_many_and_why_and_has_no_nan(capsys):
    args, _ = serve.parse_args(["--num-prompts", "3", "--input-len", "4", "--output-len", "2"])
    failed = [serve.RequestResult(error="HTTP 400: prompt too long")] * 2 + [serve.RequestResult(error="reset")]
    summary = serve.summarize(args, {"id": "m", "max_model_len": 512}, failed, 1.0, 0.1)
    line = json.loads(serve.json_line(summary))  # json.loads accepts NaN: look for null instead
    assert line["completed"] == 0 and line["failed"] == 3 and line["p50_ttft_ms"] is None
    assert line["errors"] == {"HTTP 400: prompt too long": 2, "reset": 1}
    assert "NaN" not in serve.json_line(summary)


def bench_serve(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "nanoserve.cli", "bench", "serve", "--launch", "--no-progress",
                           "--launch-timeout", "120", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_launch_uses_the_port_given():
    # The recipe's 512 + 128 tokens do not fit the bundled model's 512: scaled down, every request completes.
    port = free_port("127.0.0.1")
    run = bench_serve("--port", str(port), "--num-prompts", "2", "--device", "cpu")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["completed"] == 2 and summary["input_len"] + summary["output_len"] <= 512
    launching = next(line for line in run.stderr.splitlines() if line.startswith("launching:"))
    assert launching.count("--port") == 1 and f"--port {port}" in launching
    assert f"on http://127.0.0.1:{port}" in run.stderr  # the server's own log line


def test_a_launched_server_that_exits_fails_at_once_with_its_last_lines():
    run = bench_serve("--model", "no/such/dir")
    assert run.returncode == 2, run.stderr
    assert "the launched server exited with status 2 before it answered; its last lines:" in run.stderr
    assert "error: model: 'no/such/dir' is not a directory" in run.stderr.split("its last lines:")[1]
    assert "Traceback" not in run.stderr
