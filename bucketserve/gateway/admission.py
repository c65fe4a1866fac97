"""The one validation and admission path both front ends (gRPC, HTTP) go through."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from numbers import Integral, Real
from typing import Any, TypeVar

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.gateway.backend import Backend
from bucketserve.gateway.errors import (
    BucketServeError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnavailableError,
    from_backend,
)
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.generation import Generation
from bucketserve.gateway.metrics import GatewayMetrics
from bucketserve.gateway.request_limits import RequestLimits, cache_salt, priority
from bucketserve.gateway.tenant_registry import TenantRegistry
from bucketserve.messages import ServeRequest
from bucketserve.runtime.core.grammar_compiler import validate_structured_outputs
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams

T = TypeVar("T")
Prompt = tuple[list[int], str | None]  # token ids, and the text they came from
MAX_REQUEST_ID_LEN = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_STRUCTURED_FIELD = re.compile(r"^structured_outputs(\.\w+)?")


class Admission:
    """Authenticates, validates, tokenizes, checks limits and the tenant's quota, then
    submits to the backend. Every refusal raises a BucketServeError and leaves no state:
    no quota taken, nothing queued. `running` maps request ids to their Generation.
    Every list a request carries is counted against `limits` before any element is looked
    at, and a text is measured before it is tokenized; tokenization and chat templates run
    in a thread pool, so a long prompt never stalls the event loop every stream shares."""

    def __init__(
        self,
        backend: Backend,
        registry: TenantRegistry,
        metrics: GatewayMetrics,
        config: GatewayConfig | None = None,
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.metrics = metrics
        self.config = config or GatewayConfig()
        self.pool = ThreadPoolExecutor(self.config.tokenizer_threads, "bucketserve-tokenize")
        self.running: dict[str, Generation] = {}
        self.draining = False
        self._drain_deadline = 0.0
        self.model = backend.model_info
        self.tokenizer = self.model.tokenizer
        self.max_model_len: int = self.model.max_model_len
        self.vocab_size: int = self.model.vocab_size

    async def admit(self, inp: GenerateInput, api_key: str | None) -> Generation:
        """Tokenizes text and chat in the pool, then checks and submits synchronously, so no
        other request interleaves between the checks and the submit. A token-id prompt
        needs no tokenizer: it is admitted without leaving the event loop."""
        with self.counted():
            self._open(api_key)
            priority(inp.priority)  # cheap checks before any tokenizing
            cache_salt(inp.cache_salt)
            if inp.sampling.get("structured_outputs") is not None:
                await self._structured(inp)
            if inp.prompt_token_ids is not None and inp.prompt is None and inp.messages is None:
                prompt = self._prompt(inp)
            else:
                prompt = await self.off_loop(self._prompt, inp)
            return self._admit(inp, prompt, api_key)

    @contextmanager
    def counted(self) -> Iterator[None]:
        """A refusal raised inside counts in `request_rejected_total` by its code: the
        edge's checks of a request's body (HTTP, gRPC) and admission's own."""
        try:
            yield
        except BucketServeError as exc:
            self.metrics.record_rejection(exc.code.name)
            raise

    async def _structured(self, inp: GenerateInput) -> None:
        """The request's output constraint, compiled in the pool (cached by spec); a
        schema, regex or grammar that does not compile is a 400 naming the field it came
        in."""
        spec = inp.sampling["structured_outputs"]
        try:
            if isinstance(spec, dict):
                spec = StructuredOutputsParams(**spec)
            elif not isinstance(spec, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be an object, got {spec!r}")
            await self.off_loop(validate_structured_outputs, spec)
        except (TypeError, ValueError) as exc:
            message, name = str(exc), inp.structured_name
            if name == "tools" and inp.tools:
                message, name = await self._bad_tool(inp.tools, message)
            if name != "structured_outputs":  # named as the request named it
                message = _STRUCTURED_FIELD.sub(name, message, count=1)
            if not message.startswith(name):
                message = f"{name}: {message}"
            raise InvalidArgumentError(message) from None
        inp.sampling["structured_outputs"] = spec

    async def _bad_tool(self, tools: list[dict[str, Any]], message: str) -> tuple[str, str]:
        """(message, field) naming the first tool whose schema does not compile; the
        constraint built from all of them failed with `message`."""
        for i, tool in enumerate(tools):
            schema = tool["function"].get("parameters")
            if not schema:
                continue
            try:
                spec = StructuredOutputsParams(json=schema)
                await self.off_loop(validate_structured_outputs, spec)
            except (TypeError, ValueError) as exc:
                return str(exc), f"tools[{i}] ({tool['function']['name']}) parameters"
        return message, "tools"

    @property
    def limits(self) -> RequestLimits:
        """What one request may carry, as of now (the longest prompt is the model's)."""
        return RequestLimits(self.config, self.model.max_prompt_len, self.max_model_len)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def tenant(self, api_key: str | None) -> TenantConfig:
        with self.counted():
            return self.registry.authenticate(api_key)

    async def abort(self, request_id: str, tenant: TenantConfig) -> bool:
        """Cancel a running request of `tenant`; False if none runs under that id."""
        gen = self.running.get(request_id)
        if gen is None:
            return False
        if gen.tenant.name != tenant.name:
            raise PermissionDeniedError(
                f"request {request_id!r} belongs to another tenant; abort only your own"
            )
        return await self.backend.abort(request_id)

    async def drain(self, grace_s: float, reason: str = "the server is shutting down") -> int:
        """Refuse new requests, give running ones `grace_s` to finish (cut short by
        hurry()), then abort the rest: their final message says `reason`. Returns how many
        were aborted."""
        self.draining = True
        self._drain_deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        left = list(self.running.values())
        for gen in left:
            gen.cancel_reason = reason
            await self.backend.abort(gen.request_id)
        give_up = time.monotonic() + 10.0  # their final messages are on their way
        while self.running and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        return len(left)

    def hurry(self) -> None:
        """End drain()'s grace period now."""
        self._drain_deadline = 0.0

    # -- admission -------------------------------------------------------------------------

    def _open(self, api_key: str | None) -> TenantConfig:
        tenant = self.registry.authenticate(api_key)
        if self.draining:
            raise UnavailableError("the server is shutting down; retry on another replica")
        return tenant

    def _admit(self, inp: GenerateInput, prompt: Prompt, api_key: str | None) -> Generation:
        tenant = self._open(api_key)
        request = self._build(inp, prompt, tenant)
        params = request.sampling_params
        cost = len(request.prompt_token_ids) + params.n * params.max_tokens
        quota = self.registry.quotas[tenant.name]
        quota.acquire(cost)
        try:
            stream = self.backend.submit(request)
        except Exception as exc:
            quota.release(cost)
            raise from_backend(exc) from exc
        gen = Generation(request, tenant, stream, self.backend.abort, self._on_done)
        self.running[request.request_id] = gen
        return gen

    def _on_done(self, gen: Generation) -> None:
        del self.running[gen.request_id]
        params = gen.request.sampling_params
        unused = params.n * params.max_tokens - gen.num_output_tokens
        self.registry.quotas[gen.tenant.name].release(unused)
        self.metrics.record(gen, time.monotonic())

    def _build(self, inp: GenerateInput, prompt: Prompt, tenant: TenantConfig) -> ServeRequest:
        token_ids, text = prompt
        n = len(token_ids)
        self.limits.prompt_tokens(n)
        params = self._sampling(inp.sampling, self.max_model_len - n)
        if n + params.max_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}, more than "
                f"the model's max_model_len of {self.max_model_len}; lower max_tokens to at "
                f"most {self.max_model_len - n}"
            )
        return ServeRequest(
            request_id=self._request_id(inp.request_id),
            prompt_token_ids=token_ids,
            sampling_params=params,
            tenant=tenant.name,
            priority=priority(inp.priority),
            prompt_text=text,
            slo_ttft_s=_positive("ttft_slo_s", inp.slo_ttft_s),
            slo_tpot_s=_positive("tpot_slo_s", inp.slo_tpot_s),
            cache_salt=cache_salt(inp.cache_salt),
        )

    def _prompt(self, inp: GenerateInput) -> Prompt:
        given = [x is not None for x in (inp.prompt, inp.prompt_token_ids, inp.messages)]
        if sum(given) != 1:
            raise InvalidArgumentError(
                "give exactly one of a prompt text, prompt token ids or chat messages"
            )
        if inp.prompt_token_ids is not None:
            if isinstance(inp.prompt_token_ids, (list, tuple)):  # the count before each id
                self.limits.prompt_tokens(len(inp.prompt_token_ids))
            return self.token_ids("prompt token ids", inp.prompt_token_ids), None
        if inp.messages is not None:
            text = self.chat_prompt(inp.messages, inp.tools)
            return self.tokenizer.encode(text, add_special_tokens=False), text
        if not isinstance(inp.prompt, str) or not inp.prompt:
            raise InvalidArgumentError("the prompt is empty; send some text")
        self.limits.prompt_chars("prompt", len(inp.prompt))
        token_ids = self.tokenizer.encode(inp.prompt)
        if not token_ids:
            raise InvalidArgumentError("the prompt encodes to no tokens; send some text")
        return token_ids, inp.prompt

    def chat_prompt(self, messages: Any, tools: list[dict[str, Any]] | None = None) -> str:
        if not isinstance(messages, list) or not messages:
            raise InvalidArgumentError("messages is empty; send at least one message")
        self.limits.chat_messages(len(messages))
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise InvalidArgumentError(f"messages[{i}].role must be one of {CHAT_ROLES}")
            calls = m.get("role") == "assistant" and m.get("tool_calls")
            content = m.get("content")
            if not isinstance(content, str) and not (calls and content is None):
                raise InvalidArgumentError(f"messages[{i}].content must be a string")
        self.limits.chat_contents(messages)
        extra = {} if tools is None else {"tools": tools}
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **extra
            )
        except ValueError as exc:
            raise InvalidArgumentError(f"messages: {exc}") from exc

    def token_ids(self, what: str, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidArgumentError(f"{what} are empty; send at least one token id")
        bad = [t for t in ids if not _is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"{what} {bad[:5]} are not integers in [0, {self.vocab_size}), the vocabulary"
            )
        return [int(t) for t in ids]

    def _sampling(self, sampling: dict[str, Any], room: int) -> SamplingParams:
        unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
        if unknown:
            raise InvalidArgumentError(
                f"unknown sampling parameters {unknown}; known: {list(SAMPLING_FIELDS)}"
            )
        kwargs = {k: v for k, v in sampling.items() if v is not None}
        kwargs.setdefault("max_tokens", room)
        self.limits.sampling(kwargs)  # every list counted before any element is checked
        for name in ("temperature", "top_p"):
            if name in kwargs and not _is_real(kwargs[name]):
                raise InvalidArgumentError(f"{name} must be a number, got {kwargs[name]!r}")
        try:
            params = SamplingParams(**kwargs)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        if params.stop_token_ids:
            self.token_ids("stop_token_ids", params.stop_token_ids)
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidArgumentError(
                f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        self.limits.stop(params.stop)  # a lone string became a list
        return params

    def _request_id(self, request_id: str | None) -> str:
        if not request_id:
            return f"req-{uuid.uuid4().hex}"
        if (
            not isinstance(request_id, str)
            or len(request_id) > MAX_REQUEST_ID_LEN
            or not request_id.isprintable()
        ):
            raise InvalidArgumentError(
                f"request_id must be printable text of at most {MAX_REQUEST_ID_LEN} characters"
            )
        if request_id in self.running:
            raise InvalidArgumentError(
                f"request_id {request_id!r} is already running; use a unique id or leave it "
                "empty for one to be generated"
            )
        return request_id


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not _is_real(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)
