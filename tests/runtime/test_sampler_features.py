"""The sampler's penalties, min_p, min_tokens and logprobs, against hand-computed values."""

from __future__ import annotations

import pickle

import pytest
import torch

from bucketserve.runtime.core.logprobs import SampledToken, TokenLogprob, logprob_of
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.worker.sampler import Sampler

VOCAB = 8
EOS = 7


def logits_row(*values: float) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[: len(values)] = torch.tensor(values)
    return row


def seq(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    return Sequence(prompt, params, output_token_ids=output)


def test_neutral_params_pick_the_argmax_and_carry_no_logprobs() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0)] * 4
    out = Sampler(eos_token_ids=[EOS])(logits, params, [0, 1, 2, 3])
    assert out == logits.argmax(dim=-1).tolist()
    assert all(type(t) is int for t in out)


def test_penalties_follow_vllm() -> None:
    """repetition over prompt + output; frequency per output occurrence; presence once."""
    base = logits_row(2.0, -1.0, 1.5, 0.5, 3.0, 0.0, 0.0, -5.0)
    params = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
        logprobs=VOCAB,
    )
    s = seq([0, 1], [4, 4, 2], params)
    out = Sampler()(base.unsqueeze(0), [params], [3], [s])
    want = base.clone()
    want[0] /= 2.0  # in the prompt, positive
    want[1] *= 2.0  # in the prompt, negative
    want[4] = 3.0 / 2.0 - 0.5 * 2 - 0.25  # output twice
    want[2] = 1.5 / 2.0 - 0.5 * 1 - 0.25  # output once
    assert out[0] == int(want.argmax())
    lp = logprob_of(out[0])
    assert lp is not None
    expected = torch.log_softmax(want, dim=-1)
    got = dict(lp.top)
    for token in range(VOCAB):
        assert got[token] == pytest.approx(expected[token].item(), abs=1e-6)


def test_penalties_need_the_sequences() -> None:
    params = SamplingParams(temperature=0, presence_penalty=1.0)
    with pytest.raises(ValueError, match="penalties need the sequences"):
        Sampler()(logits_row(1.0).unsqueeze(0), [params], [0])


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    row = logits_row(0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 1.0, 10.0)  # EOS, then stop id 3
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3], logprobs=1)
    sampler = Sampler(eos_token_ids=[EOS])
    early = sampler(row.unsqueeze(0), [params], [1])
    assert early == [6]
    assert logprob_of(early[0]).top[0][0] == 6  # type: ignore[union-attr]
    assert sampler(row.unsqueeze(0), [params], [2]) == [EOS]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(row.unsqueeze(0), [ignoring], [0]) == [EOS]  # ignore_eos: EOS is a token


def test_min_p_one_is_greedy_and_zero_changes_nothing() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    strict = [SamplingParams(temperature=2.0, seed=i, min_p=1.0) for i in range(3)]
    assert Sampler()(logits, strict, [0, 0, 0]) == logits.argmax(dim=-1).tolist()
    loose = [SamplingParams(temperature=2.0, seed=i) for i in range(3)]
    zero = [SamplingParams(temperature=2.0, seed=i, min_p=0.0) for i in range(3)]
    assert Sampler()(logits, loose, [5, 5, 5]) == Sampler()(logits, zero, [5, 5, 5])


def test_logprobs_are_of_the_tempered_distribution() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.5, seed=3, logprobs=3),
              SamplingParams(temperature=0, logprobs=2)]
    out = Sampler()(logits, params, [0, 0])
    tempered = torch.log_softmax(logits[0] / 0.5, dim=-1)
    raw = torch.log_softmax(logits[1], dim=-1)
    for token, ref, k in ((out[0], tempered, 3), (out[1], raw, 2)):
        lp = logprob_of(token)
        assert lp is not None and len(lp.top) == k
        assert lp.logprob == pytest.approx(ref[int(token)].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == ref.topk(k).indices.tolist()
    assert out[1] == int(logits[1].argmax())


def test_sampled_tokens_pickle_with_their_logprobs() -> None:
    token = SampledToken(5, TokenLogprob(-0.5, [(5, -0.5), (2, -1.5)]))
    back = pickle.loads(pickle.dumps(token))
    assert back == 5 and back.logprob == token.logprob
    s = Sequence([1, 2], SamplingParams(logprobs=1))
    s.append_token(token)
    assert type(s.token_ids[-1]) is int and s.output_logprobs == {0: token.logprob}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be an integer in [0, max_tokens"),
        ({"logprobs": 21}, "logprobs must be None or an integer in [0, 20]"),
        ({"logprobs": True}, "logprobs must be None or an integer"),
        ({"n": 0}, "n must be an integer in [1, 16]"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kwargs)


def test_sample_i_of_n_gets_its_own_seed() -> None:
    params = SamplingParams(n=3, seed=10, temperature=1.0)
    assert [(p.n, p.seed) for p in (params.sample(i) for i in range(3))] == [
        (1, 10), (1, 11), (1, 12)
    ]
    assert SamplingParams(n=2).sample(1).seed is None
