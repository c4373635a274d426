"""What a new user meets first: the CLI's help and flags, vLLM's habits, the start-up log, clear errors for
unsupported checkpoints, Ctrl-C, and the calculator in LLM.chat."""

import json
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pexpect
import pytest
import torch

import nanoserve
from nanoserve import LLM, EngineArgs, SamplingParams, cli
from nanoserve.args import SERVING_ONLY
from nanoserve.chat_engine import ToolLoop
from nanoserve.config import bundled_model_dir
from nanoserve.engine.frontend import EngineFrontend, engine_config, load_tokenizer
from nanoserve.engine.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is 12*34?"}]
GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768,
               "n_head": 12, "n_layer": 12, "n_positions": 1024, "eos_token_id": 50256}


@pytest.fixture(scope="module")
def bundled(one_thread) -> LLM:
    return LLM(num_kv_blocks=64)


def bundled_copy(path: Path, tokenizer: bool = True, **config) -> Path:
    """The bundled model's config (and tokenizer) in a directory of its own, with `config` changed."""
    path.mkdir()
    assets = Path(bundled_model_dir())
    raw = json.loads((assets / "config.json").read_text()) | config
    (path / "config.json").write_text(json.dumps(raw))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(assets / name, path / name)
    return path


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def option_entries(text: str) -> dict[str, str]:
    """--help's options, each flag with its entry (the help joined onto one line)."""
    entries = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries if entry.strip()}


# -- 1. help, --version, serve MODEL, bench KIND --help, README ------------------------------------------

@pytest.mark.parametrize("command", [["serve"], ["generate"], ["chat"], ["bench", "throughput"],
                                     ["bench", "latency"], ["bench", "prefix"], ["bench", "serve"],
                                     ["bench", "multi-turn"], ["bench", "long-context"], ["router"]])
def test_every_flag_has_help_that_shows_its_default(capsys, command):
    entries = option_entries(help_text(capsys, *command))
    for flag, entry in entries.items():
        if flag in ("-h", "--prompt"):  # --prompt is required: it has no default
            continue
        assert "(default:" in entry, entry
        assert len(entry.split("(default:")[0]) > len(flag) + 10, f"{flag} has no help of its own: {entry}"
    if command not in (["bench", "serve"], ["router"]):
        # Every engine flag, but those only a server reads on the commands that run no server.
        names = [n for n in EngineArgs.field_names() if command == ["serve"] or n not in SERVING_ONLY]
        assert {"--" + name.replace("_", "-") for name in names} <= set(entries)


def test_every_engine_arg_has_a_help_line():
    import dataclasses

    for f in dataclasses.fields(EngineArgs):
        assert f.metadata.get("help"), f.name


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"nanoserve {nanoserve.__version__}"


@pytest.mark.parametrize("kind,own_flag", [("latency", "--batch-size"), ("serve", "--request-rate"),
                                           ("throughput", "--num-prompts"), ("prefix", "--shared-len")])
def test_bench_help_shows_the_benchmarks_own_flags(capsys, kind, own_flag):
    text = help_text(capsys, "bench", kind)
    assert text.startswith(f"usage: nanoserve bench {kind}") and own_flag in text


@pytest.fixture
def served(monkeypatch) -> dict:
    """`nanoserve serve` with run_server replaced: what it was called with."""
    import nanoserve.server.app

    calls = {}

    def fake_run_server(engine_args, **kwargs):
        calls.update(kwargs, engine_args=engine_args)
        return 0

    monkeypatch.setattr(nanoserve.server.app, "run_server", fake_run_server)
    return calls


@pytest.mark.parametrize("argv", [["serve", "some/dir"], ["serve", "--model", "some/dir"],
                                  ["serve", "some/dir", "--model", "some/dir"], ["serve", "--port", "9", "some/dir"]])
def test_serve_takes_the_model_as_an_argument_or_a_flag(served, argv):
    assert cli.main(argv) == 0
    assert served["engine_args"].model == "some/dir"


