"""The soak's requests: one request over HTTP (OpenAI SSE) or gRPC (the SDK), perhaps cancelled
after some tokens, classified by how it ended; and a burst of malformed requests, each of
which must be refused as invalid (HTTP 400 / gRPC INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from bucketserve import AsyncClient, SamplingParams
from bucketserve.gateway.errors import BucketServeError
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc
from bucketserve.gateway.retry_policy import RetryPolicy

PROMPTS = [
    "Once upon a time",
    "Write a short poem about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three colours and say why you like each of them.",
    "The quick brown fox jumps over the lazy dog. Continue the story:",
    "Summarize the plot of a detective novel in which the butler did not do it.",
]

# How a request ended (Outcome.status).
FINISHED, CANCELLED, FAILED, REJECTED, LOST = "finished", "cancelled", "failed", "rejected", "lost"
NO_FINAL = "the stream ended without a final message"


@dataclass
class Plan:
    """One request the soak sends: over which protocol, what, and where it is cancelled
    (`cancel_after`: after that many streamed chunks; 0 with `cancel_delay_s`: before any)."""

    index: int
    protocol: str  # "http" | "grpc"
    prompt: str
    max_tokens: int
    temperature: float
    cancel_after: int | None = None
    cancel_delay_s: float = 0.0

    @classmethod
    def draw(cls, index: int, rng: random.Random, max_tokens: int, cancel_fraction: float
             ) -> Plan:
        tokens = rng.randint(max(1, max_tokens // 4), max_tokens)
        plan = cls(index, rng.choice(("http", "grpc")), rng.choice(PROMPTS), tokens,
                   rng.choice((0.0, 0.8)))
        if rng.random() < cancel_fraction:
            plan.cancel_after = rng.randint(0, tokens - 1)
            plan.cancel_delay_s = rng.uniform(0.0, 1.0)
        return plan


@dataclass
class Outcome:
    """`admitted`: the service took the request (an HTTP 200 / a first gRPC message);
    `status`: finished | cancelled (by us, or `reason` names the server's) | failed (admitted,
    then a final error: `reason`) | rejected (refused at admission: `reason`) | lost
    (admitted, and no final message came)."""

    plan: Plan
    admitted: bool = False
    status: str = LOST
    reason: str = ""
    ttft_s: float | None = None
    chunks: int = 0
    sent_at: float = 0.0
    ended_at: float = 0.0
    request_id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.plan.index, "protocol": self.plan.protocol,
            "admitted": self.admitted, "status": self.status, "reason": self.reason,
            "ttft_s": self.ttft_s, "chunks": self.chunks, "request_id": self.request_id,
            "latency_s": self.ended_at - self.sent_at,
        }


@dataclass
class Traffic:
    """Sends Plans to one service. `stall_s`: an admitted request with no final message
    that long is lost."""

    grpc_target: str
    http_url: str
    model: str
    api_key: str | None = None
    stall_s: float = 600.0
    _grpc: AsyncClient | None = field(default=None, repr=False)
    _http: aiohttp.ClientSession | None = field(default=None, repr=False)

    async def __aenter__(self) -> Traffic:
        self._grpc = AsyncClient(
            self.grpc_target, api_key=self.api_key or "", retry=RetryPolicy(max_attempts=1)
        )
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.close()
        await self._grpc.close()

    async def send(self, plan: Plan) -> Outcome:
        outcome = Outcome(plan, sent_at=time.monotonic())
        run = self._send_http if plan.protocol == "http" else self._send_grpc
        try:
            async with asyncio.timeout(self.stall_s):
                await run(plan, outcome)
        except TimeoutError:
            outcome.status, outcome.reason = LOST, f"no final message in {self.stall_s:g}s"
        except Exception as exc:  # recorded, never dropped: the reason names the client
            outcome.status = LOST if outcome.admitted else REJECTED
            outcome.reason = f"client error: {exc!r}"[:300]
        outcome.ended_at = time.monotonic()
        return outcome

    # -- gRPC -------------------------------------------------------------------------------

    async def _send_grpc(self, plan: Plan, outcome: Outcome) -> None:
        params = SamplingParams(
            temperature=plan.temperature, max_tokens=plan.max_tokens, ignore_eos=True
        )
        stream = self._grpc.stream(plan.prompt, params)
        cancel = _cancel_timer(plan, outcome)
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    self._chunk(outcome, bool(chunk.token_ids))
                    outcome.request_id = chunk.request_id
                    if chunk.finished:
                        _final(outcome, chunk.finish_reason, chunk.error)
                        return
                    if _cancel_now(plan, outcome, cancel):
                        return
            outcome.status, outcome.reason = LOST, NO_FINAL
        except BucketServeError as err:
            code = err.code.name if hasattr(err.code, "name") else str(err.code)
            if outcome.admitted:
                outcome.status, outcome.reason = LOST, f"stream broke: {code}: {err.message}"
            else:
                outcome.status, outcome.reason = REJECTED, code
        except asyncio.CancelledError:
            if not _fired(cancel):
                raise
            asyncio.current_task().uncancel()
        finally:
            if cancel is not None:
                cancel.cancel()

    # -- HTTP -------------------------------------------------------------------------------

    async def _send_http(self, plan: Plan, outcome: Outcome) -> None:
        body = {
            "model": self.model, "prompt": plan.prompt, "max_tokens": plan.max_tokens,
            "temperature": plan.temperature, "ignore_eos": True, "stream": True,
        }
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        cancel = _cancel_timer(plan, outcome)
        try:
            async with self._http.post(
                f"{self.http_url}/v1/completions", json=body, headers=headers
            ) as response:
                if response.status != 200:
                    outcome.status, outcome.reason = REJECTED, f"HTTP {response.status}"
                    return
                outcome.admitted = True
                finish = None
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        if finish is None:
                            break
                        return
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        _final(outcome, "error", f"{error.get('code')} {error.get('message')}")
                        finish = "error"
                        continue
                    outcome.request_id = event.get("id", outcome.request_id)
                    choice = event["choices"][0]
                    self._chunk(outcome, bool(choice.get("text")))
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                        _final(outcome, finish, None)
                    elif _cancel_now(plan, outcome, cancel):
                        return
                if finish is None:
                    outcome.status, outcome.reason = LOST, NO_FINAL
        except aiohttp.ClientError as err:
            if outcome.admitted:
                outcome.status, outcome.reason = LOST, f"connection broke: {err!r}"
            else:
                outcome.status, outcome.reason = REJECTED, f"connection: {type(err).__name__}"
        except asyncio.CancelledError:
            if not _fired(cancel):
                raise
            asyncio.current_task().uncancel()
        finally:
            if cancel is not None:
                cancel.cancel()

    @staticmethod
    def _chunk(outcome: Outcome, has_text: bool) -> None:
        outcome.admitted = True
        outcome.chunks += 1
        if has_text and outcome.ttft_s is None:
            outcome.ttft_s = time.monotonic() - outcome.sent_at

    # -- malformed ----------------------------------------------------------------------------

    async def malformed_burst(self) -> dict[str, int]:
        """Every malformed request of MALFORMED_HTTP and MALFORMED_GRPC once; {how each was
        answered: count} ("invalid" is the answer wanted)."""
        answers: dict[str, int] = {}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for path, body in MALFORMED_HTTP:
            data = body if isinstance(body, bytes) else json.dumps(
                {"model": self.model, **body}
            ).encode()
            try:
                async with self._http.post(
                    f"{self.http_url}{path}", data=data, headers=headers
                ) as response:
                    await response.read()
                    answer = "invalid" if response.status == 400 else f"HTTP {response.status}"
            except aiohttp.ClientError as err:
                answer = f"connection: {type(err).__name__}"
            answers[answer] = answers.get(answer, 0) + 1
        stub = pb_grpc.GenerationStub(self._grpc.channel)
        metadata = [("authorization", f"Bearer {self.api_key}")] if self.api_key else None
        for request in MALFORMED_GRPC:
            try:
                async for _ in stub.Generate(request, timeout=60, metadata=metadata):
                    pass
                answer = "accepted"
            except grpc.aio.AioRpcError as err:
                invalid = err.code() == grpc.StatusCode.INVALID_ARGUMENT
                answer = "invalid" if invalid else f"gRPC {err.code().name}"
            answers[answer] = answers.get(answer, 0) + 1
        return answers


def _cancel_timer(plan: Plan, outcome: Outcome) -> asyncio.Task | None:
    """For a plan cancelled at a time rather than after some chunks: a timer that cancels
    the caller's task (leaving its stream, which cancels the request) `cancel_delay_s` after
    it was sent."""
    if plan.cancel_after != 0:
        return None
    task = asyncio.current_task()

    async def fire() -> None:
        await asyncio.sleep(plan.cancel_delay_s)
        outcome.status = CANCELLED
        outcome.reason = f"by the client, {plan.cancel_delay_s:.2f}s after sending"
        task.cancel()

    return asyncio.create_task(fire())


def _fired(timer: asyncio.Task | None) -> bool:
    """Whether a CancelledError came from our own cancel timer (it ends the request)."""
    return timer is not None and timer.done() and not timer.cancelled()


def _cancel_now(plan: Plan, outcome: Outcome, timer: asyncio.Task | None) -> bool:
    """Whether to leave the stream now (closing it cancels the request)."""
    if plan.cancel_after is None or plan.cancel_after == 0 or outcome.chunks < plan.cancel_after:
        return False
    if timer is not None:
        timer.cancel()
    outcome.status, outcome.reason = CANCELLED, f"by the client, after {outcome.chunks} chunks"
    return True


def _final(outcome: Outcome, finish_reason: str | None, error: str | None) -> None:
    if finish_reason in ("stop", "length"):
        outcome.status, outcome.reason = FINISHED, finish_reason
    elif finish_reason == "cancelled":
        outcome.status, outcome.reason = CANCELLED, f"by the server: {error}"
    else:
        outcome.status, outcome.reason = FAILED, error or str(finish_reason)


MALFORMED_HTTP: list[tuple[str, Any]] = [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"\xff\xfe not utf-8"),
    ("/v1/completions", {"max_tokens": 4}),  # no prompt
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/completions", {"prompt": "x", "top_p": 2.5}),
    ("/v1/completions", {"prompt": [1.5, 2.5]}),
    ("/v1/completions", {"prompt": "x", "stop": 5}),
    ("/v1/completions", {"prompt": [-7]}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
]

MALFORMED_GRPC: list[Any] = [
    pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=4)),  # no prompt
    pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(max_tokens=-1)),
    pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(temperature=-1.0)),
    pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(top_p=5.0)),
    pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(n=0)),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-5])),
    pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(logprobs=99)),
    pb.GenerateRequest(text="x", request_id="r" * 1000),
]
