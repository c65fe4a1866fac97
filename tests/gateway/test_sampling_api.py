"""The sampling features end to end through the real `openai` client and the SDK:
logprobs (checked against transformers' logits), n, penalties, min_p, min_tokens, echo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from bucketserve import Client
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.engine.llm import LLM
from tests.gateway.conftest import BLOCK_SIZE, http_post, wait_until_idle

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "What is a KV cache?"}]


@pytest.fixture(scope="module")
def engine_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), block_size=BLOCK_SIZE, num_kv_blocks=64)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir: Path) -> Any:
    """log_softmax of transformers' logits at each output position: an independent check."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logprobs(prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
        return torch.log_softmax(logits[len(prompt_ids) - 1 : -1].float(), dim=-1)

    return logprobs


def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


def greedy(llm: LLM, max_tokens: int = 10, **params: Any) -> Any:
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                        use_tqdm=False)[0]


def test_completion_logprobs_are_log_softmax_of_the_logits(
    open_server: Any, engine_llm: LLM, hf_logprobs: Any
) -> None:
    want = greedy(engine_llm)
    out = oai(open_server).completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3
    )
    choice = out.choices[0]
    assert choice.text == want.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert len(lp.text_offset) == 10
    tok = engine_llm.tokenizer
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    ref = hf_logprobs(want.prompt_token_ids, want.token_ids)
    for i, token in enumerate(want.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, token].item(), abs=1e-3)
        top = ref[i].topk(3)
        assert len(lp.top_logprobs[i]) <= 4  # distinct texts, the sampled one included
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]
        assert max(lp.top_logprobs[i].values()) == pytest.approx(top.values[0].item(), abs=1e-3)
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(top.values[0].item(), abs=1e-3)


def test_chat_logprobs_shape_and_values_streamed_and_whole(
    open_server: Any, engine_llm: LLM, hf_logprobs: Any
) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    want = engine_llm.chat(MESSAGES, params, use_tqdm=False)[0]
    client = oai(open_server)
    kwargs = dict(model=open_server.model_name, messages=MESSAGES, max_tokens=8, temperature=0,
                  logprobs=True, top_logprobs=4)
    # each computes its whole prompt: one over a cached prefix rounds its logits otherwise
    reset = f"{open_server.http_url}/reset_prefix_cache"
    assert http_post(reset, {})[0] == 200
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == want.text
    assert len(content) == 8
    ref = hf_logprobs(want.prompt_token_ids, want.token_ids)
    tok = engine_llm.tokenizer
    for i, (entry, token) in enumerate(zip(content, want.token_ids, strict=True)):
        assert entry.token == tok.decode([token], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(ref[i, token].item(), abs=1e-3)
        assert len(entry.top_logprobs) == 4
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(ref[i].topk(4).values.tolist(), abs=1e-3)
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    assert http_post(reset, {})[0] == 200
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # without logprobs: none in the response
    plain = client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_logprobs_zero_gives_the_sampled_tokens_only(open_server: Any) -> None:
    out = oai(open_server).completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=4, temperature=0.7, seed=3,
        logprobs=0,
    )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert [t == {text: v} for t, text, v in zip(
        lp.top_logprobs, lp.tokens, lp.token_logprobs, strict=True)] == [True] * 4


def test_n_choices(open_server: Any, engine_llm: LLM, loop_thread: Any, backend: Any) -> None:
    client = oai(open_server)
    want = greedy(engine_llm, 12)
    same = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=12, temperature=0, n=3
    )
    assert [c.index for c in same.choices] == [0, 1, 2]
    assert [c.text for c in same.choices] == [want.text] * 3
    assert same.usage.completion_tokens == 36
    sampled = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11,
        n=3,
    )
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) == 3, texts
    again = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11,
        n=3,
    )
    assert [c.text for c in again.choices] == texts  # seeded: choice i has seed + i
    chunks = list(client.chat.completions.create(
        model=open_server.model_name, messages=MESSAGES, max_tokens=6, temperature=0, n=2,
        stream=True, stream_options={"include_usage": True},
    ))
    by_index: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            by_index[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and by_index[0] == by_index[1] != ""
    assert chunks[-1].usage.completion_tokens == 12
    assert wait_until_idle(loop_thread, backend).kv_blocks_leaked == 0


def repeats(token_ids: list[int]) -> int:
    return len(token_ids) - len(set(token_ids))


def test_penalties_change_output_only_when_not_neutral(open_server: Any, engine_llm: LLM) -> None:
    client = oai(open_server)
    base = greedy(engine_llm, 40)
    assert repeats(base.token_ids) >= 2  # the tiny model repeats itself greedily
    neutral = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=40, temperature=0,
        presence_penalty=0.0, frequency_penalty=0.0,
        extra_body={"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0},
    )
    assert neutral.choices[0].text == base.text
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"extra_body": {"repetition_penalty": 2.0}}):
        out = client.completions.create(
            model=open_server.model_name, prompt=PROMPT, max_tokens=40, temperature=0,
            logprobs=0, **penalty,
        )
        assert out.choices[0].text != base.text, penalty
        ids = engine_llm.generate(
            [PROMPT],
            SamplingParams(temperature=0, max_tokens=40,
                           **penalty.get("extra_body", penalty)),  # type: ignore[arg-type]
            use_tqdm=False,
        )[0]
        assert ids.text == out.choices[0].text
        assert repeats(ids.token_ids) < repeats(base.token_ids), penalty