def test_serve_with_two_different_models_is_an_error(served, capsys):
    assert cli.main(["serve", "a", "--model", "b"]) == 2
    assert "model: given twice" in capsys.readouterr().err and not served


def test_readme_names_only_paths_in_the_repo():
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)]+)\)", readme):
        assert (REPO / target).exists(), target
    for name in re.findall(r"`([\w./-]+\.(?:py|md))`", readme):
        assert (REPO / name).exists() or (REPO / "nanoserve" / name).exists(), name
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S))
    assert "../" not in commands and "shared/" not in commands


def test_docs_name_only_scripts_in_the_repo():
    """A script the docs cite is in scripts/, or cited at the commit that had it (`scripts/x.py` at 32a2823)."""
    for doc in (REPO / "docs").glob("*.md"):
        for path, commit in re.findall(r"`[^`]*?(scripts/[\w./-]+)[^`]*`( at [0-9a-f]{7,})?", doc.read_text()):
            assert commit or (REPO / path).exists(), f"{doc.name}: {path}"


def test_readme_completion_example_prints_what_it_shows(bundled):
    """The README's completion on the bundled chat model: a prompt it completes sensibly ("Hello" gave "HHHH..."),
    and the text its comment shows."""
    readme = (REPO / "README.md").read_text()
    prompt, shown = re.search(r'llm\.generate\(\["([^"]+)"\].*\nprint\(out\[0\]\.outputs\[0\]\.text\) +# (.+)\n',
                              readme).groups()
    out = bundled.generate([prompt], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert out[0].outputs[0].text.strip() == shown.strip()


# -- 2. vLLM's flags ------------------------------------------------------------------------------------

def test_serve_passes_the_server_flags_on(served):
    assert cli.main(["serve", "--served-model-name", "a", "b", "--uvicorn-log-level", "debug",
                     "--disable-log-requests"]) == 0
    assert served["served_model_name"] == ["a", "b"]
    assert served["uvicorn_log_level"] == "debug" and served["disable_log_requests"] is True
    assert cli.main(["serve"]) == 0
    assert served["served_model_name"] is None
    assert served["uvicorn_log_level"] == "info" and served["disable_log_requests"] is False


def test_uvicorn_log_level_takes_only_its_levels(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--uvicorn-log-level", "verbose"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("name,dtype", [
    ("half", torch.float16), ("fp16", torch.float16), ("float16", torch.float16),
    ("float", torch.float32), ("fp32", torch.float32), ("float32", torch.float32),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)])
def test_dtype_aliases(name, dtype):
    assert EngineArgs(dtype=name, device="cpu").create_config().dtype == dtype


def test_an_unknown_dtype_names_the_field():
    with pytest.raises(ValueError, match="^dtype: must be auto, float16 \\(or half, fp16\\)"):
        EngineArgs(dtype="fp8").create_config()


def frontend(**args) -> EngineFrontend:
    config = EngineArgs(device="cpu", **args).create_config()
    return EngineFrontend(config, load_tokenizer(config.tokenizer_dir))


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def test_chat_template_inline_or_from_a_file(tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    inline = frontend(chat_template=TEMPLATE)
    assert inline.tokenizer.decode(inline.apply_chat_template(messages)) == "[user] hi\n"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    from_file = frontend(chat_template=str(tmp_path / "t.jinja"))
    assert from_file.tokenizer.decode(from_file.apply_chat_template(messages)) == "user: hi\n"
    # Without one, the tokenizer's own template.
    own = frontend()
    assert own.tokenizer.decode(own.apply_chat_template(messages)).startswith("<|bos|><|user_start|>hi")


def test_chat_template_is_a_cli_flag():
    ns = cli.build_parser().parse_args(["chat", "--chat-template", "t.jinja"])
    assert cli.engine_args_from(ns).chat_template == "t.jinja"


def test_bad_chat_templates_name_the_field():
    with pytest.raises(ValueError, match="^chat_template: 'no/such.jinja' is neither a file nor"):
        frontend(chat_template="no/such.jinja")
    broken = frontend(chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="^chat_template: line 1"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])


