"""The baseline: transformers `generate` over static, left-padded batches (the blog's naive
batching). Each batch runs until its longest sequence is done."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class _StepClock:
    """A logits processor that only notes when each decode step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


@dataclass
class SequenceTrace:
    """One sequence of a static batch: when its tokens came and how many steps it needed."""

    num_tokens: int  # real output tokens, the EOS included
    steps_run: int  # steps its batch ran
    first_token: float
    last_token: float
    finished: float  # when its batch returned


@dataclass
class StaticRun:
    traces: list[SequenceTrace] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)


def run_static(
    model,
    prompts: list[list[int]],
    batch_size: int,
    max_new_tokens: int,
    pad_token_id: int,
    eos_token_ids: set[int],
) -> StaticRun:
    """Generate for `prompts` in order, `batch_size` at a time."""
    run = StaticRun()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_token_id,
                logits_processor=[clock],
            )
        done = time.perf_counter()
        for row in out[:, width:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos_token_ids), len(row))
            run.token_ids.append(row[:n])
            run.traces.append(
                SequenceTrace(n, len(clock.times), clock.times[0], clock.times[n - 1], done)
            )
    return run
