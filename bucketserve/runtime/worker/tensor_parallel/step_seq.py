"""What a rank other than the head needs of a step's sequences: their tokens, block table
and progress, not their scheduling state (which only the head rank keeps)."""

from __future__ import annotations

from dataclasses import dataclass

from bucketserve.runtime.core.sequence import Sequence


@dataclass(frozen=True)
class PromptLogprobsParam:
    prompt_logprobs: int | None


class StepSeq:
    """A `Sequence` as `ModelRunner.step_logits` reads it, cheap to pickle to the ranks."""

    __slots__ = (
        "block_table",
        "num_computed_tokens",
        "num_prompt_tokens",
        "prompt_logprobs",
        "sampling_params",
        "seq_id",
        "token_ids",
    )

    def __init__(self, seq: Sequence) -> None:
        self.seq_id = seq.seq_id
        self.token_ids = seq.token_ids
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_computed_tokens = seq.num_computed_tokens
        self.block_table = seq.block_table
        self.sampling_params = PromptLogprobsParam(seq.sampling_params.prompt_logprobs)
        self.prompt_logprobs: dict = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)
