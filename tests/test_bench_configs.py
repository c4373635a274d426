"""The benchmarks' commands run from a clone: the model configs they name are in the repository's
benchmarks/configs (not a directory beside it), each one a config nanoserve reads, and BENCHMARKS.md stays a
dashboard."""

import re
from pathlib import Path

import pytest

from nanoserve import EngineArgs

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "benchmarks" / "configs"
MARKDOWN = [*REPO.glob("docs/*.md"), *REPO.glob("benchmarks/*.md")]
DOCS = ["BENCHMARKS.md", "README.md", "scripts/gpu_bench.sh", *(p.relative_to(REPO) for p in MARKDOWN)]


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_docs_name_configs_in_the_repository(doc) -> None:
    text = (REPO / doc).read_text()
    assert "bench-configs" not in text and "DESIGN.md" not in text
    text = text.replace("$cfg/", "benchmarks/configs/")  # gpu_bench.sh: cfg=benchmarks/configs
    for name in re.findall(r"benchmarks/configs/([\w.-]+)", text):
        assert (CONFIGS / name).exists(), f"{doc} names benchmarks/configs/{name}"


@pytest.mark.parametrize("model", sorted(p.parent.name for p in CONFIGS.glob("*/config.json")))
def test_every_benchmark_config_is_one_nanoserve_reads(model) -> None:
    config = EngineArgs(model=str(CONFIGS / model), device="cpu", load_format="dummy").create_config()
    assert config.model.num_hidden_layers > 0


def test_benchmarks_md_is_a_dashboard() -> None:
    assert len((REPO / "BENCHMARKS.md").read_text().splitlines()) < 200
