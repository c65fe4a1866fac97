"""The JSON shapes of OpenAI responses, chunks and errors."""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import BucketServeError
from gateway.openai_request import OpenAIRequest
from kv_worker.messages import StreamDelta

OPENAI_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM's "abort"


class OpenAIFormat:
    """The OpenAI JSON shapes of one request's responses."""

    def __init__(self, oai: OpenAIRequest, request_id: str, model: str) -> None:
        self.oai = oai
        self.id = f"{'chatcmpl' if oai.chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _base(self, suffix: str) -> dict[str, Any]:
        kind = "chat.completion" if self.oai.chat else "text_completion"
        obj = f"{kind}{suffix}" if self.oai.chat else kind
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self, text: str | None = None, role: str | None = None, finish_reason: str | None = None
    ) -> dict[str, Any]:
        if self.oai.chat:
            delta = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        out = self._base(".chunk") | {"choices": [choice]}
        if self.oai.include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def finish_reason(final: StreamDelta) -> str:
        return OPENAI_FINISH.get(final.finish_reason or "", "stop")

    def usage_chunk(self, final: StreamDelta) -> dict[str, Any]:
        return self._base(".chunk") | {"choices": [], "usage": _usage(final)}

    def whole(self, final: StreamDelta, text: str) -> dict[str, Any]:
        reason = self.finish_reason(final)
        if self.oai.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": reason}
        return self._base("") | {"choices": [choice], "usage": _usage(final)}


def _usage(final: StreamDelta) -> dict[str, int]:
    prompt, completion = final.num_prompt_tokens, final.num_output_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def error_body(error: BucketServeError) -> dict[str, Any]:
    """OpenAI's error object for a BucketServeError."""
    return {
        "error": {
            "message": error.message,
            "type": error.openai_type,
            "param": None,
            "code": error.http_status,
        }
    }
