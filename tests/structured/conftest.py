"""A random-weight checkpoint whose chat template lists tools and renders tool calls and results in the Hermes
shape (written by hand from the published format), the JSON schemas the tests constrain output to, and an LLM on
it. The model's weights are random: only the grammar makes its output valid.

Its tokenizer has the tool-call markers as added tokens, as the real ones do: <tool_call> and </tool_call> not
special (Qwen's), [TOOL_CALLS], [ARGS] and <|python_tag|> special (Mistral's v11, Llama 3's)."""

import json
from pathlib import Path

import pytest
from checkpoints import VOCAB, write_checkpoint  # tests/checkpoints.py
from structured_cases import HERMES_TEMPLATE, MARKER_TOKENS
from tokenizers import AddedToken, Tokenizer


@pytest.fixture(scope="session")
def hermes_dir(tmp_path_factory) -> Path:
    # Room for the tools the template lists (the byte-level tokenizer spends many tokens on JSON).
    path = write_checkpoint(tmp_path_factory.mktemp("structured") / "tiny-hermes", "llama",
                            max_position_embeddings=2048, vocab_size=VOCAB + len(MARKER_TOKENS))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS[:2]])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MARKER_TOKENS[2:]])
    tokenizer.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": HERMES_TEMPLATE}))
    return path


@pytest.fixture(scope="session")
def llm(hermes_dir):
    from nanoserve import LLM

    # Async scheduling on: a constrained sample's token is then still in flight when its next mask is due.
    return LLM(model=str(hermes_dir), num_kv_blocks=256, max_num_batched_tokens=2048, seed=0, async_scheduling=True)
