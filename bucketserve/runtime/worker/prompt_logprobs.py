"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-softmax of the raw logits at each
prompt position, for the requests that ask; the other requests' steps are unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bucketserve.runtime.core.logprobs import TokenLogprob
from bucketserve.runtime.core.sequence import Sequence


@dataclass
class PromptSpan:
    """Row `row` of a step computes positions `start..start+count-1` whose next tokens are
    prompt tokens: their logits give those tokens' logprobs."""

    row: int
    start: int
    count: int


def prompt_spans(seqs: list[Sequence], num_new_tokens: list[int]) -> list[PromptSpan]:
    spans = []
    for row, (seq, n) in enumerate(zip(seqs, num_new_tokens, strict=False)):  # checked later
        if seq.sampling_params.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        count = min(start + n, seq.num_prompt_tokens - 1) - start
        if count > 0:
            spans.append(PromptSpan(row, start, count))
    return spans


def span_rows(spans: list[PromptSpan], row_start: np.ndarray) -> np.ndarray:
    """The flat token rows of the spans, in order (a span's tokens start its row's chunk)."""
    return np.concatenate([row_start[s.row] + np.arange(s.count) for s in spans])


def record_prompt_logprobs(
    seqs: list[Sequence], spans: list[PromptSpan], logits: torch.Tensor
) -> None:
    """Write each span's logprobs into `seq.prompt_logprobs` (position of the token -> its
    TokenLogprob with the request's top k), from `logits [sum(count), vocab]`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    at = 0
    for span in spans:
        seq = seqs[span.row]
        positions = range(span.start + 1, span.start + span.count + 1)
        rows = logp[at : at + span.count]
        at += span.count
        next_ids = torch.tensor(seq.token_ids[positions.start : positions.stop])
        values = rows.gather(1, next_ids.to(rows.device).unsqueeze(1)).squeeze(1).tolist()
        k = seq.sampling_params.prompt_logprobs or 0
        if k:
            top_v, top_i = rows.topk(k, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(top_i.tolist(), top_v.tolist(),
                                                                   strict=True)]
        else:
            tops = [[] for _ in values]
        for pos, value, top in zip(positions, values, tops, strict=True):
            seq.prompt_logprobs[pos] = TokenLogprob(value, top)
