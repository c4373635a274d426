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


def test_profile_splits_a_decode_step_by_kind(capsys: pytest.CaptureFixture, tmp_path) -> None:
    trace = tmp_path / "trace.json"
    result = run_bench(capsys, "--profile", "--profile-steps", "3", "--profile-trace", str(trace))
    per_step = result["profile_us_per_step"]
    assert result["profile_steps"] == 3
    # The model's projections are matmuls; one rank has nothing to reduce.
    assert per_step["matmul"] > 0 and per_step["collective"] == 0
    assert result["profile_top_us_per_step"][0][1] > 0
    assert "traceEvents" in json.loads(trace.read_text())


def test_profile_counts_the_all_reduces_of_two_ranks(capsys: pytest.CaptureFixture, llama_dir) -> None:
    result = run_bench(capsys, "--model", str(llama_dir), "--profile", "--profile-steps", "2",
                       "--tensor-parallel-size", "2")
    assert result["tensor_parallel_size"] == 2
    assert result["profile_us_per_step"]["collective"] > 0
    # Not only the step inputs' broadcast: the layers' all-reduces, gloo's slowest operator here by far.
    assert any("allreduce" in name for name, _ in result["profile_top_us_per_step"])


@pytest.mark.parametrize(("name", "kind"), [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("_decode_rope_split_kernel", "attention"), ("_prefill_attention_kernel", "attention"),
    ("_skinny_linear_kernel", "matmul"), ("_silu_mul_gemv_kernel", "matmul"), ("nvjet_tst_128x64_64x8", "matmul"),
    ("aten::addmm", "matmul"), ("aten::mm", "matmul"), ("cublasLt::splitKreduce_kernel", "matmul"),
    ("c10d::allreduce_", "collective"), ("_rms_norm_kernel", "other"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>", "collective"),
    ("aten::index", "other"),
    ("aten::broadcast_tensors", "other"), ("comm_kernel", "other"),
])
def test_kernels_are_grouped_by_name(name: str, kind: str) -> None:
    from nanoserve.bench.device_profile import kind_of

    assert kind_of(name) == kind


def test_speculative_run_reports_acceptance(capsys: pytest.CaptureFixture) -> None:
    # A 3-token stretch repeated: n-gram drafts find a match at every step.
    result = run_bench(capsys, "--prompt-period", "3", "--output-len", "12", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert result["speculative_config"]["num_speculative_tokens"] == 3
    assert result["spec_num_drafts"] > 0 and 1 <= result["mean_acceptance_length"] <= 4
    assert result["ms_per_step"] > 0


def test_draft_every_step_makes_every_decode_step_a_verify_step(capsys: pytest.CaptureFixture) -> None:
    result = run_bench(capsys, "--draft-every-step", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 2}')
    # Every step after the first token drafts 2 (capped near max_tokens).
    assert result["draft_every_step"] and result["spec_num_drafts"] >= 2
    assert result["spec_draft_tokens_per_draft"] > 1


def test_draft_model_stays_in_place_under_draft_every_step(capsys: pytest.CaptureFixture) -> None:
    """The bundled model as its own draft: every draft accepted, so the draft model (not the last-token stand-in)
    drafted."""
    from nanoserve.config import bundled_model_dir

    result = run_bench(capsys, "--output-len", "11", "--draft-every-step", "--speculative-config",
                       json.dumps({"model": bundled_model_dir(), "num_speculative_tokens": 2}))
    assert result["spec_num_drafts"] > 0 and result["mean_acceptance_length"] == 3.0
