"""One request inside the LLMEngine: its `n` sample sequences, what its outputs have
delivered so far, and the RequestOutput each step makes of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.runtime.core.logprobs import TokenLogprob
from bucketserve.runtime.core.output_processor import OutputProcessor
from bucketserve.runtime.core.outputs import CompletionOutput, RequestOutput
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler
from bucketserve.runtime.core.sequence import FinishReason, Priority, Sequence
from bucketserve.runtime.core.tenant_tag import DEFAULT_TENANT, TenantTag


@dataclass
class SampleState:
    """One sample of a request and what its outputs have delivered of it."""

    seq: Sequence
    token_ids: list[int] = field(default_factory=list)  # output tokens delivered
    text: str = ""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # theirs, if asked
    ended: bool = False  # its last output went out


@dataclass
class EngineRequest:
    """A prompt and its `n` samples: sample 0 computes the prompt, the others fork from it."""

    request_id: str
    prompt: str | None
    samples: list[SampleState]
    prompt_logprobs: bool = False  # computed here and wanted
    prompt_logprob_list: list[TokenLogprob | None] | None = None  # once the prompt is done

    @classmethod
    def new(
        cls,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        priority: Priority = 0,
        tenant: TenantTag = DEFAULT_TENANT,
    ) -> EngineRequest:
        """The one way a request enters the runtime (the engine's, a prefill worker's): its
        `n` sample sequences, sample 0 named `request_id`, sample i `request_id#i`, each
        with its settings (`SamplingParams.sample(i)`). ValueError if malformed."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
        params.validate()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        parts = priority if isinstance(priority, tuple) else (priority,)
        if not parts or any(isinstance(p, bool) or not isinstance(p, int) for p in parts):
            raise ValueError(
                f"priority must be an integer (or a tuple of integers), got {priority!r}"
            )
        weight = getattr(tenant, "weight", None)
        if not isinstance(tenant, TenantTag) or not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"tenant must be a TenantTag with a weight > 0, got {tenant!r}")
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        settings = [params] if params.n == 1 else [params.sample(i) for i in range(params.n)]
        samples = [
            SampleState(
                Sequence(list(token_ids), p, seq_id, arrival_time, priority=priority, tenant=tenant)
            )
            for p, seq_id in zip(settings, ids, strict=True)
        ]
        return cls(request_id, prompt_text, samples)

    @property
    def seq(self) -> Sequence:
        return self.samples[0].seq

    @property
    def finished(self) -> bool:
        return all(s.ended for s in self.samples)

    def output(self, processor: OutputProcessor, scheduler: Scheduler) -> RequestOutput:
        """The request's output after its new tokens went through the output processor; a
        stop string ends that sample on the scheduler at once (its blocks freed)."""
        outputs = [self._completion(i, s, processor, scheduler) for i, s in enumerate(self.samples)]
        seq, first = self.seq, outputs[0]
        finished = self.finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=first.text,
            token_ids=first.token_ids,
            delta_text=first.delta_text,
            delta_token_ids=first.delta_token_ids,
            finished=finished,
            finish_reason=first.finish_reason if finished else None,
            stop_reason=seq.stop_reason,
            num_preemptions=seq.num_preemptions,
            metrics=seq.metrics,
            num_cached_tokens=seq.num_cached_tokens or 0,
            logprobs=first.logprobs,
            delta_logprobs=first.delta_logprobs,
            outputs=outputs,
            prompt_logprobs=self._prompt_logprobs(),
        )

    @staticmethod
    def _completion(
        index: int, sample: SampleState, processor: OutputProcessor, scheduler: Scheduler
    ) -> CompletionOutput:
        seq = sample.seq
        wants_logprobs = seq.sampling_params.logprobs is not None
        if sample.ended:
            return CompletionOutput(
                index, sample.text, list(sample.token_ids), finished=True,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(sample.logprobs) if wants_logprobs else None,
                delta_logprobs=[] if wants_logprobs else None,
            )
        reason = seq.finish_reason.value if seq.finish_reason is not None else None
        new = seq.output_token_ids[len(sample.token_ids) :]
        kept, text, finish_reason, stop = processor.process(seq.seq_id, new, reason)
        if stop is not None:
            if not seq.is_finished:
                scheduler.abort(seq.seq_id)
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
        start = len(sample.token_ids)
        sample.token_ids += kept
        sample.text += text
        sample.ended = finish_reason is not None
        delta_logprobs = None
        if wants_logprobs:
            delta_logprobs = [
                seq.output_logprobs.get(i) for i in range(start, len(sample.token_ids))
            ]
            sample.logprobs += delta_logprobs
        return CompletionOutput(
            index=index,
            text=sample.text,
            token_ids=list(sample.token_ids),
            delta_text=text,
            delta_token_ids=kept,
            finished=sample.ended,
            finish_reason=seq.finish_reason if sample.ended else None,
            stop_reason=seq.stop_reason,
            changed=bool(kept) or sample.ended,
            logprobs=None if delta_logprobs is None else list(sample.logprobs),
            delta_logprobs=delta_logprobs,
        )

    def _prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs, once its K/V is all computed here (None for the first token,
        OpenAI's convention)."""
        seq = self.seq
        if self.prompt_logprob_list is None:
            if not self.prompt_logprobs or seq.num_computed_tokens < seq.num_prompt_tokens:
                return None
            rest = [seq.prompt_logprobs.get(i) for i in range(1, seq.num_prompt_tokens)]
            self.prompt_logprob_list = [None, *rest]
        return self.prompt_logprob_list