def test_min_p_one_keeps_only_the_top_token(open_server: Any, engine_llm: LLM) -> None:
    out = oai(open_server).completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=5,
        extra_body={"min_p": 1.0},
    )
    assert out.choices[0].text == greedy(engine_llm, 12).text


def test_min_tokens_holds_back_stop_tokens(open_server: Any, engine_llm: LLM) -> None:
    base = greedy(engine_llm, 12)
    stop_id = base.token_ids[1]
    first = base.token_ids.index(stop_id)
    client = oai(open_server)
    early = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )
    assert early.choices[0].finish_reason == "stop"
    assert early.usage.completion_tokens == first + 1
    held = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
        extra_body={"stop_token_ids": [stop_id], "min_tokens": 6},
    )
    assert held.usage.completion_tokens >= 6
    tok = engine_llm.tokenizer
    stop_text = tok.decode([stop_id], skip_special_tokens=False)
    assert stop_text not in held.choices[0].logprobs.tokens[:6]
    want = engine_llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=6),
        use_tqdm=False,
    )[0]
    assert stop_id not in want.token_ids[:6]
    assert held.choices[0].text == want.text


def test_echo_puts_the_prompt_first(open_server: Any, engine_llm: LLM) -> None:
    want = greedy(engine_llm, 6)
    client = oai(open_server)
    out = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert out.choices[0].text == PROMPT + want.text
    chunks = list(client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
        stream=True,
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + want.text


def test_sdk_sends_the_new_fields_over_grpc(open_server: Any, engine_llm: LLM,
                                            hf_logprobs: Any) -> None:
    with Client(open_server.grpc_target) as client:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
        done = client.generate(PROMPT, params)
        want = greedy(engine_llm, 8)
        assert done.token_ids == want.token_ids
        ref = hf_logprobs(want.prompt_token_ids, want.token_ids)
        assert done.logprobs is not None and len(done.logprobs) == 8
        for i, lp in enumerate(done.logprobs):
            assert lp.logprob == pytest.approx(ref[i, want.token_ids[i]].item(), abs=1e-3)
            assert [t for t, _ in lp.top] == ref[i].topk(2).indices.tolist()
        penalized = client.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=20, frequency_penalty=2.0)
        )
        local = greedy(engine_llm, 20, frequency_penalty=2.0)
        assert penalized.token_ids == local.token_ids
        assert penalized.logprobs is None
        held = client.generate(PROMPT, SamplingParams(
            temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[want.token_ids[1]],
            min_p=0.5, repetition_penalty=1.0, presence_penalty=0.0,
        ))
        assert len(held.token_ids) >= 4


def test_min_tokens_holds_back_stop_strings_too(open_server: Any, engine_llm: LLM) -> None:
    base = greedy(engine_llm, 16)
    tok = engine_llm.tokenizer
    second = tok.decode(base.token_ids[:2])
    stop = second[len(tok.decode(base.token_ids[:1])):].strip()[:3] or second.strip()[:3]
    assert stop and stop in base.text
    client = oai(open_server)
    early = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert early.choices[0].finish_reason == "stop"
    assert early.choices[0].text == base.text[: base.text.index(stop)]
    held = client.completions.create(
        model=open_server.model_name, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
        extra_body={"min_tokens": 16},
    )
    assert held.choices[0].finish_reason == "length"
    assert held.choices[0].text == base.text


def test_skip_special_tokens_false_keeps_them_in_the_text(open_server: Any,
                                                          engine_llm: LLM) -> None:
    tok = engine_llm.tokenizer
    special = tok.encode(tok.special_tokens["eos_token"], add_special_tokens=False)[0]
    forced = {"logit_bias": {str(special): 100}, "ignore_eos": True}
    client = oai(open_server)

    def text(**extra: Any) -> str:
        out = client.completions.create(model=open_server.model_name, prompt=PROMPT,
                                        max_tokens=3, temperature=0, extra_body={**forced, **extra})
        assert out.usage.completion_tokens == 3
        return out.choices[0].text

    assert text() == "" and text(skip_special_tokens=True) == ""
    assert text(skip_special_tokens=False) == tok.decode([special] * 3, skip_special_tokens=False)
    with Client(open_server.grpc_target) as sdk:
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                logit_bias={special: 100}, skip_special_tokens=False)
        assert sdk.generate(PROMPT, params).text == text(skip_special_tokens=False)
