"""Next-token choice from logits rows: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """Generator seed for output token `index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed) ^ index) >> 1


class Sampler:
    """Picks one token per logits row.

    Sampling is an exponential race: token = argmax(p / E) with E ~ Exp(1)
    drawn per vocabulary entry, which draws exactly from p and moves only
    when a tiny logit change reorders a near-tie. A seeded row's noise comes
    from a CPU generator seeded by (seed, output index) alone, so its tokens
    do not depend on the batch, the device, preemption or a prefill/decode
    handoff. Unseeded rows draw from this sampler's own generator.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
    ) -> list[int]:
        """`logits [N, vocab]`; `output_indices[i]` numbers the token row i samples."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(output_indices):
            raise ValueError("need one SamplingParams and one output index per logits row")
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            chosen = [params[i] for i in rows]
            noise = self._noise(chosen, [output_indices[i] for i in rows], logits.shape[1])
            index = torch.tensor(rows, device=logits.device)
            picked = self._sample(logits.index_select(0, index).float(), chosen, noise)
            tokens = tokens.index_copy(0, index, picked)
        return tokens.tolist()

    def _noise(self, params: list[SamplingParams], indices: list[int], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(params), vocab)
        for row, (p, index) in enumerate(zip(params, indices, strict=True)):
            gen = self.generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed(token_seed(p.seed, index))
            noise[row].exponential_(generator=gen)
        return noise.clamp_min_(1e-30)  # an exact 0 would make 0/0 for excluded tokens

    def _sample(
        self, logits: torch.Tensor, params: list[SamplingParams], noise: torch.Tensor
    ) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._filter(logits, params)
        probs = torch.softmax(logits, dim=-1)
        return (probs / noise.to(device)).argmax(dim=-1)

    @staticmethod
    def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """-inf outside each row's top-k, then outside its top-p nucleus (ties kept)."""
        vocab = logits.shape[1]
        sorted_logits, _ = logits.sort(dim=-1, descending=True)
        ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        k_index = torch.tensor([min(k, vocab) - 1 for k in ks], device=logits.device)
        cutoff = sorted_logits.gather(1, k_index.unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < cutoff, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = mass_before < top_p
        keep[:, 0] = True
        # The smallest kept logit of each row; everything below it goes.
        threshold = sorted_logits.masked_fill(~keep, float("inf")).min(dim=-1, keepdim=True).values
        return logits.masked_fill(logits < threshold, float("-inf"))
