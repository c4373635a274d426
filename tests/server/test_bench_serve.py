"""nanoserve.bench.serve against the test server: every request completes, one JSON line last."""

import json

from nanoserve.bench import serve


def test_bench_serve_reports_a_json_line(server, capsys):
    summary = serve.run(["--base-url", server.url, "--num-prompts", "6", "--input-len", "20", "--output-len",
                          "8", "--request-rate", "50", "--no-progress"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_throughput"] > 0 and summary["p99_itl_ms"] >= summary["p50_itl_ms"] > 0
