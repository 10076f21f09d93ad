"""The OpenAI-compatible wire format: request models (validated, so /openapi.json is the
contract the server enforces), their mapping onto SamplingParams, and the error body. The
response bodies and stream chunks built from engine outputs are formatting.py's.

Requests ignore fields they do not know (OpenAI clients send e.g. ``user``); every field
they do know is type-checked strictly (no "1" for 1, no NaN or infinity) and range-checked
here, before the engine sees it. An integral number is an integer whatever its spelling
(4.0 is 4, as JSON Schema's "integer" says; 4.5 is not).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from kiln.errors import InvalidParamError
from kiln.runtime.params import SamplingParams
from kiln.runtime.server.structured_request import structured_output
from kiln.runtime.server.tools import NamedToolChoice, Tool, ToolCallIn, ToolMode, tool_mode
from kiln.runtime.structured import StructuredOutput

MAX_LOGPROBS = 20
MAX_N = 16
MAX_SEED = 2**63 - 1


def _integral(value: Any) -> Any:
    """4.0 -> 4 (JSON has one number type); any other value is left for the strict int check."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _unicode(text: str) -> str:
    """JSON can spell a lone UTF-16 surrogate ("\\ud800"); that is no Unicode text a tokenizer can read."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"contains a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), "
                             "which is not Unicode text") from None
    return text


Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Int, Field(ge=0, le=2**31 - 1)]
Text = Annotated[str, AfterValidator(_unicode)]
StopString = Annotated[Text, Field(min_length=1)]


def _reject_if_set(value: Any) -> Any:
    if value:
        raise ValueError("is not supported by kiln")
    return value


# An OpenAI field kiln does not implement: only its empty value passes; anything else is a 400 naming it.
Unsupported = AfterValidator(_reject_if_set)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (None: the default)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = Field(None, description="The served model's name; omitted: that model.")
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, description="0 or -1: off.")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: Int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields kiln does not implement: setting one is a 400 naming it, never silently ignored.
    logit_bias: Annotated[dict[str, float] | None, Unsupported] = Field(
        None, description="Not supported: null or {} only.")
    # output constraints (runtime/server/structured_request.py): at most one of them
    response_format: dict[str, Any] | None = Field(None, description="{'type': 'text' | 'json_object' | "
                                                   "'json_schema', 'json_schema': {'schema': ..., 'strict': ...}}")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: a JSON schema the output follows.")
    guided_regex: str | None = Field(None, description="vLLM's: a regex the whole output matches.")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the output is one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM's: a Lark or GBNF grammar of the output.")

    def structured(self) -> StructuredOutput | None:
        return structured_output(self)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidParamError naming the field when the engine's rules reject a value."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured=self.structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1, max_length=64)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=64)]
    ) = Field(description="A string, a list of token ids, or a batch of either.")
    max_tokens: Int | None = Field(16, ge=1, description="null: up to the model's context length.")
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top logprobs per token.")
    echo: Annotated[bool, Unsupported] = Field(False, description="Not supported: false only.")
    tools: Annotated[list[Any] | None, Unsupported] = Field(None, description="Chat only: null or [] here.")
    suffix: Annotated[str | None, Unsupported] = Field(None, description="Not supported: null or empty only.")
    best_of: Int | None = Field(None, ge=1, description="Not supported beyond 1 (use n).")

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("is not supported by kiln beyond 1 (use n for several samples)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: one for a string or a flat token list."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: Text


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    url: str  # a data:image/...;base64 URL (runtime/vision/images.py refuses the rest by name)
    detail: str | None = None  # OpenAI's detail level: LLaVA-1.5 sees one fixed-size crop whatever it says


class ImageUrlPart(BaseModel):
    """An image content part; runtime/server/images.py takes it out of the message before the template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):  # image parts are text by now (runtime/server/images.py)
            content = "".join(part.text for part in content if isinstance(part, TextPart))
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: Int | None = Field(None, ge=1, description="null: up to the context length.")
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs: true.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call (runtime/server/tools.py).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_mode(self) -> ToolMode | None:
        return tool_mode(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutput | None:
        mode, own = self.tool_mode(), structured_output(self)
        forced = None if mode is None else mode.constraint()
        if forced is not None and own is not None:
            raise InvalidParamError("a forced tool call (tool_choice required or a function) cannot also have an "
                                    "output constraint", "tool_choice")
        return forced or own

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParamError("top_logprobs requires logprobs to be true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# ---- /tokenize and /detokenize (vLLM's shapes) ------------------------------------------

class TokenizeRequest(BaseModel):
    """A prompt, or chat messages rendered with the chat template, to token ids."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: Text | None = Field(None, description="Text to tokenize (give this or messages).")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="A conversation to render and "
                                               "tokenize (give this or prompt).")
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant's turn opening.")
    add_special_tokens: bool | None = Field(None, description="Default: true for prompt, false for messages "
                                            "(the template writes them).")
    return_token_strs: bool = Field(False, description="Also return each token's vocabulary string.")

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- errors ---------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               431: "invalid_request_error", 500: "internal_server_error", 503: "service_unavailable"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": code}}
