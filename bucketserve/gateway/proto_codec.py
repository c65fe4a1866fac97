"""Between `bucketserve.v1` messages and the gateway's types, both directions.

The server reads a GenerateRequest into a GenerateInput and writes StreamDeltas
as GenerateResponses; the SDK does the reverse, so the two never disagree.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from bucketserve.gateway.generate_input import GenerateInput
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.sdk_types import Chunk
from bucketserve.messages import RequestTimings, StreamDelta
from bucketserve.runtime.core.logprobs import TokenLogprob

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
}
_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}
_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logprobs",
    "n",
    "prompt_logprobs",
)
_PROMPT_KINDS = ("text", "token_ids", "chat")
# StructuredOutputs' oneof <-> StructuredOutputsParams' fields
_STRUCTURED = {"json_schema": "json", "regex": "regex", "choice": "choice",
               "grammar": "grammar", "json_object": "json_object"}


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Field numbers the server's schema does not know, anywhere in `message` (binary
    clients built from a newer or different .proto send them; protobuf keeps them quietly)."""
    path = path or message.DESCRIPTOR.name
    found = [f"{path} #{f.field_number}" for f in UnknownFieldSet(message)]
    for desc, value in message.ListFields():
        if desc.message_type is None or desc.message_type.GetOptions().map_entry:
            continue
        children = value if desc.is_repeated else [value]
        for i, child in enumerate(children):
            index = f"[{i}]" if desc.is_repeated else ""
            found += unknown_fields(child, f"{path}.{desc.name}{index}")
    return found


# -- server side ---------------------------------------------------------------------------


def request_to_input(request: pb.GenerateRequest) -> GenerateInput:
    inp = GenerateInput(
        request_id=request.request_id or None,
        priority=request.priority,
        slo_ttft_s=request.ttft_slo_s if request.HasField("ttft_slo_s") else None,
        slo_tpot_s=request.tpot_slo_s if request.HasField("tpot_slo_s") else None,
        sampling=_sampling_from(request.sampling_params),
    )
    if request.sampling_params.HasField("structured_outputs"):
        kind = request.sampling_params.structured_outputs.WhichOneof("kind")
        inp.structured_name = "sampling_params.structured_outputs" + (f".{kind}" if kind else "")
    kind = request.WhichOneof("prompt")
    if kind == "text":
        inp.prompt = request.text
    elif kind == "token_ids":
        inp.prompt_token_ids = list(request.token_ids.ids)
    elif kind == "chat":
        inp.messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    return inp


