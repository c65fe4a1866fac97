"""Sampler: greedy, top-k / top-p support, distributions, and per-(seed, index) noise."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.worker.sampler import Sampler, token_seed

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draw(sampler, logits, params, n, index=0) -> Counter:
    return Counter(sampler(logits, [params], [index])[0] for _ in range(n))


def test_greedy_and_top_k_1_are_argmax():
    logits = random_logits(4)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0, seed=3),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5),
    ]
    assert Sampler(0)(logits, params, [0, 5, 9, 2]) == logits.argmax(-1).tolist()


def test_greedy_breaks_a_tie_at_the_first_maximum():
    logits = torch.zeros(3, VOCAB)
    logits[0, [4, 9, 40]] = 2.0  # three-way tie
    logits[1, [VOCAB - 1, 0]] = 1.0  # tie at both ends
    logits[2] = 0.5  # every token tied
    greedy = [SamplingParams(temperature=0)] * 3
    assert Sampler(0)(logits, greedy, [0, 0, 0]) == [4, 0, 0]


def test_seeded_rows_ignore_batch_companions_and_position():
    logits = random_logits(1, seed=1)
    mine = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(0)(logits, [mine], [i])[0] for i in range(20)]
    others = random_logits(3, seed=2)
    batch = torch.cat([others[:2], logits, others[2:]])
    crowd_params = [SamplingParams(), SamplingParams(seed=7), mine, SamplingParams(top_k=3)]
    together = [Sampler(i)(batch, crowd_params, [3, 1, i, 8])[2] for i in range(20)]
    assert together == alone
    assert len(set(alone)) > 3  # the output index does change the draw


def test_unseeded_rows_follow_the_runner_seed():
    logits = random_logits(1, seed=3)
    params = SamplingParams(temperature=1.0)

    def run(seed: int) -> list[int]:
        s = Sampler(seed)
        return [s(logits, [params], [0])[0] for _ in range(30)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_top_k_keeps_exactly_the_k_best():
    logits = random_logits(1, seed=4)
    top5 = set(logits[0].topk(5).indices.tolist())
    counts = draw(Sampler(0), logits, SamplingParams(temperature=5.0, top_k=5), 3000)
    assert set(counts) == top5  # every one of them appears, nothing else does


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, :5] = probs.log()
    sampler = Sampler(0)
    assert set(draw(sampler, logits, SamplingParams(temperature=1.0, top_p=0.75), 2000)) == {0, 1}
    assert set(draw(sampler, logits, SamplingParams(temperature=1.0, top_p=0.85), 2000)) == {
        0,
        1,
        2,
    }
    assert set(draw(sampler, logits, SamplingParams(temperature=1.0, top_p=0.1), 200)) == {0}


def test_samples_follow_the_tempered_distribution():
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, :3] = torch.tensor([0.6, 0.3, 0.1]).log()
    n = 6000
    counts = draw(Sampler(0), logits, SamplingParams(temperature=1.0), n)
    for token, p in enumerate([0.6, 0.3, 0.1]):
        assert abs(counts[token] / n - p) < 0.025
    hot = draw(Sampler(1), logits, SamplingParams(temperature=2.0), n)
    expected = torch.tensor([0.6, 0.3, 0.1]).sqrt()
    expected = (expected / expected.sum()).tolist()
    for token, p in enumerate(expected):
        assert abs(hot[token] / n - p) < 0.025


def test_token_seed_depends_on_seed_and_index_only():
    assert token_seed(1, 0) == token_seed(1, 0)
    assert len({token_seed(s, i) for s in range(20) for i in range(20)}) == 400
    assert all(0 <= token_seed(2**40, i) < 2**63 for i in range(5))


def test_bad_batches_raise():
    with pytest.raises(ValueError, match="one SamplingParams and one output index per logits row"):
        Sampler(0)(random_logits(2), [SamplingParams()], [0, 1])
