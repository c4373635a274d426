"""`nanoserve bench latency` on the CPU with the bundled model: its batch flag and the JSON line it ends with."""

import json

import pytest

from nanoserve.cli import main


def run_bench(capsys: pytest.CaptureFixture, *flags: str) -> dict:
    assert main(["bench", "latency", "--device", "cpu", "--dtype", "float32", "--input-len", "5",
                 "--output-len", "6", "--iters", "1", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_batch_of_three_decodes_together(capsys: pytest.CaptureFixture) -> None:
    result = run_bench(capsys, "--batch-size", "3")
    assert result["bench"] == "latency" and result["batch_size"] == 3
    # Three sequences a step: tok/s counts all of them against one step's time.
    assert result["tok_s"] == pytest.approx(3e3 / result["ms_per_token"], rel=0.01)


def test_batch_size_defaults_to_one(capsys: pytest.CaptureFixture) -> None:
    result = run_bench(capsys)
    assert result["batch_size"] == 1
    assert result["tok_s"] == pytest.approx(1e3 / result["ms_per_token"], rel=0.01)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_batch_size_is_refused_naming_the_flag(capsys: pytest.CaptureFixture, value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", "--device", "cpu", "--batch-size", value])
    assert exc.value.code == 2
    assert "--batch-size" in capsys.readouterr().err
