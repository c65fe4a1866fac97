"""Detokenizer: incremental text over split UTF-8 characters, and stop strings."""

from __future__ import annotations

import pytest

from bucketserve.runtime.io.detokenizer import Detokenizer
from bucketserve.runtime.io.tokenizer import Tokenizer

MULTIBYTE = "Café 日本語 🙂👍🏽 naïve — done"


@pytest.fixture(scope="module")
def tok(smollm_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm_tokenizer_dir)


def stream(tok: Tokenizer, text: str, stop=(), prompt="Say:") -> tuple[list[str], Detokenizer]:
    d = Detokenizer(tok, tok.encode(prompt), stop)
    deltas = []
    for token in tok.encode(text, add_special_tokens=False):
        if d.stopped:
            break
        deltas.append(d.push(token))
    deltas.append(d.flush())
    return deltas, d


def test_split_utf8_characters_are_emitted_whole(tok):
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text does split characters
    deltas, d = stream(tok, MULTIBYTE)
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == d.text == MULTIBYTE


def test_special_tokens_are_skipped(tok):
    d = Detokenizer(tok)
    deltas = [d.push(t) for t in tok.encode("Hi<|im_end|>", add_special_tokens=False)]
    assert "".join(deltas) + d.flush() == "Hi"


def test_stop_string_across_tokens_is_never_emitted(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text, add_special_tokens=False)
    assert not any("fox jumps" in tok.decode([i]) for i in ids)  # it spans tokens
    deltas, d = stream(tok, text, stop=["fox jumps"])
    assert d.stop_reason == "fox jumps"
    assert "".join(deltas) == d.text == "The quick brown "
    assert all("fox" not in delta for delta in deltas)


def test_possible_stop_prefix_is_held_then_released(tok):
    d = Detokenizer(tok, stop=[" brown cow"])
    deltas = [d.push(t) for t in tok.encode("a brown fox", add_special_tokens=False)]
    # " brown" could begin the stop string: held until " fox" rules it out
    assert deltas == ["a", "", " brown fox"]
    assert not d.stopped


def test_held_text_is_flushed_when_the_request_ends_otherwise(tok):
    deltas, d = stream(tok, "waiting for the bro", stop=["brown cow"])
    assert deltas[-1] == "bro" and d.text == "waiting for the bro" and not d.stopped


def test_earliest_of_several_stop_strings_wins(tok):
    deltas, d = stream(tok, "one, two; three", stop=["three", ";", "two"])
    assert d.stop_reason == "two"
    assert d.text == "one, " and "".join(deltas) == "one, "


def test_stop_string_inside_a_multibyte_run(tok):
    _, d = stream(tok, MULTIBYTE, stop=["🙂"])
    assert d.text == "Café 日本語 " and d.stop_reason == "🙂"
    with pytest.raises(ValueError, match="already hit a stop string"):
        d.push(5)


def test_empty_stop_string_is_rejected(tok):
    with pytest.raises(ValueError, match="non-empty"):
        Detokenizer(tok, stop=[""])
