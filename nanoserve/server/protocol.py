"""Request bodies of the OpenAI-compatible API, as pydantic models.

Unknown fields are ignored (pydantic's default), so clients that send fields nanoserve does not
implement (suffix, tools ...) still work. Range checks on sampling fields live in SamplingParams, which
names the field in its error; these models only check types and shapes, and that text is valid Unicode.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from nanoserve.sampling_params import SamplingParams

TokenIds = list[Annotated[int, Field(strict=True)]]


def valid_unicode(value: str | list | None) -> str | list | None:
    """A field validator's body: JSON's "\\ud800" (a lone surrogate) parses to a str that neither the tokenizer
    nor a UTF-8 response can take, so it is refused here, where the field can still be named. `value` is a
    str, or a list whose str items (or TextPart texts) are checked."""
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    for i, item in enumerate(items):
        text = item.text if isinstance(item, TextPart) else item
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = f"item {i}, " if items is value else ""
            raise ValueError(f"must be valid Unicode, got a lone surrogate U+{ord(text[exc.start]):04X} at "
                             f"{where}character {exc.start}") from None
    return value


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None  # None: the rest of the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON object's keys are strings) -> bias

    _valid_stop = field_validator("stop")(valid_unicode)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field on a bad value."""
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_k=self.top_k if self.top_k is not None else -1,
            top_p=self.top_p, min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, logit_bias=_token_id_keys(self.logit_bias))


def _token_id_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    bad = next((key for key in bias if not key.isascii() or not key.isdigit()), None)
    if bad is not None:
        raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {bad!r}")
    return {int(key): value for key, value in bias.items()}


class CompletionRequest(SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists (one choice set per prompt).
    # Token ids are strict ints so that a list of numbers is never read as a list of strings.
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = None
    echo: bool = False

    _valid_prompt = field_validator("prompt")(valid_unicode)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) or [[]]  # an empty list is one empty prompt, refused as such later


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart] | None = None

    _valid_content = field_validator("content")(valid_unicode)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as the chat template takes it (templates know no developer role)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins if both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None

    _valid_prompt = field_validator("prompt")(valid_unicode)
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: TokenIds
