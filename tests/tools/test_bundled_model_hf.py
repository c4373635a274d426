"""The bundled tiny chat model (nanoserve/assets) loads (transformers, tokenizers) and calls its tool."""

from pathlib import Path

import pytest
import torch

from nanoserve.tools.calculator import calculator

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "nanoserve" / "assets"
SPECIALS = [
    "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>", "<|pad|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(ASSETS)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(ASSETS).eval()


def test_special_token_ids(tok):
    # Both loaders agree, and the ids are fixed (0..9) so the engine and tests can rely on them.
    raw = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    for i, s in enumerate(SPECIALS):
        assert tok.convert_tokens_to_ids(s) == raw.token_to_id(s) == i
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|assistant_end|>"
    gen = transformers.GenerationConfig.from_pretrained(ASSETS)
    assert gen.eos_token_id == [4, 0]


def test_tokenizers_agree_and_digits_split(tok):
    raw = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    text = 'What is 123*456? "strawberry".count("r")'
    ids = raw.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=False) == ids
    assert raw.decode(ids) == text
    assert [raw.decode([i]) for i in raw.encode("56088").ids] == list("56088")


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|user_start|>Be brief.\n\nHi<|user_end|><|assistant_start|>Hello!<|assistant_end|>"
        "<|user_start|>What is 2+2?<|user_end|><|assistant_start|>"
    )
    ids = tok.apply_chat_template(messages[1:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[:2] == [0, 1] and ids[-2:] == [2, 3]  # bos, user_start ... user_end, assistant_start
    assert tok.decode(ids) == "<|bos|><|user_start|>Hi<|user_end|><|assistant_start|>"


def test_config(model):
    cfg = model.config
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) <= 10_000_000


@torch.no_grad()
def test_greedy_tool_call_123_times_456(tok, model):
    py_start, py_end, out_start, out_end, asst_end = (
        tok.convert_tokens_to_ids(s)
        for s in [
            "<|python_start|>",
            "<|python_end|>",
            "<|output_start|>",
            "<|output_end|>",
            "<|assistant_end|>",
        ]
    )
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 123*456?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(ids, add_special_tokens=False)])
    prompt_len = ids.shape[1]
    results = []
    # The tool loop: generate stops at python_end; run the calculator and force its output, go on.
    for _ in range(3):
        ids = model.generate(
            ids, max_new_tokens=64, do_sample=False, eos_token_id=[py_end, asst_end, 0], pad_token_id=9
        )
        if ids[0, -1] != py_end:
            break
        new = ids[0, prompt_len:].tolist()
        expr = tok.decode(new[len(new) - 1 - new[::-1].index(py_start) + 1 : -1])
        results.append(calculator(expr))
        forced = [out_start, *tok.encode(results[-1], add_special_tokens=False), out_end]
        ids = torch.cat([ids, torch.tensor([forced])], dim=1)
    text = tok.decode(ids[0, prompt_len:])
    assert results == ["56088"], text
    assert text.startswith("<|python_start|>") and text.endswith("<|assistant_end|>"), text
    assert "56088" in text.split("<|output_end|>")[-1], text
