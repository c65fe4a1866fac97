"""What computing prompt tokens costs in time on the workers that compute them: the TTFT a
request can expect behind the queue ahead of it (torch-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bucketserve.utils.moving_average import moving_average


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


def absorbs(tokens: int, prefill_token_s: float | None, tpot_slack_s: float | None) -> bool:
    """Whether a worker whose running requests' TPOT targets can still absorb `tpot_slack_s`
    seconds (the least of them; None: no target to keep) can compute a `tokens`-token
    prompt at `prefill_token_s` a token (None: not measured, nothing to go by)."""
    if tpot_slack_s is None or prefill_token_s is None:
        return True
    return tokens * prefill_token_s <= tpot_slack_s


@dataclass
class ForecastBias:
    """How far TTFT forecasts fall from the first tokens that followed: moving averages of
    both, whose ratio scales the next forecast. What the cost model leaves out (prompts held
    back to keep running requests' TPOT, sampling, the gateway) shows up here, so a busy
    engine's forecasts lengthen with it rather than admitting requests that then miss."""

    forecast_s: float | None = None
    actual_s: float | None = None

    def observe(self, forecast_s: float, actual_s: float) -> None:
        self.forecast_s = moving_average(self.forecast_s, forecast_s)
        self.actual_s = moving_average(self.actual_s, actual_s)

    @property
    def factor(self) -> float:
        if not self.forecast_s or self.actual_s is None:
            return 1.0
        return self.actual_s / self.forecast_s
