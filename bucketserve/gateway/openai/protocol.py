"""OpenAI (and vLLM) request and response bodies as pydantic models: the type and range
of every field, and the schema of /openapi.json. What a value means (prompt length,
max_model_len, tenants) is admission's to check.

Unknown request keys are kept aside (`model_extra`) and ignored, as vLLM does. vLLM's
sampling keys this server does not implement yet are typed and range-checked like vLLM's,
then accepted only at their neutral value (each request model's NEUTRAL).

Every list and text a body may carry is measured against the request limits (the
validation context's `limits`, a RequestLimits; its defaults without one) before its
elements are validated, so an oversized body costs its parse and no more.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.openai.body import BodyRefused
from bucketserve.gateway.request_limits import MAX_CACHE_SALT, RequestLimits

Int = StrictInt
Bool = StrictBool
Str = StrictStr
Float = StrictFloat
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
MAX_LOGPROBS = 20  # bucketserve.runtime.core.sampling_params.MAX_LOGPROBS
MAX_SHOWN_CHARS = 60  # of a refused value, in a message
MAX_SHOWN_ITEMS = 20


class _Lenient(BaseModel):
    """Extra keys are allowed in, to be logged and ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Lenient):
    include_usage: Bool = False
    continuous_usage_stats: Bool = Field(
        False, description="usage in every chunk (vLLM); needs include_usage"
    )


class TextPart(_Lenient):
    type: Literal["text"]
    text: Str


class FunctionCall(_Lenient):
    name: Str
    arguments: Str = Field(description="the arguments as JSON text")


class ToolCall(_Lenient):
    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Str
    content: Str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's earlier calls")
    tool_call_id: Str | None = Field(None, description="the call a `tool` message answers")
    name: Str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any, info: ValidationInfo) -> Any:
        if isinstance(content, list):
            with refusing():
                limits(info).content_parts(len(content))
        if isinstance(content, list) and not all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            raise ValueError('may only hold text parts ({"type": "text", "text": "..."})')
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError("must be a string or a list of text parts")
        return content


class JsonSchemaFormat(_Lenient):
    name: Str = "response"
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Lenient):
    name: Str = Field(min_length=1)
    description: Str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: Str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class _GenerateBody(_Lenient):
    """What completions and chat completions share."""

    # field -> the values at which a field this server does not implement changes nothing
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "best_of": (None, 1),
        "use_beam_search": (False,),
        "length_penalty": (1.0,),
        "include_stop_str_in_output": (False,),
        "prompt_logprobs": (None,),
        "allowed_token_ids": (None,),
        "bad_words": (None, []),
        "truncate_prompt_tokens": (None,),
        # a fast (Rust) tokenizer, ours, puts no spaces between special tokens either way
        "spaces_between_special_tokens": (True,),
    }

    model: Str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _strings(cls, stop: Any, info: ValidationInfo) -> Any:
        if stop is None or isinstance(stop, str):
            return stop
        if isinstance(stop, list):
            with refusing():
                limits(info).stop_count(len(stop))
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("must be a string or a list of strings")
        with refusing():
            limits(info).stop(stop)
        return stop

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, ids: Any, info: ValidationInfo) -> Any:
        if isinstance(ids, list):
            with refusing():
                limits(info).stop_token_ids(len(ids))
        return ids

    @field_validator("n", mode="before")
    @classmethod
    def _most_n(cls, n: Any, info: ValidationInfo) -> Any:
        with refusing():
            limits(info).n(n)
        return n

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_count(cls, bias: Any, info: ValidationInfo) -> Any:
        if isinstance(bias, dict):
            with refusing():
                limits(info).logit_bias(len(bias))
        return bias

    # bucketserve's scheduling hints
    priority: Int = 0
    request_id: Str | None = None
    ttft_slo_s: Float | None = None
    tpot_slo_s: Float | None = None
    cache_salt: Str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT,
        description="vLLM's: only requests with the same salt share cached prefix blocks",
    )
    # accepted, cannot change the output
    user: Str | None = None
    metadata: dict[str, Any] | None = None
    store: Bool | None = None
    service_tier: Str | None = None
    spaces_between_special_tokens: Bool = True
    # sampling (bucketserve.runtime.worker.sampler)
    n: Int = Field(1, ge=1, description="choices, each sampled on its own (gateway.max_n)")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Float = Field(1.0, gt=0.0, le=2.0)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: Int = Field(0, ge=0)
    skip_special_tokens: Bool = True
    logit_bias: dict[str, float] | None = Field(
        None, description="token id -> bias in [-100, 100] added to its logit"
    )
    # structured output (bucketserve.runtime.core.structured_outputs): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: one of json, json_object, regex, choice, grammar"
    )
    guided_json: dict[str, Any] | Str | None = None
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    guided_whitespace_pattern: Str | None = None
    # not implemented yet: neutral values only (NEUTRAL)
    best_of: Int | None = Field(None, ge=1)
    use_beam_search: Bool = False
    length_penalty: Float = 1.0
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[Int] | None = None
    bad_words: list[Str] | None = None
    truncate_prompt_tokens: Int | None = Field(None, ge=1)


