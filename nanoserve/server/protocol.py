"""Request bodies of the OpenAI-compatible API, as pydantic models.

Unknown fields are ignored (pydantic's default), so clients that send fields nanoserve does not
implement (suffix ...) still work. Range checks on sampling fields live in SamplingParams, which
names the field in its error; these models only check types and shapes, and that text is valid Unicode.
"""

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.params import StructuredOutputs

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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # pydantic's BaseModel has a `schema` of its own
    strict: bool | None = None  # the schema is always enforced; accepted for OpenAI's clients


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict | str | None = Field(default=None, alias="json")  # BaseModel has a `json` method
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    _valid_text = field_validator("regex", "grammar", "choice")(lambda v: valid_unicode(v))


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    _valid_stop = field_validator("stop")(valid_unicode)

    def structured(self) -> StructuredOutputs | None:
        """The output constraint that response_format or structured_outputs asks for; ValueError naming the field."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise ValueError("structured_outputs: give response_format or structured_outputs, not both")
        if self.structured_outputs is not None:
            so = self.structured_outputs
            return StructuredOutputs(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                     choice=so.choice, grammar=so.grammar,
                                     disable_any_whitespace=so.disable_any_whitespace)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema: a json_schema response format needs json_schema.schema")
        try:
            return StructuredOutputs(json=fmt.json_schema.schema_)
        except ValueError as exc:
            raise ValueError(str(exc).replace("structured_outputs.json", "response_format.json_schema", 1)) from None

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
            skip_special_tokens=self.skip_special_tokens, logit_bias=_token_id_keys(self.logit_bias),
            structured_outputs=self.structured())


def _token_id_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    bad = [key for key in bias if not key.isascii() or not key.isdigit()]
    if bad:
        raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {', '.join(map(repr, bad))}")
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


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallField(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # developer: OpenAI's newer name for system; tool: a tool's result, answering an assistant's tool call.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallField] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    _valid_content = field_validator("content")(valid_unicode)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as the chat template takes it (templates know no developer role). Tool calls' arguments go
        as objects, which Hugging Face's templates expect (a string that is not JSON stays a string)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins if both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None

    _valid_prompt = field_validator("prompt")(valid_unicode)
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: TokenIds
