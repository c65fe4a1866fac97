"""What computing prompt tokens costs in time on the workers that compute them: the TTFT a
request can expect behind the queue ahead of it (torch-free)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


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


def absorbs(tokens: float, prefill_token_s: float | None, tpot_slack_s: float | None) -> bool:
    """Whether a worker whose running requests' TPOT targets can still absorb `tpot_slack_s`
    seconds (the least of them; None: no target to keep) can compute a `tokens`-token
    prompt at `prefill_token_s` a token (None: not measured, nothing to go by)."""
    if tpot_slack_s is None or prefill_token_s is None:
        return True
    return tokens * prefill_token_s <= tpot_slack_s


def some_worker_absorbs(
    own: int, ahead: float, workers: Sequence[tuple[int, float | None, float | None] | None]
) -> bool:
    """Whether some decode worker can compute, within its running requests' TPOT slack,
    every prompt token before a request's first token: the `own` prompt tokens, its share
    of the `ahead` ones the bucket manager serves first, and those already sent to it.
    `workers`: each one's (tokens sent, prompt token price, least TPOT slack) as last
    reported; None: not reported yet (nothing to go by)."""
    share = ahead / max(1, len(workers))
    return any(w is None or absorbs(own + share + w[0], w[1], w[2]) for w in workers)


@dataclass
class ForecastBias:
    """How far TTFT forecasts fell short of the first tokens that followed: the residuals
    (actual - forecast) of the last `window` admitted requests; a forecast is corrected by
    their `quantile`. What the cost model leaves out (prompts held back to keep running
    requests' TPOT, sampling, the gateway) shows up here; an attainment target asks for
    the tail, so the correction is a high quantile rather than the mean."""

    window: int = 32
    quantile: float = 0.9
    residuals: deque[float] = field(default_factory=deque)

    def observe(self, forecast_s: float, actual_s: float) -> None:
        self.residuals.append(actual_s - forecast_s)
        if len(self.residuals) > self.window:
            self.residuals.popleft()

    def correct(self, forecast_s: float) -> float:
        """`forecast_s` plus the quantile of the residuals (never less: a forecast the
        requests beat stands)."""
        if not self.residuals:
            return forecast_s
        ranked = sorted(self.residuals)
        late = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
        return forecast_s + max(0.0, late)
