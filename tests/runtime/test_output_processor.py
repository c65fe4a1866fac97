"""OutputProcessor: the one place token ids become text, stop strings end requests and
finish reasons are settled."""

from __future__ import annotations

import pytest

from bucketserve.runtime.core.output_processor import OutputProcessor
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.io.tokenizer import Tokenizer

TEXT = "The weather today is sunny, and the drums occur at noon."


@pytest.fixture(scope="module")
def tok(smollm_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm_tokenizer_dir)


def test_text_follows_the_tokens_and_is_flushed_at_the_finish(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    outputs = OutputProcessor(tok)
    outputs.add("r", tok.encode("Say:"), SamplingParams())
    deltas = [outputs.process("r", [t]) for t in ids[:-1]]
    last = outputs.process("r", ids[-1:], "length")
    assert not any(finish is not None for _, _, finish, _ in deltas) and last[2] is not None
    assert (last[2], last[3]) == ("length", None)
    assert "".join(text for _, text, _, _ in [*deltas, last]) == TEXT
    assert [t for kept, _, _, _ in [*deltas, last] for t in kept] == ids
    assert "r" not in outputs  # dropped with its final delta


def test_a_stop_string_ends_the_request_and_drops_the_tokens_after_it(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    outputs = OutputProcessor(tok)
    outputs.add("r", [], SamplingParams(stop=["drums", "never appears"]))
    kept, text, finish, stop = outputs.process("r", ids)  # the stop and tokens past it
    assert finish is not None and stop is not None
    assert (finish, stop) == ("stop", "drums")
    assert text == TEXT[: TEXT.index("drums")]
    end = next(i for i in range(len(ids)) if "drums" in tok.decode(ids[: i + 1]))
    assert kept == ids[: end + 1]  # up to the token completing the stop string
    assert "r" not in outputs


def test_a_cancelled_request_releases_no_held_text(tok):
    outputs = OutputProcessor(tok)
    outputs.add("r", [], SamplingParams(stop=["sunny day"]))
    ids = tok.encode("It is sunny", add_special_tokens=False)
    _, held, _, _ = outputs.process("r", ids)
    assert held == "It is "  # "sunny" could begin the stop string: held back
    _, text, finish, _ = outputs.process("r", [], "cancelled")
    assert finish is not None and text == "" and finish == "cancelled"


def test_without_a_tokenizer_only_token_ids_pass_and_stop_strings_are_refused():
    outputs = OutputProcessor(None)
    outputs.add("r", [1, 2], SamplingParams())
    kept, text, finish, _ = outputs.process("r", [5, 6], "stop")
    assert (kept, text, finish is not None) == ([5, 6], "", True)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        outputs.add("s", [1], SamplingParams(stop=["x"]))


def test_no_stop_string_ends_a_request_before_min_tokens(tok):
    """vLLM's rule: stop strings count from the min_tokens-th output token on."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    after = next(i for i in range(len(ids)) if "weather" in tok.decode(ids[: i + 1])) + 1
    outputs = OutputProcessor(tok)
    outputs.add("r", [], SamplingParams(stop=["weather", "drums"], min_tokens=after + 1,
                                        max_tokens=64))
    _, text, _, stop = outputs.process("r", ids)
    assert stop is not None and stop == "drums"  # "weather" came too early
    assert text == TEXT[: TEXT.index("drums")]
    outputs.add("s", [], SamplingParams(stop=["weather"], min_tokens=after, max_tokens=64))
    assert outputs.process("s", ids)[1] == TEXT[: TEXT.index("weather")]
