"""The log-probabilities that ride along with sampled tokens (torch-free, picklable).

A token's logprob is taken from the distribution it was sampled from, vLLM's (V0)
"processed" convention: the model's logits after the penalties, the min_tokens
suppression of EOS / stop token ids and the temperature (none for greedy), and before
the top-k / top-p / min_p cuts, so every token has a finite value. With every sampling
parameter neutral and greedy decoding that is log_softmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One token's logprob and the `k` most likely tokens of its distribution, most
    likely first, as (token id, logprob) pairs (`k` is the request's `logprobs`)."""

    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class SampledToken(int):
    """A sampled token id that carries its TokenLogprob (None when the request asked for
    none); anywhere else it is the plain int."""

    logprob: TokenLogprob | None

    def __new__(cls, token_id: int, logprob: TokenLogprob | None = None) -> SampledToken:
        token = super().__new__(cls, token_id)
        token.logprob = logprob
        return token

    def __reduce__(self):  # pickles as itself, logprob included
        return (SampledToken, (int(self), self.logprob))


def logprob_of(token: object) -> TokenLogprob | None:
    return getattr(token, "logprob", None)
