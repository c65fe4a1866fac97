"""What computing prompt tokens costs in time on the workers that compute them: the TTFT a
request can expect behind the queue ahead of it (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCost:
    """`prefill_token_s`: seconds a prompt token costs (the workers' own measurements);
    `step_s` and `step_tokens`: where prompts are computed within decode steps (the
    colocated engine), each step's fixed cost and the most prompt tokens it computes;
    `workers`: how many compute prompts side by side, sharing the tokens evenly."""

    prefill_token_s: float
    step_s: float = 0.0
    step_tokens: int | None = None
    workers: int = 1

    def seconds(self, tokens: float) -> float:
        """Until the last of `tokens` prompt tokens is computed (and its first token out)."""
        share = tokens / self.workers
        steps = max(1, math.ceil(share / self.step_tokens)) if self.step_tokens else 1
        return steps * self.step_s + share * self.prefill_token_s
