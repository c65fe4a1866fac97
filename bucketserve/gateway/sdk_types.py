"""What the SDK returns: stream chunks and the whole completion (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from bucketserve.messages import RequestTimings
from bucketserve.runtime.core.logprobs import TokenLogprob


@dataclass
class Chunk:
    """New tokens of one request's sample `index`; the last chunk has `finished=True` and
    the final fields. With n > 1 samples, each sample's last chunk has its `finish_reason`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # stop / length / cancelled / error
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: RequestTimings | None = None
    request_bucket: tuple[int, int] | None = None  # [low, up) prompt lengths
    shape_bucket: tuple[int, int, int] | None = None  # (batch, query, blocks)
    # one per token when the request asked for logprobs (None: not known)
    logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # the sample of an n > 1 request
    # once, when the request asked for prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # of prompt_tokens, those found in a prefix cache (final chunk)


@dataclass
class Sample:
    """One of a request's n samples, whole."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None


@dataclass
class Completion(Chunk):
    """A whole request: every token and all the text of sample 0, with the final chunk's
    fields; `choices` holds every sample (n of them)."""

    choices: list[Sample] = field(default_factory=list)

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> Completion:
        samples: dict[int, Sample] = {}
        prompt_logprobs = None
        final: Chunk | None = None
        for chunk in chunks:
            sample = samples.setdefault(chunk.index, Sample(chunk.index))
            sample.token_ids.extend(chunk.token_ids)
            sample.text += chunk.text
            if chunk.logprobs is not None:
                sample.logprobs = (sample.logprobs or []) + list(chunk.logprobs)
            if chunk.finish_reason is not None:
                sample.finish_reason = chunk.finish_reason
            if chunk.prompt_logprobs is not None:
                prompt_logprobs = chunk.prompt_logprobs
            if chunk.finished:
                final = chunk
        if final is None:
            raise ValueError("the stream ended without a final chunk")
        choices = [samples[i] for i in sorted(samples)]
        first = samples.get(0, Sample(0))
        return cls(
            **{
                **final.__dict__,
                "token_ids": first.token_ids,
                "text": first.text,
                "logprobs": first.logprobs,
                "index": 0,
                "prompt_logprobs": prompt_logprobs,
            },
            choices=choices,
        )


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    block_size: int
    vocab_size: int
    tenant: str  # the tenant the client's key belongs to
