"""The controller's record of one admitted request (torch-free)."""

from __future__ import annotations

import logging
import time

from bucket_manager.request import BucketRequest
from controller.request_stream import RequestStream
from kv_worker.messages import HandoffRequest, RequestTimings, ServeRequest, StreamDelta, TokenDelta
from runtime.logprobs import TokenLogprob
from runtime.output_processor import OutputProcessor

logger = logging.getLogger(__name__)


class RequestState:
    """Tokens streamed so far, where the request is, and its timings (the text is the
    controller's OutputProcessor's).

    `phase`: queued (in the bucket manager), prefill (dispatched, KV on its
    way), decode (admitted by `decode_worker`), done. Deltas carry their
    offsets, so tokens a re-prefilled request streamed before are not sent
    twice.
    """

    def __init__(self, request: ServeRequest, stream: RequestStream) -> None:
        self.request = request
        self.stream = stream
        self.phase = "queued"
        self.output_token_ids: list[int] = []
        self.decode_worker: str | None = None
        self.requeues = 0
        self.dispatched_at: float | None = None
        self.first_token_at: float | None = None
        self.prefill_s = 0.0
        self.transfer_s = 0.0
        self.request_bucket: tuple[int, int] | None = None
        self.shape_bucket: tuple[int, int, int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def handoff(self) -> HandoffRequest:
        """The request as the workers get it: itself, and a snapshot of the tokens so far."""
        return HandoffRequest(self.request, list(self.output_token_ids))

    def bucket_request(self, max_tokens: int) -> BucketRequest:
        """What the bucket manager queues: this state (as the payload) under the request's
        id, its tokens so far as the prompt to prefill."""
        r = self.request
        return BucketRequest(
            r.request_id, self.num_tokens, max_tokens, r.tenant, r.arrival_time, r.priority, self
        )

    def accept(self, delta: TokenDelta, outputs: OutputProcessor) -> StreamDelta | None:
        """Apply a worker's delta through the output processor; the StreamDelta with what is
        new to the client (the final one when `delta`, or a stop string in it, ends the
        request), or None when nothing is."""
        have = len(self.output_token_ids)
        if delta.token_offset > have:
            logger.error("request %s: %s skips ahead of %d tokens", self.request_id, delta, have)
            return None
        skip = have - delta.token_offset
        tokens = delta.token_ids[skip:]
        reason = (delta.finish_reason or "stop") if delta.finished else None
        out = outputs.process(self.request_id, tokens, reason)
        self.output_token_ids += out.token_ids
        logprobs = self._logprobs(delta, skip, len(out.token_ids))
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if out.finished:
            return self.final(
                out.finish_reason or "stop", delta.error, out.token_ids, out.text, logprobs
            )
        if not out.token_ids:
            return None
        return StreamDelta(
            self.request_id, token_ids=out.token_ids, text=out.text, logprobs=logprobs
        )

    def _logprobs(
        self, delta: TokenDelta, skip: int, kept: int
    ) -> list[TokenLogprob | None] | None:
        """The logprobs of the `kept` tokens of `delta` after the `skip` it repeats."""
        if self.request.sampling_params.logprobs is None:
            return None
        have = delta.logprobs or []
        return [have[i] if i < len(have) else None for i in range(skip, skip + kept)]

    def final(
        self,
        reason: str,
        error: str | None = None,
        tokens: list[int] | None = None,
        text: str = "",
        logprobs: list[TokenLogprob | None] | None = None,
    ) -> StreamDelta:
        """The last delta; the request is done."""
        self.phase = "done"
        if logprobs is None and self.request.sampling_params.logprobs is not None:
            logprobs = [None] * len(tokens or [])
        return StreamDelta(
            self.request_id,
            token_ids=tokens or [],
            text=text,
            logprobs=logprobs,
            finished=True,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_output_tokens=len(self.output_token_ids),
            timings=self.timings(),
            request_bucket=self.request_bucket,
            shape_bucket=self.shape_bucket,
        )

    def timings(self) -> RequestTimings:
        now, arrival = time.monotonic(), self.request.arrival_time
        first = self.first_token_at
        return RequestTimings(
            queue_s=(self.dispatched_at or now) - arrival,
            prefill_s=self.prefill_s,
            transfer_s=self.transfer_s,
            first_token_s=0.0 if first is None else first - arrival,
            decode_s=0.0 if first is None else now - first,
        )
