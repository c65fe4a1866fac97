"""Token ids in, text out: the one place that detokenizes, matches stop strings and settles
finish reasons (torch-free). The service's controller and the in-process LLMEngine each keep
one; workers and schedulers deal in token ids and stop *token* ids only."""

from __future__ import annotations

from collections.abc import Sequence

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.io.detokenizer import Decoder, Detokenizer


class OutputProcessor:
    """Per-request incremental detokenization with stop strings, keyed by request id.

    `add` a request when it is admitted, `process` each batch of new token ids (with the
    generator's finish reason once it has one: eos, a stop token id, length, cancelled,
    error), `remove` one that ends without a final batch. A request's state is dropped
    when `process` ends it.
    """

    def __init__(self, tokenizer: Decoder | None) -> None:
        self.tokenizer = tokenizer
        self._detok: dict[str, Detokenizer] = {}
        # requests with min_tokens and stop strings: [min_tokens, tokens seen, stop strings]
        self._min_tokens: dict[str, list] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._detok

    def add(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Raises ValueError for stop strings without a tokenizer to find them with."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass one to the OutputProcessor")
        if self.tokenizer is not None:
            self._detok[request_id] = Detokenizer(
                self.tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens
            )
            if params.stop and params.min_tokens > 1:
                self._min_tokens[request_id] = [params.min_tokens, 0, list(params.stop)]

    def text(self, request_id: str) -> str:
        detok = self._detok.get(request_id)
        return "" if detok is None else detok.text

    def process(
        self, request_id: str, token_ids: Sequence[int], finish_reason: str | None = None
    ) -> tuple[list[int], str, str | None, str | None]:
        """What `token_ids` add to the request's output: the tokens kept (none past a stop
        string), their text, the finish reason once it ended, and the stop string that
        ended it, if one did. A stop string inside them ends the request there (finish
        reason `stop`): whoever generates its tokens must abort it."""
        detok = self._detok.get(request_id)
        if detok is None:  # no tokenizer: token ids only
            return list(token_ids), "", finish_reason, None
        kept: list[int] = []
        text = ""
        early = self._min_tokens.get(request_id)
        for token in token_ids:
            kept.append(token)
            if early is not None:  # as vLLM: no stop string ends it before min_tokens
                early[1] += 1
                detok.stop = [] if early[1] < early[0] else early[2]
            text += detok.push(token)
            if detok.stopped:
                self.remove(request_id)
                return kept, text, "stop", detok.stop_reason
        if finish_reason is None:
            return kept, text, None, None
        if finish_reason != "cancelled":
            text += detok.flush()
        self.remove(request_id)
        return kept, text, finish_reason, None

    def remove(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._min_tokens.pop(request_id, None)
