"""What the SDK returns: stream chunks and the whole completion (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kv_worker.messages import RequestTimings
from runtime.logprobs import TokenLogprob


@dataclass
class Chunk:
    """New tokens of one request; the last chunk has `finished=True` and the final fields."""

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


@dataclass
class Completion(Chunk):
    """A whole request: every token and all the text, with the final chunk's fields."""

    @classmethod
    def from_chunks(cls, chunks: Iterable[Chunk]) -> Completion:
        done = cls(request_id="")
        logprobs: list[TokenLogprob | None] | None = None
        for chunk in chunks:
            done.token_ids.extend(chunk.token_ids)
            done.text += chunk.text
            if chunk.logprobs is not None:
                logprobs = (logprobs or []) + list(chunk.logprobs)
            if chunk.finished:
                tokens, text = done.token_ids, done.text
                done = cls(
                    **{**chunk.__dict__, "token_ids": tokens, "text": text, "logprobs": logprobs}
                )
        if not done.finished:
            raise ValueError("the stream ended without a final chunk")
        return done


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    block_size: int
    vocab_size: int
    tenant: str  # the tenant the client's key belongs to
