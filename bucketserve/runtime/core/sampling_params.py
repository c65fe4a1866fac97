"""Per-request sampling settings (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams

MAX_N = 16  # the most samples one request may ask for
MAX_LOGPROBS = 20  # the most top logprobs a token may carry (vLLM's default max_logprobs)
LOGIT_BIAS_LIMIT = 100.0  # a bias is clamped to [-100, 100], as OpenAI and vLLM do


@dataclass
class SamplingParams:
    """How to pick tokens for one request; vLLM's names and meanings.

    temperature == 0 means greedy. `seed` makes a sampled request reproducible
    whatever else shares its batch: the generator for output token i is
    derived from (seed, i) alone, so preemption, recompute and a prefill /
    decode handoff all give the same tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    # penalties (vLLM's): presence / frequency over the output tokens, repetition over
    # prompt + output; 0.0, 0.0 and 1.0 change nothing
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability
    min_tokens: int = 0  # EOS and stop token ids suppressed until this many tokens
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k's
    n: int = 1  # samples of one prompt, prefilled once (sample i seeded with seed + i)
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and the top k's
    # the output must match a JSON schema, regex, choice or grammar (masked in the sampler)
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    skip_special_tokens: bool = True  # leave special tokens out of the detokenized text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = _clamped_bias(self.logit_bias)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def sample(self, index: int) -> SamplingParams:
        """The settings of sample `index` of n: n=1, its own seed (seed + index) if seeded;
        the prompt's logprobs are the request's, computed once (by sample 0)."""
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise ValueError naming the field and the allowed range."""
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}"
            )
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if self.logprobs is not None and (
            not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.prompt_logprobs is not None and (
            not _integer(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                f"got {self.prompt_logprobs!r}"
            )
        if not _integer(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.validate()
        if self.logit_bias is not None:
            _check_bias(self.logit_bias)
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(
                f"skip_special_tokens must be a bool, got {self.skip_special_tokens!r}"
            )


def _clamped_bias(bias: object) -> object:
    """Keys as ints (OpenAI's JSON sends them as strings), values clamped to the limit;
    anything malformed is left for validate() to name."""
    if not isinstance(bias, dict):
        return bias
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if _number(value) and math.isfinite(value):
            value = min(max(float(value), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
        out[key] = value
    return out


def _check_bias(bias: object) -> None:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    for key, value in bias.items():
        if not _integer(key) or key < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        if not _number(value) or not math.isfinite(value):
            raise ValueError(f"logit_bias[{key}] must be a finite number, got {value!r}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
