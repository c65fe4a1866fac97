"""What the scheduler hands the executor for one step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.runtime.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    """One microbatch: compute `num_new_tokens[i]` tokens of `seqs[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    scheduled_at: float = 0.0  # time.monotonic() when it was scheduled
    alone: bool = True  # no other microbatch was in flight then: its time is its own

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)
