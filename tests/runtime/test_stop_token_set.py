"""Stop token ids are looked up in a frozenset on every generated token, made once per
sequence (and again only if its params are replaced)."""

from __future__ import annotations

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import FinishReason, Sequence, finish_reason


def test_a_sequence_looks_its_stop_ids_up_in_a_set() -> None:
    seq = Sequence([1, 2, 3], SamplingParams(stop_token_ids=[9, 4, 9], max_tokens=10))
    assert seq.stop_token_set == frozenset({4, 9})
    assert seq.stop_token_set is seq.stop_token_set  # made once
    seq.sampling_params = SamplingParams(stop_token_ids=[7])
    assert seq.stop_token_set == frozenset({7})
    assert Sequence([1]).stop_token_set == frozenset()


def test_a_stop_token_ends_the_sequence() -> None:
    seq = Sequence([1, 2, 3], SamplingParams(stop_token_ids=[9, 4], max_tokens=10))
    seq.append_token(5)
    assert finish_reason(seq, 5, eos_token_ids=[2], max_seq_len=100) is None
    seq.append_token(9)
    assert finish_reason(seq, 9, eos_token_ids=[2], max_seq_len=100) == FinishReason.STOP
    assert seq.stop_reason == 9