def test_generation_config_decides_where_eos_ids_come_from(tmp_path):
    def eos(value: str) -> list[int]:
        return EngineArgs(generation_config=value, device="cpu").create_config().model.eos_token_ids

    assert eos("auto") == [4, 0]  # generation_config.json's list, then config.json's eos_token_id (4)
    assert eos("vllm") == eos("none") == [4]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    assert eos(str(tmp_path)) == [7, 4]
    with pytest.raises(ValueError, match="^generation_config: must be auto, vllm, none or a directory"):
        eos(str(tmp_path / "missing"))


# -- 3. the start-up log --------------------------------------------------------------------------------

def test_engine_logs_what_it_loaded(caplog, one_thread):
    with caplog.at_level(logging.INFO, logger="nanoserve.engine.llm_engine"):
        LLMEngine.from_engine_args(EngineArgs(num_kv_blocks=8, device="cpu"))
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded")]
    assert f"LlamaForCausalLM weights from {bundled_model_dir()} as float32 on cpu" in line
    assert "KV cache 8 blocks x 16 = 128 tokens" in line
    assert "max_model_len 128 (the KV pool's size; the model allows 512)" in line


@pytest.mark.parametrize("args,config,expected", [
    ({}, {}, "max_model_len 512 (the model's max_position_embeddings)"),
    ({"max_model_len": 100}, {}, "max_model_len 100 (asked for with --max-model-len)"),
    ({}, {"architectures": ["MistralForCausalLM"], "sliding_window": 256},
     "max_model_len 512 (the model's max_position_embeddings)"),
])
def test_summary_says_what_set_max_model_len(tmp_path, args, config, expected):
    model = bundled_copy(tmp_path / "m", **config)
    assert expected in EngineArgs(model=str(model), device="cpu", **args).create_config().summary(64)


def test_a_model_without_a_tokenizer_is_warned_about(tmp_path, caplog, one_thread):
    model = bundled_copy(tmp_path / "m", tokenizer=False)
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine.llm_engine"):
        engine = LLMEngine.from_engine_args(EngineArgs(model=str(model), load_format="dummy", num_kv_blocks=8))
    assert engine.tokenizer is None
    assert any("prompts must be token ids" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# -- 4. unsupported checkpoints -------------------------------------------------------------------------

def test_gpt2_config_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    with pytest.raises(ValueError, match="^model: architecture 'GPT2LMHeadModel' is not supported; "
                                         "supported: LlamaForCausalLM, "):
        engine_config(EngineArgs(model=str(tmp_path)))


def test_gpt2_config_on_the_command_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "Hi"]) == 2
    assert "error: model: architecture 'GPT2LMHeadModel' is not supported" in capsys.readouterr().err


