"""`nanoserve bench long-context` on the CPU with the bundled model: a prompt three times the GPU pool runs in
long-context mode beside a pool that holds it, and the JSON line has both runs (the times are not asserted)."""

import json

import pytest

from nanoserve.cli import main


def test_both_runs_are_reported(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "long-context", "--device", "cpu", "--dtype", "float32", "--prompt-lens", "300",
                 "--output-len", "4", "--gpu-kv-tokens", "96", "--block-size", "16"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "long-context" and result["gpu_kv_tokens"] == 96 and result["kv_offload_gb"] > 0
    for key in ("prefill_tok_s_offload_300", "prefill_tok_s_gpu_300", "decode_tok_s_offload_300",
                "decode_tok_s_gpu_300", "prefill_ratio_300", "decode_ratio_300"):
        assert result[key] > 0
