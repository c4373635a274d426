"""`nanoserve bench multi-turn` on the CPU with the bundled model: the CPU tier serves histories the small GPU pool
lost, and the JSON line says so (the times are not asserted)."""

import json

import pytest

from nanoserve.cli import main


def test_the_cpu_tier_serves_what_the_gpu_pool_lost(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "multi-turn", "--device", "cpu", "--dtype", "float32", "--num-conversations", "6",
                 "--turns", "3", "--system-len", "48", "--question-len", "16", "--answer-len", "32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["bench"] == "multi-turn" and result["num_kv_blocks"] < 6 * (48 + 3 * 49) // 16
    assert result["cached_tokens_cpu_tier"] > result["cached_tokens_gpu_only"]
    assert result["cpu_prefix_hits"] > 0 and result["cpu_blocks_loaded"] > 0
    assert {"ttft_gpu_only_p50_ms", "ttft_cpu_tier_p50_ms", "ratio_p50"} <= result.keys()
