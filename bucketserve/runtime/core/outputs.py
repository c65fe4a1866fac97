"""What the engine hands back per request and step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.runtime.core.logprobs import TokenLogprob
from bucketserve.runtime.core.sequence import FinishReason, SequenceMetrics


@dataclass
class CompletionOutput:
    """One sample (choice `index`) of a request, as vLLM's: cumulative `text`, `token_ids`
    and `logprobs`, what this step added in the `delta_` fields, and `changed` when this
    output brings it news (new tokens, or its end)."""

    index: int
    text: str
    token_ids: list[int]
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    changed: bool = False
    logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    delta_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)


@dataclass
class RequestOutput:
    """A request's state after a step: the cumulative output and this step's delta.

    `text` and `token_ids` hold everything generated so far, `delta_text` and
    `delta_token_ids` only what is new since the previous output for this
    request. The last output of a request has `finished=True` and a
    `finish_reason`; `stop_reason` is the stop string or stop token id that
    ended it, if one did. `logprobs` / `delta_logprobs` hold one TokenLogprob per output
    token (None for a token sampled elsewhere) when the request asked for logprobs, else
    they are None.

    `outputs` holds one CompletionOutput per sample (`SamplingParams.n` of them, index i at
    position i); the top-level text, token and logprob fields are sample 0's, and
    `finished` says every sample has ended. `prompt_logprobs` (when asked for) has one entry
    per prompt token, None for the first. `num_cached_tokens`: prompt tokens whose K/V came
    from the prefix cache rather than being computed for this request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    metrics: SequenceMetrics | None = field(default=None, repr=False)
    logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    delta_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None, repr=False)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, as vLLM's
