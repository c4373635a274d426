"""Incremental detokenization: stop strings across token boundaries, multi-byte text never mangled."""

import pytest
from checkpoints import write_tokenizer
from transformers import AutoTokenizer

from nanoserve.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world! How are you today?", "日本語のテキスト、中文文本 😀🎉🚀 café", "🦄🧠 mixed ascii and 한국어"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_is_intact(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 5
    detok = IncrementalDetokenizer(tokenizer, [0], skip_special_tokens=True, stop=[])
    shown = []
    for tok in ids:
        detok.add_token(tok)
        visible = detok.visible_text(finished=False)
        assert "\ufffd" not in visible
        assert visible.startswith("".join(shown))  # text only ever grows
        shown = [visible]
    assert detok.text == text


def test_emoji_split_over_byte_tokens(tokenizer):
    # An emoji the tokenizer never saw whole: it is spelled as 4 single-byte tokens.
    ids = tokenizer.encode("🦄", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [0], True, [])
    for tok in ids[:-1]:
        detok.add_token(tok)
        assert detok.text == ""
    detok.add_token(ids[-1])
    assert detok.text == "🦄"


def test_stop_string_across_tokens_is_cut(tokenizer):
    text = "Hello world! How are you today?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "d! Ho"  # spans the tokens of "world", "!" and "How"
    detok = IncrementalDetokenizer(tokenizer, [0], True, [stop])
    hits = []
    for tok in ids:
        hits.append(detok.add_token(tok))
        assert stop not in detok.visible_text(finished=False)
        if hits[-1]:
            break
    assert hits[-1] == stop and len(hits) < len(ids)
    assert detok.visible_text(finished=True) == "Hello worl"


def test_holdback_never_shows_a_partial_stop(tokenizer):
    ids = tokenizer.encode("abc abd abe", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0], True, ["abd"])
    shown = []
    for tok in ids:
        if detok.add_token(tok):
            break
        shown.append(detok.visible_text(False))
    final = detok.visible_text(True)
    assert final == "abc "
    assert all(final.startswith(s) for s in shown)  # nothing shown was later taken back
