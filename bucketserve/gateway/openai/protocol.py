"""OpenAI (and vLLM) request and response bodies as pydantic models: the type and range
of every field, and the schema of /openapi.json. What a value means (prompt length,
max_model_len, tenants) is admission's to check.

Unknown request keys are kept aside (`model_extra`) and ignored, as vLLM does. vLLM's
sampling keys this server does not implement yet are typed and range-checked like vLLM's,
then accepted only at their neutral value (each request model's NEUTRAL).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

Int = StrictInt
Bool = StrictBool
Str = StrictStr
Float = StrictFloat
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 16  # bucketserve.runtime.core.sampling_params.MAX_N


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


class ChatMessage(_Lenient):
    role: Str
    content: Str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, list) and not all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            raise ValueError('may only hold text parts ({"type": "text", "text": "..."})')
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError("must be a string or a list of text parts")
        return content


class _GenerateBody(_Lenient):
    """What completions and chat completions share."""

    # field -> the values at which a field this server does not implement changes nothing
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "logit_bias": (None, {}),
        "best_of": (None, 1),
        "use_beam_search": (False,),
        "length_penalty": (1.0,),
        "include_stop_str_in_output": (False,),
        "prompt_logprobs": (None,),
        "allowed_token_ids": (None,),
        "bad_words": (None, []),
        "truncate_prompt_tokens": (None,),
        "response_format": (None, {"type": "text"}),
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
    def _strings(cls, stop: Any) -> Any:
        if stop is None or isinstance(stop, str):
            return stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("must be a string or a list of strings")
        return stop

    # bucketserve's scheduling hints
    priority: Int = 0
    request_id: Str | None = None
    ttft_slo_s: Float | None = None
    tpot_slo_s: Float | None = None
    # accepted, cannot change the output
    user: Str | None = None
    metadata: dict[str, Any] | None = None
    store: Bool | None = None
    service_tier: Str | None = None
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    # sampling (bucketserve.runtime.worker.sampler)
    n: Int = Field(1, ge=1, le=MAX_N, description="choices, each sampled on its own")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Float = Field(1.0, gt=0.0, le=2.0)
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: Int = Field(0, ge=0)
    # not implemented yet: neutral values only (NEUTRAL)
    logit_bias: dict[str, float] | None = None
    best_of: Int | None = Field(None, ge=1)
    use_beam_search: Bool = False
    length_penalty: Float = 1.0
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[Int] | None = None
    bad_words: list[Str] | None = None
    truncate_prompt_tokens: Int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None


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
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    suffix: Str | None = None
    add_special_tokens: Bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        one = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else None
        if isinstance(one, (str, list)):
            prompt = one
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and all(_is_int(t) for t in prompt)
        ):
            return prompt
        raise ValueError(
            "must be a string or a list of token ids; send one prompt per request"
        )


class ChatCompletionRequest(_GenerateBody):
    """`POST /v1/chat/completions`."""

    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        **_GenerateBody.NEUTRAL,
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),  # without tools, "auto" calls none
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
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
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


class TokenizeRequest(_Lenient):
    """`POST /tokenize` (vLLM's): a prompt, or chat messages rendered by the template."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(_Lenient):
    """`POST /detokenize` (vLLM's)."""

    model: Str | None = None
    tokens: list[Int]


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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
