"""The in-process engine: scheduler + block manager + model runner, stepped by the caller."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.engine_request import EngineRequest
from bucketserve.runtime.core.executor import ExecutionError
from bucketserve.runtime.core.grammar_compiler import validate_structured_outputs
from bucketserve.runtime.core.output_processor import OutputProcessor
from bucketserve.runtime.core.outputs import RequestOutput
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Priority, Sequence
from bucketserve.runtime.core.tenant_tag import DEFAULT_TENANT, TenantTag
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.pipeline.pipeline_executor import PipelineExecutor, make_executor
from bucketserve.runtime.worker.pipeline.pipeline_runner import PipelineRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_runner import TensorParallelRunner

Shape = tuple[int, int, int]
PadFn = Callable[[list[Sequence], list[int]], "Shape | None"]

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since the engine started."""

    steps: int = 0  # microbatches executed
    num_batched_tokens: int = 0  # tokens computed: prompts (and recomputes) and decodes
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_finished: int = 0


class LLMEngine:
    """Continuous batching in one process, one `step()` at a time.

    A step is the pipeline-parallel RFC's loop: `schedule()` a microbatch,
    `submit()` it to the executor, `finish()` the oldest in-flight microbatch
    (at once with depth 1; once the queue is full, or nothing new was
    scheduled, with deeper queues) and `update()` the scheduler with its
    tokens. Each step returns one RequestOutput per request that advanced,
    plus the final output of requests aborted since the last step.

    One thread steps the engine; others may add, abort and reserve blocks
    (under `lock`) meanwhile: the lock is held around the bookkeeping, not
    while the model runs. `pad_fn(seqs, num_new_tokens)` gives the shape a
    microbatch is padded to (None: unpadded). With `detokenize` the outputs carry text
    and stop strings end requests (bucketserve.runtime.core.output_processor); without it (a decode
    worker, whose text is the controller's) token ids only.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        runner: ModelRunner | None = None,
        pad_fn: PadFn | None = None,
        detokenize: bool = True,
    ):
        self.config = config = config or EngineConfig()
        if runner is not None and (
            config.pipeline_parallel_size > 1 or config.tensor_parallel_size > 1
        ):
            raise ValueError(
                "pipeline_parallel_size (tensor_parallel_size) builds the engine's own stages "
                "(ranks); pass either it or an existing runner, not both"
            )
        # the prefix cache is the engine's: an engine over a given runner may turn it off
        runner_options = config.runner.model_copy(update={"enable_prefix_caching": True})
        if runner is not None and runner_options != ModelRunnerConfig():
            raise ValueError(
                "model runner options (model, num_kv_blocks, ...) configure a new runner; "
                "pass either them or an existing runner, not both"
            )
        self._owns_runner = runner is None
        self.runner = runner or _new_runner(config)
        self.tokenizer = self.runner.tokenizer
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks,
            self.runner.block_size,
            enable_prefix_caching=config.runner.enable_prefix_caching
            and self.runner.config.enable_prefix_caching,
            cache_shares=config.scheduler.cache_shares,
        )
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            self.runner.max_model_len,
            eos_token_ids=self.runner.eos_token_ids,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.detokenize = detokenize
        self.executor = make_executor(
            self.runner, pad_fn, config.scheduler.pipeline_depth, self._execute_fn(pad_fn)
        )
        self.lock = threading.RLock()
        # a share of the running batch per microbatch, so every pipeline stage has work
        self._microbatch_seqs = -(-config.scheduler.max_num_seqs // self.executor.depth)
        self._arrival = threading.Event()  # a request came in: one of the loop's events
        self.stats = EngineStats()
        self._requests: dict[str, EngineRequest] = {}
        self._owners: dict[int | str, EngineRequest] = {}  # every sample's seq id -> its request
        self._pending: list[RequestOutput] = []  # produced outside step(): aborts, handoffs
        self._ids = itertools.count()

    @classmethod
    def from_kwargs(cls, runner: ModelRunner | None = None, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs), runner)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        prompt_text: str | None = None,
        arrival_time: float | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
        priority: Priority = 0,
        ttft_deadline: float | None = None,
        tpot_target: float | None = None,
        tenant: TenantTag = DEFAULT_TENANT,
    ) -> str:
        """Queue a prompt (text, or token ids shown as `prompt_text`); returns its request id.
        Raises ValueError, admitting nothing, if the request is malformed or can never fit.
        `priority`: lower runs first under `scheduling_policy="priority"`; an int (vLLM's),
        or a tuple of ints compared in order (the service's (tenant, request) pair, so a
        request's own priority never outranks another tenant's). `ttft_deadline`
        (`time.monotonic()`): when its first token is due; once that passes, it waits
        behind the requests of its priority that can still meet theirs. `tpot_target`
        (seconds per output token after the first): with `slo_admission`, new prompts wait
        rather than make it miss that.

        `output_token_ids`: tokens it generated before (a request resumed elsewhere); they
        are prefilled with the prompt, count towards max_tokens, and its first output holds
        them all, as after `add_prefilled_request`. `tenant`: whose it is (its fair share of
        tokens under the priority policy, and the prefix-cache domain it reads and names
        blocks in; `TenantTag(cache_salt=...)` alone is vLLM's `cache_salt`)."""
        with self.lock:
            request = self._prepare(
                prompt, sampling_params, request_id, prompt_text, arrival_time, priority, tenant
            )
            if ttft_deadline is not None:
                if isinstance(ttft_deadline, bool) or not isinstance(ttft_deadline, (int, float)):
                    raise ValueError(
                        f"ttft_deadline must be a time.monotonic() value, got {ttft_deadline!r}"
                    )
                for sample in request.samples:
                    sample.seq.ttft_deadline = float(ttft_deadline)
            _set_tpot_target(request, tpot_target)
            if output_token_ids:
                if len(request.samples) > 1:
                    raise ValueError("a request resumed with its outputs has one sample (n=1)")
                self._check_ids(list(output_token_ids))
                request.seq.token_ids.extend(int(t) for t in output_token_ids)
                request.prompt_logprobs = False
            return self._admit(request)

    def add_requests(
        self,
        prompts: list[str | list[int]],
        sampling_params: list[SamplingParams | None],
        prompt_texts: list[str | None] | None = None,
        priorities: list[int] | None = None,
    ) -> list[str]:
        """Queue several prompts, all or (on any bad one) none; returns their request ids."""
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} SamplingParams")
        if priorities is not None and len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities")
        texts = prompt_texts or [None] * len(prompts)
        with self.lock:
            requests = [
                self._prepare(prompt, params, None, text, None, priority)
                for prompt, params, text, priority in zip(
                    prompts, sampling_params, texts, priorities or [0] * len(prompts),
                    strict=True,
                )
            ]
            return [self._admit(request) for request in requests]

    def _prepare(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        prompt_text: str | None,
        arrival_time: float | None,
        priority: Priority = 0,
        tenant: TenantTag = DEFAULT_TENANT,
    ) -> EngineRequest:
        token_ids = self._encode(prompt)
        request = self._new_request(
            token_ids, sampling_params, request_id, arrival_time, prompt_text, priority, tenant
        )
        if isinstance(prompt, str):
            request.prompt = prompt
        self.scheduler.check(request.seq)
        self._check_stop(request.seq.sampling_params)
        self._check_constraints(request.seq.sampling_params)
        request.prompt_logprobs = request.seq.sampling_params.prompt_logprobs is not None
        return request

    def _admit(self, request: EngineRequest) -> str:
        seqs = [s.seq for s in request.samples]
        self.scheduler.add(seqs[0], forks=seqs[1:])
        self._register(request)
        self._arrival.set()
        return request.request_id

    def _register(self, request: EngineRequest) -> None:
        for sample in request.samples:
            self._track(sample.seq)
            self._owners[sample.seq.seq_id] = request
        self._requests[request.request_id] = request

    def _check_stop(self, params: SamplingParams) -> None:
        if params.stop and not self.detokenize:
            raise ValueError("this engine streams token ids only; stop strings are its caller's")

    def _check_constraints(self, params: SamplingParams) -> None:
        """The structured-output spec compiles (against the model's tokens where this
        process samples) and the logit bias names real tokens."""
        manager = getattr(self.runner, "structured", None)
        validate_structured_outputs(params.structured_outputs, manager and manager.compiler)
        if params.logit_bias:
            vocab = self.runner.model_config.vocab_size
            bad = [t for t in params.logit_bias if t >= vocab]
            if bad:
                raise ValueError(f"logit_bias names token ids {bad[:5]} outside [0, {vocab})")

    def _track(self, seq: Sequence) -> None:
        """Text and stop strings for `seq` (untracked requests yield token ids only)."""
        if self.detokenize:
            self.outputs.add(seq.seq_id, seq.prompt_token_ids, seq.sampling_params)

    def add_prefilled_request(
        self,
        prompt_token_ids: list[int],
        first_token_id: int,
        block_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        arrival_time: float | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
        priority: Priority = 0,
        tpot_target: float | None = None,
        tenant: TenantTag = DEFAULT_TENANT,
    ) -> str:
        """Take a request whose K/V was written into `block_ids` (reserved with
        `block_manager.reserve`) and whose first token was sampled elsewhere; it joins
        the running batch and its first token comes out of the next step().

        A request re-prefilled after it had streamed `output_token_ids` has the K/V of
        prompt + those tokens in `block_ids`, and `first_token_id` is its next token; it
        finishes by max_tokens counting all of them, and its first output holds them all.
        `tpot_target`: as for `add_request` (decode pacing keeps it)."""
        with self.lock:  # the ids come from the controller, validated at its edge
            token_ids = [int(t) for t in prompt_token_ids]
            request = self._new_request(
                token_ids, sampling_params, request_id, arrival_time, priority=priority,
                tenant=tenant,
            )  # fmt: skip
            if output_token_ids and len(request.samples) > 1:
                raise ValueError("a request resumed with its outputs has one sample (n=1)")
            _set_tpot_target(request, tpot_target)
            seq = request.seq
            seq.token_ids.extend(int(t) for t in (*output_token_ids, first_token_id))
            seq.num_computed_tokens = len(seq) - 1
            forks = [s.seq for s in request.samples[1:]]
            self.scheduler.add_prefilled(seq, block_ids, forks=forks)
            self._register(request)
            self._arrival.set()
            self._pending.append(self._output(request))
            return request.request_id

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Cancel a request (every sample of it, or only sample `index`) and free its
        blocks; its output with finish reason `cancelled` comes out of the next step().
        False if it (that sample) already finished."""
        with self.lock:
            request = self._requests.get(request_id)
            if request is None:
                return False
            samples = request.samples if index is None else request.samples[index : index + 1]
            live = [s.seq for s in samples if not s.seq.is_finished]
            if not live:
                return False
            for seq in live:
                if not seq.is_finished:  # a parent's abort ends the samples waiting for it
                    self.scheduler.abort(seq.seq_id)
            self._pending.append(self._output(request))
            self._arrival.set()  # its final output is due, and freed blocks may admit others
            return True

    def has_unfinished(self) -> bool:
        """Requests to finish, outputs to deliver, or (aborted) microbatches to land."""
        return bool(self._requests or self._pending or self.executor.num_in_flight)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        with self.lock:
            outputs, self._pending = self._pending, []
            self._arrival.clear()
            batch = self.scheduler.schedule(self._microbatch_limit())  # schedule()
        if batch:
            self.executor.submit(batch)  # submit()
        if not self.executor.num_in_flight or (batch and not self.executor.full):
            return outputs
        pipelined = isinstance(self.executor, PipelineExecutor)
        if not batch and pipelined and not self.executor.wait(self._arrival):
            return outputs  # a new request came in before the oldest microbatch ended
        try:
            done, tokens = self.executor.finish()  # finish()
        except ExecutionError as exc:
            logger.exception("model runner failed; ending %d requests", len(exc.batch))
            with self.lock:
                seqs = self.scheduler.fail(exc.batch)
                outputs.extend(self._outputs(seqs))
            return outputs
        with self.lock:
            seqs = self.scheduler.update(done, tokens)  # update()
            self._count(done, len(seqs))
            outputs.extend(self._outputs(seqs))
        return outputs

    def close(self) -> None:
        self.executor.shutdown()
        if self._owns_runner and isinstance(self.runner, TensorParallelRunner):
            self.runner.shutdown()

    def _microbatch_limit(self) -> int:
        """Over stages, the unfinished requests shared out so every stage gets a microbatch
        (a request is in one in-flight microbatch at most)."""
        if not isinstance(self.executor, PipelineExecutor):
            return self._microbatch_seqs
        share = -(-len(self._requests) // self.executor.depth)
        return max(1, min(self._microbatch_seqs, share))

    # -- helpers -----------------------------------------------------------------------------

    def _execute_fn(self, pad_fn: PadFn | None):
        if pad_fn is None:
            return self.runner.execute
        return lambda seqs, counts: self.runner.execute(seqs, counts, pad_to=pad_fn(seqs, counts))

    def _outputs(self, seqs: list[Sequence]) -> list[RequestOutput]:
        requests = {id(r): r for r in (self._owners[s.seq_id] for s in seqs)}
        return [self._output(r) for r in requests.values()]

    def _count(self, batch: SchedulerOutput, num_tokens: int) -> None:
        stats = self.stats
        stats.steps += 1
        stats.num_generated_tokens += num_tokens
        stats.num_batched_tokens += batch.num_tokens
        stats.num_preemptions = self.scheduler.num_preemptions

    def _output(self, request: EngineRequest) -> RequestOutput:
        out = request.output(self.outputs, self.scheduler)
        if out.finished:
            del self._requests[request.request_id]
            for sample in request.samples:
                del self._owners[sample.seq.seq_id]
            self.stats.num_finished += 1
        return out

    def _new_request(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams | None,
        request_id: str | None,
        arrival_time: float | None,
        prompt_text: str | None = None,
        priority: Priority = 0,
        tenant: TenantTag = DEFAULT_TENANT,
    ) -> EngineRequest:
        params = SamplingParams() if sampling_params is None else sampling_params
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request = EngineRequest.new(
            token_ids, params, request_id, arrival_time, prompt_text, priority, tenant
        )
        for sample in request.samples:
            seq_id = sample.seq.seq_id
            if seq_id in self._requests or seq_id in self._owners:
                raise ValueError(f"request id {seq_id!r} is already in use")
        return request

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            self._check_ids(prompt)
            token_ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt)}")
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        return token_ids

    def _check_ids(self, token_ids: list[int] | tuple[int, ...]) -> None:
        vocab = self.runner.model_config.vocab_size
        bad = [
            t
            for t in token_ids
            if not isinstance(t, Integral) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are not integers in [0, {vocab})")


def _new_runner(config: EngineConfig) -> ModelRunner | PipelineRunner:
    if config.pipeline_parallel_size > 1:
        return PipelineRunner.local(
            config.runner, config.pipeline_parallel_size, config.stage_torch_threads,
            config.tensor_parallel_size,
        )  # fmt: skip
    if config.tensor_parallel_size > 1:
        return TensorParallelRunner(
            config.runner, config.tensor_parallel_size, config.stage_torch_threads
        )
    return ModelRunner(config.runner)


def _set_tpot_target(request: EngineRequest, tpot_target: float | None) -> None:
    if tpot_target is None:
        return
    bad = isinstance(tpot_target, bool) or not isinstance(tpot_target, (int, float))
    if bad or not tpot_target > 0:
        raise ValueError(f"tpot_target must be a positive number of seconds, got {tpot_target!r}")
    for sample in request.samples:
        sample.seq.tpot_target = float(tpot_target)
