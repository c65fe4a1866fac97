"""Next-token choice from logits rows: logit bias, penalties, min_tokens, the grammar mask,
then greedy, or temperature / top-k / top-p / min_p sampling; logprobs of the sampled
distribution (bucketserve.runtime.core.logprobs)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from bucketserve.runtime.core.logprobs import SampledToken, TokenLogprob
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence as Seq
from bucketserve.runtime.worker.structured_output import GrammarMask

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

    def __init__(self, seed: int = 0, eos_token_ids: Collection[int] = ()) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = sorted(eos_token_ids)  # suppressed until min_tokens

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        seqs: Sequence[Seq] | None = None,
        mask: GrammarMask | None = None,
    ) -> list[int]:
        """`logits [N, vocab]`; `output_indices[i]` numbers the token row i samples;
        `seqs[i]` (its tokens so far) is needed for penalties; `mask` forbids the tokens
        the constrained rows' grammars do not allow. A row whose params ask for logprobs
        gets a SampledToken carrying them."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(output_indices):
            raise ValueError("need one SamplingParams and one output index per logits row")
        logits = self._process(logits, params, output_indices, seqs, mask)
        tokens = logits.max(dim=-1).indices  # argmax's ties (the first), and cheaper
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            chosen = [params[i] for i in rows]
            noise = self._noise(chosen, [output_indices[i] for i in rows], logits.shape[1])
            index = torch.tensor(rows, device=logits.device)
            picked = self._sample(logits.index_select(0, index).float(), chosen, noise)
            tokens = tokens.index_copy(0, index, picked)
        out = tokens.tolist()
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            for i, lp in zip(wanted, self._logprobs(logits, params, wanted, out), strict=True):
                out[i] = SampledToken(out[i], lp)
        return out

    def _process(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        seqs: Sequence[Seq] | None,
        mask: GrammarMask | None = None,
    ) -> torch.Tensor:
        """The logits after the logit bias, penalties, the min_tokens suppression and the
        grammar mask (float32 then); the same tensor when no row has any."""
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        early = [i for i, p in enumerate(params) if output_indices[i] < p.min_tokens]
        if not biased and not penalized and not early and mask is None:
            return logits
        logits = logits.to(torch.float32, copy=True)
        if biased:
            _add_bias(logits, params, biased)
        if penalized:
            if seqs is None or len(seqs) != len(params):
                raise ValueError("penalties need the sequences of the rows")
            _penalize(
                logits, [params[i] for i in penalized], [seqs[i] for i in penalized], penalized
            )
        for i in early:
            p = params[i]
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            banned = [t for t in banned if 0 <= t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")
        if mask is not None:
            _apply_mask(logits, mask, rescue=bool(early))
        return logits

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        rows: list[int],
        tokens: list[int],
    ) -> list[TokenLogprob]:
        """log_softmax of the processed logits over the temperature (greedy: none)."""
        index = torch.tensor(rows, device=logits.device)
        chosen = logits.index_select(0, index).float()
        temps = [params[i].temperature if not params[i].greedy else 1.0 for i in rows]
        if any(t != 1.0 for t in temps):
            chosen = chosen / torch.tensor(temps, device=logits.device).unsqueeze(1)
        logp = torch.log_softmax(chosen, dim=-1)
        picked = torch.tensor([tokens[i] for i in rows], device=logits.device)
        sampled = logp.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
        k = max(params[i].logprobs or 0 for i in rows)
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        out = []
        for r, i in enumerate(rows):
            n = params[i].logprobs or 0
            out.append(TokenLogprob(sampled[r], list(zip(top_i[r][:n], top_v[r][:n], strict=True))))
        return out

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
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            floor = probs.max(dim=-1, keepdim=True).values * min_p
            probs = probs.masked_fill(probs < floor, 0.0)
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


def _add_bias(logits: torch.Tensor, params: Sequence[SamplingParams], rows: list[int]) -> None:
    """Each row's logit_bias added in place (ids past the logits were refused at the edge)."""
    vocab = logits.shape[1]
    index, values = [], []
    for i in rows:
        for token, bias in params[i].logit_bias.items():
            if token < vocab:
                index.append(i * vocab + token)
                values.append(bias)
    if index:
        flat = logits.view(-1)
        flat.index_add_(
            0,
            torch.tensor(index, device=logits.device),
            torch.tensor(values, dtype=logits.dtype, device=logits.device),
        )


def _apply_mask(logits: torch.Tensor, mask: GrammarMask, rescue: bool) -> None:
    """-inf where the grammar forbids, in place. With `rescue`, a row left with no token at
    all (min_tokens banned EOS while the grammar allows only EOS) keeps what its grammar
    allows: the grammar wins."""
    disallowed = mask.disallowed[:, : logits.shape[1]].to(logits.device, non_blocking=True)
    whole = len(mask.rows) == logits.shape[0]
    index = None if whole else torch.tensor(mask.rows, device=logits.device)
    rows = logits if whole else logits.index_select(0, index)
    rows.masked_fill_(disallowed, float("-inf"))
    if rescue:
        dead = torch.isneginf(rows.max(dim=-1).values)
        if dead.any():
            rows[dead] = torch.zeros_like(rows[dead]).masked_fill_(disallowed[dead], float("-inf"))
    if not whole:
        logits.index_copy_(0, index, rows)


def _penalize(
    logits: torch.Tensor, params: list[SamplingParams], seqs: Sequence[Seq], rows: list[int]
) -> None:
    """vLLM's penalties, in place on `logits[rows]`: repetition over prompt + output (a
    positive logit divided by it, a negative one multiplied), frequency (per occurrence)
    and presence (once) over the output tokens."""
    vocab, device = logits.shape[1], logits.device
    n = len(rows)
    outputs = [seq.output_token_ids for seq in seqs]
    prompts = [seq.prompt_token_ids for seq in seqs]
    counts = torch.zeros(n * vocab, device=device)
    seen = torch.zeros(n * vocab, dtype=torch.bool, device=device)
    counts.index_add_(
        0, _flat_index(outputs, vocab, device), torch.ones(sum(map(len, outputs)), device=device)
    )
    seen[_flat_index(prompts, vocab, device)] = True
    counts, seen = counts.view(n, vocab), seen.view(n, vocab)
    seen |= counts > 0
    index = torch.tensor(rows, device=device)
    x = logits.index_select(0, index)
    rep = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    x = x - freq * counts - pres * (counts > 0).float()
    logits.index_copy_(0, index, x)


def _flat_index(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Row r's ids at r * vocab + id, all rows in one flat index."""
    lengths = torch.tensor([len(row) for row in ids])
    flat = torch.tensor([t for row in ids for t in row], dtype=torch.long)
    offsets = torch.repeat_interleave(torch.arange(len(ids)) * vocab, lengths)
    return (offsets + flat).to(device)