class CompletionRequest(_GenerateBody):
    """`POST /v1/completions`."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_GenerateBody.NEUTRAL,
        "suffix": (None,),
        "add_special_tokens": (True,),
    }

    prompt: Str | list[Int] | list[Str] | list[list[Int]] = Field(
        description="a string, token ids, or a one-element list of either"
    )
    logprobs: Int | None = Field(
        None, ge=0, description="top logprobs per token, at most gateway.max_logprobs"
    )
    echo: Bool = False
    suffix: Str | None = None
    add_special_tokens: Bool = True

    @field_validator("logprobs", mode="before")
    @classmethod
    def _most_logprobs(cls, k: Any, info: ValidationInfo) -> Any:
        with refusing():
            limits(info).logprobs("logprobs", k)
        return k

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any, info: ValidationInfo) -> Any:
        one = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else None
        if isinstance(one, (str, list)):
            prompt = one
        if isinstance(prompt, str):
            with refusing():
                limits(info).prompt_chars("prompt", len(prompt))
            return prompt
        if isinstance(prompt, list) and prompt and _is_int(prompt[0]):
            with refusing():
                limits(info).prompt_tokens(len(prompt))  # the count before each id
        if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            return prompt
        raise ValueError(
            "must be a string or a list of token ids; send one prompt per request"
        )


class ChatCompletionRequest(_GenerateBody):
    """`POST /v1/chat/completions`."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_GenerateBody.NEUTRAL,
        "functions": (None,),
        "function_call": (None,),
        "modalities": (None, ["text"]),
        "audio": (None,),
        "prediction": (None,),
        "reasoning_effort": (None,),
        "web_search_options": (None,),
        "add_generation_prompt": (True,),
        "add_special_tokens": (False,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, description="at most gateway.max_logprobs")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    modalities: list[Str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Str | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = False

    @field_validator("messages", mode="before")
    @classmethod
    def _count(cls, messages: Any, info: ValidationInfo) -> Any:
        return _counted_messages(messages, info)

    @field_validator("tools", mode="before")
    @classmethod
    def _count_tools(cls, tools: Any, info: ValidationInfo) -> Any:
        if isinstance(tools, list):
            with refusing():
                limits(info).tools(len(tools))
        return tools

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top(cls, k: Any, info: ValidationInfo) -> Any:
        with refusing():
            limits(info).logprobs("top_logprobs", k)
        return k


class TokenizeRequest(_Lenient):
    """`POST /tokenize` (vLLM's): a prompt, or chat messages rendered by the template."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _chars(cls, prompt: Any, info: ValidationInfo) -> Any:
        if isinstance(prompt, str):
            with refusing():
                limits(info).prompt_chars("prompt", len(prompt))
        return prompt

    @field_validator("messages", mode="before")
    @classmethod
    def _count(cls, messages: Any, info: ValidationInfo) -> Any:
        return _counted_messages(messages, info)


class DetokenizeRequest(_Lenient):
    """`POST /detokenize` (vLLM's)."""

    model: Str | None = None
    tokens: list[Int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _count(cls, tokens: Any, info: ValidationInfo) -> Any:
        if isinstance(tokens, list):
            with refusing():
                limits(info).detokenize(len(tokens))
        return tokens


# responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from a prefix cache")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # in a request's final usage


class _Response(BaseModel):
    id: str
    created: int
    model: str


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per output token its text, logprob, the top
    logprobs as {token text: logprob}, and where it starts in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length or abort (vLLM's)")


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """One `data:` event of a streamed chat completion (completions stream
    CompletionResponse objects)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bucketserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ResetPrefixCacheResponse(BaseModel):
    forgotten_blocks: int = Field(description="cached blocks the workers forgot")


def limits(info: ValidationInfo) -> RequestLimits:
    """The limits the body is parsed under (`parse_body`'s context), else the defaults."""
    context = info.context or {}
    return context.get("limits") or RequestLimits()


@contextmanager
def refusing() -> Iterator[None]:
    """A limit's refusal as BodyRefused, which pydantic passes on at once: no other field
    is validated and no error list (with a copy of the oversized input) is built."""
    try:
        yield
    except InvalidArgumentError as exc:
        raise BodyRefused(exc) from None


def not_supported(name: str, value: Any, neutral: tuple[Any, ...]) -> InvalidArgumentError:
    """`name` holds `value` where this server serves only its `neutral` values."""
    return InvalidArgumentError(
        f"{name}={_shown(value)} is not supported yet by this server; leave it out or send "
        f"{neutral[-1]!r}"
    )


def _shown(value: Any) -> str:
    if isinstance(value, (list, dict)) and len(value) > MAX_SHOWN_ITEMS:
        return f"<{len(value)} items>"
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}..."


def _counted_messages(messages: Any, info: ValidationInfo) -> Any:
    """Messages counted before each is validated; their text is measured at admission."""
    if isinstance(messages, list):
        with refusing():
            limits(info).chat_messages(len(messages))
    return messages


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
