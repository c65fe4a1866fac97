"""How much one request may carry, checked by the size of each list or text before any
work per element (torch-free). Both front ends check through it, the HTTP body parser as
it reads the JSON and admission again for gRPC, so each refusal reads the same: the field,
what it holds, the limit and the config key that sets it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.gateway_config import GatewayConfig

PRIORITY_RANGE = (-(2**31), 2**31 - 1)  # the proto's int32, so both front ends take the same


@dataclass(frozen=True)
class RequestLimits:
    """`config` holds the gateway's limits; `max_prompt_tokens` is the longest prompt the
    service admits and `max_model_len` the longest sequence (None: unbounded, as where no
    model is served: parsing alone)."""

    config: GatewayConfig = field(default_factory=GatewayConfig)
    max_prompt_tokens: int | None = None
    max_model_len: int | None = None

    def prompt_tokens(self, n: int) -> None:
        most = self.max_prompt_tokens
        if most is not None and n > most:
            raise InvalidArgumentError(
                f"the prompt has {n} tokens but this service admits at most {most} "
                f"(model.max_model_len is {self.max_model_len}); shorten the prompt"
            )

    def prompt_chars(self, what: str, n: int) -> None:
        """`what`: the text's field, e.g. `prompt`, or `messages` for their contents."""
        most = self.config.max_prompt_chars
        if n > most:
            raise InvalidArgumentError(
                f"{what} is {n} characters; this server takes at most {most} before "
                "tokenizing (gateway.max_prompt_chars); shorten it"
            )

    def chat_messages(self, n: int) -> None:
        most = self.config.max_chat_messages
        if n > most:
            raise InvalidArgumentError(
                f"messages has {n} entries; this server takes at most {most} "
                "(gateway.max_chat_messages)"
            )

    def content_parts(self, n: int) -> None:
        """The text parts of one message's content (as many as a chat's messages)."""
        most = self.config.max_chat_messages
        if n > most:
            raise InvalidArgumentError(
                f"a message's content has {n} parts; this server takes at most {most} "
                "(gateway.max_chat_messages)"
            )

    def chat_contents(self, messages: Sequence[Any]) -> None:
        """The characters of every message's content together (count checked first)."""
        self.chat_messages(len(messages))
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        self.prompt_chars("messages' content", chars)

    def stop_token_ids(self, n: int) -> None:
        most = self.config.max_stop_token_ids
        if n > most:
            raise InvalidArgumentError(
                f"stop_token_ids has {n} ids; this server takes at most {most} "
                "(gateway.max_stop_token_ids)"
            )

    def stop_count(self, n: int) -> None:
        most = self.config.max_stop_strings
        if n > most:
            raise InvalidArgumentError(
                f"stop has {n} strings; this server takes at most {most} "
                "(gateway.max_stop_strings)"
            )

    def stop(self, stop: Sequence[Any]) -> None:
        """Matching costs work per output token in proportion to the stop strings."""
        self.stop_count(len(stop))
        chars = sum(len(s) for s in stop if isinstance(s, str))
        most = self.config.max_stop_chars
        if chars > most:
            raise InvalidArgumentError(
                f"stop strings are {chars} characters in all; this server takes at most "
                f"{most} (gateway.max_stop_chars)"
            )

    def detokenize(self, n: int) -> None:
        most = self.max_model_len
        if most is not None and n > most:
            raise InvalidArgumentError(
                f"tokens has {n} ids; this server detokenizes at most {most} "
                "(model.max_model_len)"
            )

    def logit_bias(self, n: int) -> None:
        most = self.config.max_logit_bias
        if n > most:
            raise InvalidArgumentError(
                f"logit_bias has {n} entries; this server takes at most {most} "
                "(gateway.max_logit_bias)"
            )

    def tools(self, n: int) -> None:
        most = self.config.max_tools
        if n > most:
            raise InvalidArgumentError(
                f"tools has {n} entries; this server takes at most {most} (gateway.max_tools)"
            )

    def logprobs(self, what: str, k: Any) -> None:
        """`k` top logprobs per token under the name `what` (its type is checked later)."""
        most = self.config.max_logprobs
        if _is_int(k) and k > most:
            raise InvalidArgumentError(
                f"{what} is {k}; this server returns at most {most} top logprobs per token "
                "(gateway.max_logprobs)"
            )

    def n(self, n: Any) -> None:
        most = self.config.max_n
        if _is_int(n) and n > most:
            raise InvalidArgumentError(
                f"n is {n}; this server samples at most {most} choices per request "
                "(gateway.max_n)"
            )

    def sampling(self, sampling: dict[str, Any]) -> None:
        """The lists and counts among SamplingParams keywords, before any is built."""
        stop_ids = sampling.get("stop_token_ids")
        if isinstance(stop_ids, (list, tuple)):
            self.stop_token_ids(len(stop_ids))
        stop = sampling.get("stop")
        if isinstance(stop, (list, tuple)):
            self.stop(stop)
        bias = sampling.get("logit_bias")
        if isinstance(bias, dict):
            self.logit_bias(len(bias))
        for name in ("logprobs", "prompt_logprobs"):
            self.logprobs(name, sampling.get(name))
        self.n(sampling.get("n"))


def priority(value: Any) -> int:
    """A request's own priority: an int32, lower first among its tenant's requests."""
    low, high = PRIORITY_RANGE
    if not _is_int(value) or not low <= value <= high:
        raise InvalidArgumentError(
            f"priority must be an integer in [{low}, {high}] (lower is served first among "
            f"your tenant's requests), got {_shown(value)}"
        )
    return int(value)


def _shown(value: Any) -> str:
    if _is_int(value):
        bits = value.bit_length()
        return str(value) if bits <= 64 else f"an integer of {bits} bits"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_CACHE_SALT = 256  # characters of a request's cache_salt


def cache_salt(value: Any) -> str | None:
    """A request's `cache_salt`: None, or 1 to MAX_CACHE_SALT characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CACHE_SALT:
        raise InvalidArgumentError(
            f"cache_salt must be a string of 1 to {MAX_CACHE_SALT} characters, got {_shown(value)}"
        )
    return value
