"""The controller's record of one admitted request (torch-free)."""

from __future__ import annotations

import logging
import time

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.controller.request_stream import RequestStream
from bucketserve.messages import (
    RequestTimings,
    ServeRequest,
    StreamDelta,
    TokenDelta,
    WorkerRequest,
)
from bucketserve.runtime.core.logprobs import TokenLogprob
from bucketserve.runtime.core.output_processor import OutputProcessor
from bucketserve.runtime.core.tenant_tag import TenantTag

logger = logging.getLogger(__name__)


class RequestState:
    """Tokens streamed so far, where the request is, and its timings (the text is the
    controller's OutputProcessor's).

    `phase`: queued (in the bucket manager), prefill (dispatched, KV on its
    way), decode (admitted by `decode_worker`), done. Deltas carry their
    offsets, so tokens a re-prefilled request streamed before are not sent
    twice. A request with n > 1 samples keeps each sample's tokens; it is done
    once every sample has ended.
    """

    def __init__(self, request: ServeRequest, stream: RequestStream) -> None:
        self.request = request
        self.stream = stream
        self.phase = "queued"
        n = request.sampling_params.n
        self.samples: list[list[int]] = [[] for _ in range(n)]  # each sample's output tokens
        self.ended = [False] * n
        self._prompt_logprobs_sent = False
        self.num_cached_tokens: int | None = None  # the first worker's report
        self.decode_worker: str | None = None
        self.requeues = 0
        self.dispatched_at: float | None = None
        self.first_token_at: float | None = None
        self.forecast_ttft_s: float | None = None  # the cost model's, when shedding admitted it
        self.prefill_s = 0.0
        self.transfer_s = 0.0
        self.request_bucket: tuple[int, int] | None = None
        self.shape_bucket: tuple[int, int, int] | None = None
        self.prefill_path: str | None = None  # its last prefill's: local or remote

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def output_token_ids(self) -> list[int]:
        """Sample 0's tokens: the ones a prefill continues."""
        return self.samples[0]

    @property
    def n(self) -> int:
        return len(self.samples)

    def key(self, index: int) -> str | tuple[str, int]:
        """Sample `index`'s key in the OutputProcessor."""
        return self.request_id if index == 0 else (self.request_id, index)

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.output_token_ids)

    def worker_request(self, tenant: TenantConfig | None = None) -> WorkerRequest:
        """The request as the workers get it: itself, a snapshot of the tokens so far, its
        rank in the bucket manager's order (its tenant's priority, then its own: a
        request's priority ranks it only among its tenant's requests), the time left to
        its TTFT target (its own, else its tenant's), and its TPOT target."""
        r = self.request
        target = r.slo_ttft_s or (tenant.ttft_slo_s if tenant else None)
        left = None
        if target is not None and not self.output_token_ids:
            left = target - (time.monotonic() - r.arrival_time)
        priority = (tenant.priority if tenant else 0, r.priority)
        tpot = r.slo_tpot_s or (tenant.tpot_slo_s if tenant else None)
        tag = tenant.tag(r.cache_salt) if tenant else TenantTag(cache_salt=r.cache_salt)
        return WorkerRequest(r, list(self.output_token_ids), priority, left, tpot, tag)

    def bucket_request(self, max_tokens: int) -> BucketRequest[RequestState]:
        """What the bucket manager queues: this state (its item) under the request's
        id, its tokens so far as the prompt to prefill."""
        r = self.request
        return BucketRequest(
            r.request_id, self.num_tokens, max_tokens, r.tenant, r.arrival_time, r.priority,
            item=self, samples=self.n,
        )

    def accept(self, delta: TokenDelta, outputs: OutputProcessor) -> StreamDelta | None:
        """Apply a worker's delta through the output processor; the StreamDelta with what is
        new to the client (the one ending its sample when `delta`, or a stop string in it,
        ends it; the final one when that was the last sample), or None when nothing is."""
        index = delta.index
        if not 0 <= index < self.n or self.ended[index]:
            return None
        tokens_so_far = self.samples[index]
        have = len(tokens_so_far)
        if delta.token_offset > have:
            logger.error("request %s: %s skips ahead of %d tokens", self.request_id, delta, have)
            return None
        if delta.num_cached_tokens is not None and self.num_cached_tokens is None:
            prompt = len(self.request.prompt_token_ids)
            self.num_cached_tokens = min(delta.num_cached_tokens, prompt)
        skip = have - delta.token_offset
        tokens = delta.token_ids[skip:]
        reason = (delta.finish_reason or "stop") if delta.finished else None
        kept, text, finish_reason, _ = outputs.process(self.key(index), tokens, reason)
        tokens_so_far.extend(kept)
        logprobs = self._logprobs(delta, skip, len(kept))
        prompt_logprobs = self._prompt_logprobs(delta)
        if kept and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if finish_reason is not None:
            return self.end(
                index, finish_reason, delta.error, kept, text, logprobs, prompt_logprobs
            )
        if not kept and prompt_logprobs is None:
            return None
        return StreamDelta(
            self.request_id,
            token_ids=kept,
            text=text,
            logprobs=logprobs,
            index=index,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(self, delta: TokenDelta) -> list[TokenLogprob | None] | None:
        if delta.prompt_logprobs is None or self._prompt_logprobs_sent:
            return None
        self._prompt_logprobs_sent = True
        return delta.prompt_logprobs

    def _logprobs(
        self, delta: TokenDelta, skip: int, kept: int
    ) -> list[TokenLogprob | None] | None:
        """The logprobs of the `kept` tokens of `delta` after the `skip` it repeats."""
        if self.request.sampling_params.logprobs is None:
            return None
        have = delta.logprobs or []
        return [have[i] if i < len(have) else None for i in range(skip, skip + kept)]

    def end(
        self,
        index: int,
        reason: str,
        error: str | None = None,
        tokens: list[int] | None = None,
        text: str = "",
        logprobs: list[TokenLogprob | None] | None = None,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> StreamDelta:
        """Sample `index`'s last delta; the request's final one if no other is left."""
        self.ended[index] = True
        if logprobs is None and self.request.sampling_params.logprobs is not None:
            logprobs = [None] * len(tokens or [])
        last = all(self.ended)
        if last:
            self.phase = "done"
        return StreamDelta(
            self.request_id,
            token_ids=tokens or [],
            text=text,
            logprobs=logprobs,
            finished=last,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_output_tokens=sum(map(len, self.samples)) if last else len(self.samples[index]),
            timings=self.timings() if last else None,
            request_bucket=self.request_bucket if last else None,
            shape_bucket=self.shape_bucket if last else None,
            index=index,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens or 0,
            prefill_path=self.prefill_path if last else None,
        )

    def finals(self, reason: str, error: str | None = None) -> list[StreamDelta]:
        """End every sample still going with `reason`: their last deltas, the request's final
        one last."""
        return [self.end(i, reason, error) for i in range(self.n) if not self.ended[i]]

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
