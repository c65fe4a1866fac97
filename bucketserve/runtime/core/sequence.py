"""One request's token stream and KV bookkeeping (torch-free)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import Enum, auto

from bucketserve.runtime.core.logprobs import TokenLogprob, logprob_of
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.tenant_tag import DEFAULT_TENANT, TenantTag

_seq_counter = itertools.count()

# Lower runs first: an int (the offline API's, as vLLM's) or a tuple of ints compared in
# order (the service's (tenant priority, request priority)).
Priority = int | tuple[int, ...]


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length reached
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class SequenceMetrics:
    """Monotonic timestamps (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


class Sequence:
    """Prompt plus generated tokens, and where their KV lives.

    `num_computed_tokens` counts tokens whose K/V is in the pool; the model
    runner computes `token_ids[num_computed_tokens:num_computed_tokens + n]`
    and only the scheduler's update() advances the counter.
    `block_table` lists physical block ids, logical block i at index i.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        seq_id: int | str | None = None,
        arrival_time: float | None = None,
        output_token_ids: Iterable[int] = (),
        priority: Priority = 0,
        ttft_deadline: float | None = None,
        tpot_target: float | None = None,
        tenant: TenantTag = DEFAULT_TENANT,
    ) -> None:
        """`output_token_ids`: tokens generated before, for a request that resumes elsewhere;
        `priority`: lower is scheduled first under the priority policy (an int, or a tuple
        of ints compared in order: the service's (tenant, request) pair); `ttft_deadline`:
        when (`time.monotonic()`) its first token is due, if it has a TTFT target;
        `tpot_target`: the mean seconds per output token after the first it should keep;
        `tenant`: its fair share and prefix-cache domain."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.seq_id = next(_seq_counter) if seq_id is None else seq_id
        self.token_ids: list[int] = [*prompt_token_ids, *output_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self._stop_set_of: SamplingParams | None = None  # the params _stop_set was made of
        self._stop_set: frozenset[int] = frozenset()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.ttft_deadline = ttft_deadline
        self.tpot_target = tpot_target
        self.tenant = tenant
        self.metrics = SequenceMetrics(self.arrival_time)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string matched
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # of its full blocks, extended as they fill
        self.num_cached_tokens: int | None = None  # found in the prefix cache when first run
        self.num_preemptions = 0
        # output token index -> its logprobs, kept when the request asks for them (tokens
        # generated elsewhere have none here)
        self.output_logprobs: dict[int, TokenLogprob] = {}
        # prompt position -> the logprobs of the prompt token there (position >= 1), written
        # by the model runner for a request that asks for prompt logprobs
        self.prompt_logprobs: dict[int, TokenLogprob] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, status={self.status.name})"
        )

    def is_late(self, now: float) -> bool:
        """Its first token was due before `now` and it has none yet."""
        deadline = self.ttft_deadline
        return deadline is not None and now > deadline and not self.num_output_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V is not in the pool yet: the next step's work."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def stop_token_set(self) -> frozenset[int]:
        """Its params' stop token ids as a set, looked up for every generated token (made
        again only if the params are replaced)."""
        params = self.sampling_params
        if self._stop_set_of is not params:
            self._stop_set_of, self._stop_set = params, frozenset(params.stop_token_ids)
        return self._stop_set

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append a sampled token; a SampledToken's logprobs are kept when asked for."""
        logprob = logprob_of(token_id)
        if logprob is not None:
            self.output_logprobs[self.num_output_tokens] = logprob
        self.token_ids.append(int(token_id))


def finish_reason(
    seq: Sequence, token: int, eos_token_ids: Collection[int], max_seq_len: int
) -> FinishReason | None:
    """Why `seq` ends with `token`, its newest token (None: it goes on); records the stop
    token matched. Shared with a prefill worker judging the first token. Stop strings are
    the output processor's (bucketserve.runtime.core.output_processor)."""
    params = seq.sampling_params
    if seq.num_output_tokens > params.min_tokens:  # none stops before min_tokens
        if not params.ignore_eos and token in eos_token_ids:
            return FinishReason.STOP
        if token in seq.stop_token_set:
            seq.stop_reason = token
            return FinishReason.STOP
    if seq.num_output_tokens >= params.max_tokens or len(seq) >= max_seq_len:
        return FinishReason.LENGTH
    return None
