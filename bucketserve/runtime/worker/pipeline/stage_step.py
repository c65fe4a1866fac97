"""What the head of a stage group sends every stage for one microbatch."""

from __future__ import annotations

from dataclasses import dataclass

from bucketserve.runtime.core.sequence import Sequence

Shape = tuple[int, int, int]


@dataclass
class StageStep:
    """One microbatch as every stage sees it: each stage builds its own step inputs (positions,
    slots, block tables) from the sequences, as every worker of a vLLM executor does from the
    scheduler output; only hidden states travel between stages."""

    microbatch: int
    seqs: list[Sequence]
    num_new_tokens: list[int]
    pad_to: Shape | None = None