def test_a_missing_config_key_is_named(tmp_path):
    raw = json.loads((Path(bundled_model_dir()) / "config.json").read_text())
    del raw["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="^model: config.json in .* has no 'num_attention_heads'"):
        EngineArgs(model=str(tmp_path)).create_config()


# -- 5. Ctrl-C --------------------------------------------------------------------------------------------

def test_an_interrupted_answer_is_aborted_in_the_engine(bundled):
    engine = bundled.engine
    engine.add_request("cli-interrupt", "Hello", SamplingParams(max_tokens=64, ignore_eos=True))
    start = engine.num_generation_tokens
    out = cli._stream(engine, "cli-interrupt", interrupted=lambda: engine.num_generation_tokens > start)
    assert out is None
    assert "cli-interrupt" not in engine.requests and not engine.has_unfinished_requests()


def test_sigint_sets_the_flag_instead_of_raising():
    before = signal.getsignal(signal.SIGINT)
    with cli._sigint_as_flag() as interrupted:
        signal.raise_signal(signal.SIGINT)
        assert interrupted.is_set()
    assert signal.getsignal(signal.SIGINT) is before


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The bundled model's shape and tokenizer with a context of 4096 and an eos it never samples: with
    random weights its answers run until max_tokens, long enough to be interrupted."""
    return bundled_copy(tmp_path_factory.mktemp("long") / "m", max_position_embeddings=4096, eos_token_id=1000)


def spawn(*argv: str) -> pexpect.spawn:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return pexpect.spawn(sys.executable, ["-m", "nanoserve.cli", *argv], cwd=REPO, env=env, encoding="utf-8",
                         timeout=120)


def test_ctrl_c_in_chat_stops_the_answer_then_ends_the_chat(long_model):
    child = spawn("chat", "--model", str(long_model), "--load-format", "dummy", "--generation-config", "none",
                  "--max-tokens", "4000", "--temperature", "1", "--sample-seed", "0")
    try:
        child.expect_exact("max_model_len 4096")  # the start-up summary: logging shows INFO lines
        child.expect_exact("> ")
        child.sendline("hello")
        child.expect_exact("hello\r\n")
        child.expect(r"\S")  # the answer is being written
        child.sendintr()
        child.expect_exact("[stopped]")
        child.expect_exact("> ")
        child.sendintr()
        child.expect(pexpect.EOF)
        rest = child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == cli.INTERRUPTED and "Traceback" not in rest, rest


def test_ctrl_c_in_generate_exits_quietly(long_model):
    child = spawn("generate", "--model", str(long_model), "--load-format", "dummy", "--generation-config", "none",
                  "--prompt", "Hello", "--max-tokens", "4000", "--temperature", "1", "--sample-seed", "0")
    try:
        child.expect_exact("max_model_len 4096")
        # Generated text after the log line (sampled: random weights' greedy choice may be a token that prints nothing).
        child.expect(r"\n\S")
        child.sendintr()
        child.expect(pexpect.EOF)
        rest = child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == cli.INTERRUPTED and "Traceback" not in rest, rest


# -- 6. the calculator in LLM.chat ----------------------------------------------------------------------

def test_llm_chat_runs_the_calculator(bundled):
    params = SamplingParams(temperature=0, max_tokens=64)
    text = bundled.chat(QUESTION, params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("[calculator: 12*34] 408\n"), text
    assert "408" in text.split("\n", 1)[1]  # the answer uses the result
    # generate() runs no tool: the same prompt gets no calculator.
    plain = bundled.generate(bundled.apply_chat_template(QUESTION), params, use_tqdm=False)[0].outputs[0].text
    assert "[calculator:" not in plain


def test_special_tokens_are_kept_when_asked_for(bundled):
    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    text = bundled.chat(QUESTION, params, use_tqdm=False)[0].outputs[0].text
    assert text.startswith("<|python_start|>12*34<|python_end|><|output_start|>408<|output_end|>"), text


def test_streamed_text_grows_to_the_final_text(bundled):
    """Every output of a request under the tool loop extends the one before (so a stream's deltas join to the
    final text), and the forced result arrives as a delta of its own."""
    engine = bundled.engine
    ToolLoop.attach(engine, "stream-")
    engine.add_request("stream-0", bundled.apply_chat_template(QUESTION), SamplingParams(temperature=0, max_tokens=64))
    texts, forced = [""], []
    while engine.requests.get("stream-0") is not None or len(texts) == 1:
        for out in engine.step():
            if out.request_id == "stream-0":
                c = out.outputs[0]
                assert c.text.startswith(texts[-1])
                if not any(c.token_masks[-1:]):  # this output ends with forced tokens
                    forced.append(c.text[len(texts[-1]):])
                texts.append(c.text)
    assert forced == ["408\n"]
    assert texts[-1] == bundled.chat(QUESTION, SamplingParams(temperature=0, max_tokens=64),
                                     use_tqdm=False)[0].outputs[0].text
