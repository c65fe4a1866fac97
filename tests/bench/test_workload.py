"""Workload generators: length statistics, exact prompt lengths, seeds, ShareGPT's cut file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bucketserve.bench.length_distribution import LengthDistribution
from bucketserve.bench.sharegpt_reader import ShareGPTReader
from bucketserve.bench.tenant_mix import TenantMix, TenantShare
from bucketserve.bench.text_corpus import TextCorpus
from bucketserve.bench.workload import WorkloadConfig, WorkloadGenerator
from bucketserve.runtime.io.tokenizer import Tokenizer

OUTPUT = LengthDistribution(mean=32.0, sigma=0.5, low=4, high=64)


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm_tokenizer_dir)


def generate(tokenizer: Tokenizer, tenants: TenantMix | None = None, **kw) -> list:
    config = WorkloadConfig(**{"num_requests": 300, "max_model_len": 1024, "output": OUTPUT,
                               **kw})
    return WorkloadGenerator(config, tokenizer, tenants).generate().requests


def test_short_is_alpaca_like_and_prompts_have_their_token_length(tokenizer) -> None:
    requests = generate(tokenizer, name="short")
    lengths = np.array([r.prompt_len for r in requests])
    assert 75 <= lengths.mean() <= 91  # Alpaca's mean ~83 tokens
    assert lengths.min() >= 8 and lengths.max() <= 512
    exact = [len(tokenizer.encode(r.prompt)) for r in requests]
    assert exact == [r.prompt_len for r in requests]  # the count the server makes
    assert 60 <= np.median(lengths) <= 80  # log-normal, sigma 0.6: median = 0.84 x mean
    assert all(r.prompt.strip() and " " in r.prompt for r in requests)  # real text
    outputs = [r.max_tokens for r in requests]
    assert min(outputs) >= 4 and max(outputs) <= 64 and 26 <= np.mean(outputs) <= 38


def test_long_is_truncated_to_the_model_length_and_mixed_is_long_tailed(tokenizer) -> None:
    long = [r.prompt_len for r in generate(tokenizer, name="long", num_requests=40)]
    cap = 1024 - OUTPUT.high
    assert max(long) <= cap and np.median(long) >= cap - 2
    mixed = generate(tokenizer, name="mixed", long_fraction=0.2)
    kinds = [r.kind for r in mixed]
    assert 0.13 <= kinds.count("long") / len(kinds) <= 0.27
    lengths = np.array([r.prompt_len for r in mixed])
    assert np.percentile(lengths, 99) > 5 * np.median(lengths)  # the long tail
    assert all(r.prompt_len + r.max_tokens <= 1024 for r in mixed)


def test_same_seed_same_workload_other_seed_other(tokenizer) -> None:
    a = generate(tokenizer, name="mixed", num_requests=50, seed=3)
    b = generate(tokenizer, name="mixed", num_requests=50, seed=3)
    c = generate(tokenizer, name="mixed", num_requests=50, seed=4)
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_tenants_follow_shares_and_kind_bindings(tokenizer) -> None:
    mix = TenantMix([TenantShare.parse("chat:k1=3"), TenantShare.parse("bulk:k2=1"),
                     TenantShare.parse("batch:k3@long")])
    requests = generate(tokenizer, name="mixed", tenants=mix)
    assert all((r.tenant == "batch") == (r.kind == "long") for r in requests)
    short = [r.tenant for r in requests if r.kind == "short"]
    assert 0.65 <= short.count("chat") / len(short) <= 0.85
    assert mix.keys() == {"chat": "k1", "bulk": "k2", "batch": "k3"}
    with pytest.raises(ValueError, match=r"NAME\[:KEY\]"):
        TenantShare.parse("chat=zero")
    with pytest.raises(ValueError, match="no tenant takes 'short'"):
        TenantMix([TenantShare("batch", kind="long")]).pick("short", np.random.default_rng(0))


def conversation(i: int, reply_words: int = 20) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is a river delta?"},
        {"from": "gpt", "value": " ".join(["delta"] * reply_words)},
    ]}


def test_sharegpt_truncated_file_yields_the_complete_records(tmp_path: Path, tokenizer) -> None:
    whole = json.dumps([conversation(i) for i in range(6)], indent=2)
    cut = whole[: whole.index('"c5"') + 30]  # the file ends inside record 5
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    reader = ShareGPTReader(path)
    assert [r["id"] for r in reader.records()] == [f"c{i}" for i in range(5)]
    assert reader.stats.complete_records == 5
    assert reader.stats.truncated_tail_bytes > 0
    path.write_text(whole)
    reader = ShareGPTReader(path)
    assert len(list(reader.records())) == 6 and reader.stats.truncated_tail_bytes == 0

    path.write_text(cut)
    workload = WorkloadGenerator(
        WorkloadConfig(name="sharegpt", num_requests=4, max_model_len=1024, output=OUTPUT,
                       sharegpt_path=str(path)),
        tokenizer,
    ).generate()
    assert workload.info["sharegpt_complete_records"] == 5
    assert workload.info["sharegpt_used"] == 4
    for r in workload.requests:
        assert r.prompt.startswith("Question number")
        assert r.prompt_len == len(tokenizer.encode(r.prompt))
        assert r.max_tokens == 20  # the reply's tokens ("delta" x 20)
    too_many = WorkloadConfig(name="sharegpt", num_requests=9, max_model_len=1024,
                              output=OUTPUT, sharegpt_path=str(path))
    with pytest.raises(ValueError, match="only 5 usable"):
        WorkloadGenerator(too_many, tokenizer).generate()


def test_bad_workload_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="workload must be one of"):
        WorkloadConfig(name="huge")
    with pytest.raises(ValueError, match="lower the output maximum"):
        WorkloadConfig(max_model_len=64, output=OUTPUT)


def test_corpus_cuts_real_text_to_the_exact_token_count(tokenizer) -> None:
    corpus = TextCorpus(tokenizer)
    rng = np.random.default_rng(1)
    for n in [1, 2, 5, 17, 83, 200, 640, 1500]:
        text, got = corpus.prompt(n, rng)
        assert got == n == len(tokenizer.encode(text)), n


def test_prefix_flood_chat_shares_a_system_prompt_and_documents_share_nothing(
    tokenizer,
) -> None:
    requests = generate(
        tokenizer, name="prefix-flood", long_fraction=0.5, system_prompt_len=256,
        max_model_len=2048, num_requests=40,
    )  # fmt: skip
    chat = [tokenizer.encode(r.prompt) for r in requests if r.kind == "chat"]
    docs = [tokenizer.encode(r.prompt) for r in requests if r.kind == "doc"]
    assert len(chat) > 5 and len(docs) > 5
    assert all(ids[:250] == chat[0][:250] for ids in chat)  # the shared system prompt
    assert len({tuple(ids[:16]) for ids in docs}) == len(docs)  # unique from the first block
    assert [r.prompt_len for r in requests] == [len(tokenizer.encode(r.prompt)) for r in requests]
    assert all(r.prompt_len + r.max_tokens <= 2048 for r in requests)
    with pytest.raises(ValueError, match=r"system prompt, a question .* do not fit"):
        WorkloadConfig(name="prefix-flood", system_prompt_len=1000, max_model_len=1024,
                       output=OUTPUT)  # fmt: skip