def _sampling_from(params: pb.SamplingParams) -> dict[str, Any]:
    sampling: dict[str, Any] = {n: getattr(params, n) for n in _OPTIONAL_SAMPLING}
    sampling = {n: v for n, v in sampling.items() if params.HasField(n)}
    sampling.update(
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.logit_bias:
        sampling["logit_bias"] = dict(params.logit_bias)
    if params.HasField("structured_outputs"):
        sampling["structured_outputs"] = _structured_from(params.structured_outputs)
    return sampling


def _structured_from(so: pb.StructuredOutputs) -> dict[str, Any]:
    kind = so.WhichOneof("kind")
    if kind is None:
        return {}  # admission names the missing kind
    value: Any = getattr(so, kind)
    if kind == "choice":
        value = list(value.choices)
    return {_STRUCTURED[kind]: value, "disable_any_whitespace": so.disable_any_whitespace}


def delta_to_response(delta: StreamDelta, cancel_reason: str | None = None) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=delta.request_id, token_ids=delta.token_ids, text=delta.text, index=delta.index
    )
    if delta.logprobs is not None:
        _write_logprobs(response.logprobs, delta.logprobs)
    if delta.prompt_logprobs is not None:
        _write_logprobs(response.prompt_logprobs, delta.prompt_logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = FINISH_REASONS.get(delta.finish_reason, 0)
    if delta.finished:
        final = response.final
        final.finish_reason = FINISH_REASONS.get(delta.finish_reason or "error", 0)
        cancelled = delta.finish_reason == "cancelled"
        final.error = delta.error or (cancel_reason if cancelled else None) or ""
        final.usage.prompt_tokens = delta.num_prompt_tokens
        final.usage.completion_tokens = delta.num_output_tokens
        final.usage.cached_tokens = delta.num_cached_tokens
        if delta.timings is not None:
            final.timings.CopyFrom(pb.Timings(**dataclasses.asdict(delta.timings)))
        if delta.request_bucket is not None:
            low, up = delta.request_bucket
            final.request_bucket.CopyFrom(pb.RequestBucket(low=low, up=up))
        if delta.shape_bucket is not None:
            batch, query, blocks = delta.shape_bucket
            final.shape_bucket.CopyFrom(pb.ShapeBucket(batch=batch, query=query, blocks=blocks))
    return response


def _write_logprobs(field: Any, logprobs: list[TokenLogprob | None]) -> None:
    for lp in logprobs:
        out = field.add()
        if lp is not None:
            out.logprob = lp.logprob
            out.top.extend(pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top)


# -- client side ---------------------------------------------------------------------------


def input_to_request(inp: GenerateInput, stream: bool) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=inp.request_id or "", priority=inp.priority, stream=stream
    )
    if inp.slo_ttft_s is not None:
        request.ttft_slo_s = inp.slo_ttft_s
    if inp.slo_tpot_s is not None:
        request.tpot_slo_s = inp.slo_tpot_s
    if inp.prompt is not None:
        request.text = inp.prompt
    elif inp.prompt_token_ids is not None:
        request.token_ids.ids.extend(inp.prompt_token_ids)
    elif inp.messages is not None:
        for m in inp.messages:
            request.chat.messages.add(role=m["role"], content=m["content"])
    params = request.sampling_params
    for name, value in inp.sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(params, name).extend(value)
        elif name == "logit_bias":
            params.logit_bias.update({int(k): float(v) for k, v in value.items()})
        elif name == "structured_outputs":
            _write_structured(params.structured_outputs, value)
        else:
            setattr(params, name, value)
    return request


def _write_structured(out: pb.StructuredOutputs, spec: Any) -> None:
    """`spec`: a StructuredOutputsParams or its fields as a dict."""
    fields = spec if isinstance(spec, dict) else dataclasses.asdict(spec)
    out.disable_any_whitespace = bool(fields.get("disable_any_whitespace"))
    for kind, name in _STRUCTURED.items():
        value = fields.get(name)
        if value is None or value is False:
            continue
        if kind == "json_schema":
            out.json_schema = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            out.choice.choices.extend(value)
        else:
            setattr(out, kind, value)


def response_to_chunk(response: pb.GenerateResponse) -> Chunk:
    chunk = Chunk(
        response.request_id, list(response.token_ids), response.text, index=response.index
    )
    if len(response.logprobs):
        chunk.logprobs = _read_logprobs(response.logprobs)
    if len(response.prompt_logprobs):
        chunk.prompt_logprobs = _read_logprobs(response.prompt_logprobs)
    if response.finish_reason:
        chunk.finish_reason = _REASON_NAMES.get(response.finish_reason, "error")
    if response.HasField("final"):
        final = response.final
        chunk.finished = True
        chunk.finish_reason = _REASON_NAMES.get(final.finish_reason, "error")
        chunk.error = final.error or None
        chunk.prompt_tokens = final.usage.prompt_tokens
        chunk.completion_tokens = final.usage.completion_tokens
        chunk.cached_tokens = final.usage.cached_tokens
        if final.HasField("timings"):
            t = final.timings
            chunk.timings = RequestTimings(
                t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s, t.decode_s
            )
        if final.HasField("request_bucket"):
            chunk.request_bucket = (final.request_bucket.low, final.request_bucket.up)
        if final.HasField("shape_bucket"):
            s = final.shape_bucket
            chunk.shape_bucket = (s.batch, s.query, s.blocks)
    return chunk


def _read_logprobs(field: Any) -> list[TokenLogprob | None]:
    return [
        TokenLogprob(lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        if lp.HasField("logprob")
        else None
        for lp in field
    ]
