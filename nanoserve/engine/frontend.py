"""EngineFrontend: what serving needs of an engine besides running it.

The final configuration, the tokenizer, and the checks a prompt must pass: none of it needs the model.
LLMEngine is one (it adds the model, the scheduler and the KV cache); when the engine runs in a process
of its own (runtime/engine_core_process.py), the server holds a bare one (runtime/process_client.py), built
from the configuration the engine process settled on. It stays in engine/, below runtime/, as LLMEngine's
base class.
"""

import struct
from pathlib import Path

import jinja2
import numpy as np

from nanoserve.config import EngineArgs, EngineConfig, bundled_model_dir, read_config_json
from nanoserve.engine.block_manager import token_bytes
from nanoserve.model.registry import check_architecture


def engine_config(args: EngineArgs) -> EngineConfig:
    """args.create_config() for an engine to run: a checkpoint whose architecture no model of nanoserve runs is
    refused first, by name, rather than for a config.json key its family names otherwise. Here, not in config.py:
    the registry is model/'s, above config.py."""
    check_architecture(read_config_json(args.model or bundled_model_dir())["architectures"][0])
    return args.create_config()


def check_token_ids(name: str, ids, vocab: int, most: int = 20) -> None:
    """ValueError naming the field and every id of `ids` outside the vocabulary [0, vocab) (the first `most` of a
    long list, and how many more): one message for prompts, stop_token_ids and logit_bias, here and in the server."""
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
    # Each bad int once, in order, then anything else (which may not hash: a list inside a prompt).
    bad = sorted({t for t in bad if isinstance(t, int)}) + [t for t in bad if not isinstance(t, int)]
    if not bad:
        return
    shown = ", ".join(map(repr, bad[:most])) + (f" and {len(bad) - most} more" if len(bad) > most else "")
    ids_are = f"token id {shown} is" if len(bad) == 1 else f"token ids {shown} are"
    raise ValueError(f"{name}: {ids_are} outside the vocabulary [0, {vocab})")


def load_tokenizer(path: str):
    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer.model").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class EngineFrontend:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer  # None: a checkpoint without one (prompts are token ids then)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; give token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation rendered by the chat template: --chat-template's, else the tokenizer's.
        `tools`: OpenAI-shaped tool definitions, for templates that list them (Hugging Face's `tools=`)."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("messages: this model has no tokenizer to render a conversation with")
        own = {"chat_template": self.config.chat_template} if self.config.chat_template else {}
        if not own and not getattr(tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template (give one with --chat-template)")
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools, **own)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat_template: line {exc.lineno}: {exc.message}") from None
        except jinja2.TemplateError as exc:
            # A template that parses but cannot render this conversation (a field it expects is missing, or its
            # own raise_exception refuses the roles' order): the request's messages are at fault, not the engine.
            raise ValueError(f"messages: the chat template cannot render this conversation: "
                             f"{exc.message or type(exc).__name__}") from None
        return tok.encode(text, add_special_tokens=False)

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.config.model.vocab_size
        # One pass in C: a per-token Python check cost ~0.4 ms for a 2,100-token prompt, a fifth of a cached
        # prefill's TTFT, and np.asarray of the list ~48 us against ~17 us for struct (which accepts only ints that
        # fit int64). Anything else is checked slowly, which also names the bad token.
        try:
            ids = np.frombuffer(token_bytes(prompt_ids), dtype="<i8") if isinstance(prompt_ids, list) else None
        except (struct.error, TypeError):
            ids = None
        if ids is None or ids.min() < 0 or ids.max() >= vocab:
            check_token_ids("prompt", prompt_ids, vocab)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate in the context "
                             f"of {self.max_model_len} tokens")
