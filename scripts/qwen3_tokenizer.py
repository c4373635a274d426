"""Build a Hugging Face tokenizer directory with Qwen3's real vocabulary, without reaching a model hub.

Why: the benchmark configs (benchmarks/configs/qwen3-0.6b) hold only config.json, and structured output
(llguidance) needs the model's tokenizer; its mask cost depends on the real vocabulary, so a toy one would
mislead. Qwen2/Qwen3 use the 151,643 byte-level BPE ranks of Qwen's `qwen.tiktoken` (shipped inside the
`dashscope` wheel on PyPI) followed by their special tokens; the pre-tokenizer regex is Qwen2's.

    python scripts/qwen3_tokenizer.py OUTDIR [--tiktoken PATH]

Without --tiktoken it downloads dashscope==2.0.2 with pip into a temporary folder and reads the file from it.
Writes OUTDIR/tokenizer.json and OUTDIR/tokenizer_config.json (ChatML chat template, eos <|im_end|>).
"""

import argparse
import base64
import glob
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
from transformers.convert_slow_tokenizer import TikTokenConverter

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX: digits one at a time.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
NUM_RANKS = 151643
# Qwen3's added tokens from id 151643 on, in order; False: added but not special (kept in decoded text).
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
         ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
         ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
         ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
         ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
         ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
         ("<think>", False), ("</think>", False)]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def read_ranks(path: str) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token) rank` a line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class _Converter(TikTokenConverter):
    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:  # without the tiktoken package
        return read_ranks(tiktoken_url)


def fetch_tiktoken(workdir: str) -> str:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "dashscope==2.0.2", "-d", workdir],
                   check=True)
    with zipfile.ZipFile(glob.glob(f"{workdir}/dashscope-*.whl")[0]) as z:
        return z.extract("dashscope/resources/qwen.tiktoken", workdir)


def build(tiktoken_path: str) -> Tokenizer:
    tok = _Converter(vocab_file=tiktoken_path, pattern=QWEN2_PATTERN).converted()
    assert tok.get_vocab_size() == NUM_RANKS, tok.get_vocab_size()
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    for i, (text, special) in enumerate(ADDED):  # one at a time, so each gets its id in order
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
        assert tok.token_to_id(text) == NUM_RANKS + i, text
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--tiktoken", default=None, help="path of qwen.tiktoken (default: fetched from dashscope)")
    ns = ap.parse_args()
    out = Path(ns.outdir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build(ns.tiktoken or fetch_tiktoken(tmp))
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 131072, "add_bos_token": False,
        "add_prefix_space": False, "clean_up_tokenization_spaces": False, "errors": "replace",
        "split_special_tokens": False, "bos_token": None, "unk_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [t for t, special in ADDED if special and t != "<|endoftext|>"],
        "added_tokens_decoder": {str(NUM_RANKS + i): {"content": t, "lstrip": False, "normalized": False,
                                                      "rstrip": False, "single_word": False, "special": s}
                                 for i, (t, s) in enumerate(ADDED)},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    print(f"{out}: {tok.get_vocab_size()} tokens ({NUM_RANKS} BPE ranks + {len(ADDED)} added)")


if __name__ == "__main__":
    main()
