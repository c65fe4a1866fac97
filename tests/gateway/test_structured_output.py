"""Structured output through the OpenAI HTTP surface and the gRPC SDK, on SmolLM2 served in
both shapes: JSON schemas, regex and choice constraints obeyed, bad specs refused with a 400
(INVALID_ARGUMENT) naming the problem, and logit_bias."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from bucketserve import Client, InvalidArgumentError, SamplingParams, StructuredOutputsParams
from bucketserve.bucket_manager.config import TenantConfig
from tests.gateway.conftest import http_post, start_server, wait_until_idle

pytestmark = [pytest.mark.smollm, pytest.mark.slow]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "role", "tags", "address"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = [{"role": "user", "content": "Describe a person who lives in Paris as JSON."}]
MAX_TOKENS = 64


def serve(loop_thread: Any, model_dir: Path, topology: str, **gateway: Any) -> Iterator[Any]:
    from bucketserve.controller.config import ControllerConfig
    from bucketserve.controller.controller import Controller
    from bucketserve.deploy.serve_config import with_tenants
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    template, parser = gateway.pop("chat_template", None), gateway.pop("tool_call_parser", None)
    runner = ModelRunnerConfig(
        model=str(model_dir), num_kv_blocks=128, chat_template=template, tool_call_parser=parser
    )
    config = ControllerConfig(runner=runner, mode="local", topology=topology)
    config = with_tenants(config, [TenantConfig(name="default")])
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start(), timeout=300)
    server = start_server(loop_thread, controller, **gateway)
    yield server, controller
    loop_thread.run(server.stop(0))
    loop_thread.run(controller.shutdown())


@pytest.fixture(scope="module")
def colocated(loop_thread: Any, smollm_dir: Path) -> Iterator[Any]:
    yield from serve(loop_thread, smollm_dir, "colocated")


@pytest.fixture(scope="module")
def disaggregated(loop_thread: Any, smollm_dir: Path) -> Iterator[Any]:
    yield from serve(loop_thread, smollm_dir, "disaggregated")


def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_json_schema_outputs_validate_greedy_and_sampled(
    topology: str, request: pytest.FixtureRequest, loop_thread: Any
) -> None:
    """10 requests a topology (20 in all): greedy through response_format, sampled through
    vLLM's structured_outputs extra (without free whitespace, which a small model spends
    its tokens on)."""
    server, controller = request.getfixturevalue(topology)
    client = oai(server)

    def ask(i: int) -> Any:
        if i < 5:
            return client.chat.completions.create(
                model=server.model_name,
                messages=ASK,  # type: ignore[arg-type]
                response_format=PERSON_FORMAT,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
        return client.chat.completions.create(
            model=server.model_name,
            messages=ASK,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0.8,
            seed=i,
            extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
        )

    with ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(ask, range(10)))
    texts = [r.choices[0].message.content for r in responses]
    for r, text in zip(responses, texts, strict=True):
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts[:5])) == 1  # greedy: one answer
    stats = wait_until_idle(loop_thread, controller, timeout=60)
    assert stats.kv_blocks_leaked == 0 and stats.leases_open == 0


def test_regex_and_choice_are_obeyed_exactly(colocated: Any) -> None:
    server, _ = colocated
    client = oai(server)
    regex = client.completions.create(
        model=server.model_name,
        prompt="The date today is",
        max_tokens=16,
        temperature=0.7,
        seed=3,
        extra_body={"structured_outputs": {"regex": r" 20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}},
    )
    text = regex.choices[0].text
    assert regex.choices[0].finish_reason == "stop"
    assert len(text) == 11 and text.startswith(" 20") and text[5] == text[8] == "-", text
    for choices in (["red", "green", "blue"], ["yes", "no"]):
        out = client.chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "Pick one colour."}],
            max_tokens=8,
            extra_body={"guided_choice": choices},
        )
        assert out.choices[0].message.content in choices


BAD = [
    # (extra body, words the 400 must hold)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
      "schema": {"type": "foo"}}}}, ["response_format.json_schema.schema", "invalid JSON schema"]),
    ({"structured_outputs": {"regex": "(unclosed"}}, ["structured_outputs.regex", "regex"]),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
     ["guided_json", "invalid JSON schema"]),
    ({"structured_outputs": {"grammar": "start: foo"}}, ["structured_outputs.grammar"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, ["exactly one of"]),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}},
     ["at most one output constraint"]),
    ({"logit_bias": {"10000000": 5}}, ["logit_bias", "vocabulary"]),
    ({"guided_whitespace_pattern": "\n"}, ["guided_whitespace_pattern", "JSON constraint"]),
]


@pytest.mark.parametrize(("extra", "words"), BAD)
def test_invalid_specs_are_a_400_naming_the_problem(
    colocated: Any, extra: dict[str, Any], words: list[str]
) -> None:
    server, _ = colocated
    body = {"messages": ASK, "max_tokens": 4, **extra}
    status, out, _ = http_post(f"{server.http_url}/v1/chat/completions", body)
    assert status == 400, out
    message = out["error"]["message"]
    assert all(w in message for w in words), message


def test_json_object_and_logit_bias(disaggregated: Any) -> None:
    server, _ = disaggregated
    client = oai(server)
    out = client.chat.completions.create(
        model=server.model_name,
        messages=ASK,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: a valid prefix of an object
        assert (out.choices[0].message.content or "").lstrip().startswith("{")
    with Client(server.grpc_target) as sdk:
        token = sdk.generate("Hello", SamplingParams(max_tokens=1, temperature=0)).token_ids[0]
        other = (token + 7) % 1000 + 100
        biased = sdk.generate(
            "Hello", SamplingParams(max_tokens=3, temperature=0, logit_bias={other: 100})
        )
    assert biased.token_ids == [other] * 3


def test_grpc_sdk_json_schema_validates_and_bad_schema_is_invalid_argument(
    disaggregated: Any,
) -> None:
    server, _ = disaggregated
    spec = StructuredOutputsParams(json=PERSON)
    with Client(server.grpc_target) as sdk:
        out = sdk.chat(ASK, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                           structured_outputs=spec))
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
        choice = sdk.generate(
            "Colour:",
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
                choice=["red", "blue"])),
        )
        assert choice.text in ("red", "blue")
        with pytest.raises(InvalidArgumentError, match=r"structured_outputs\.json_schema"):
            sdk.generate("x", SamplingParams(
                max_tokens=4, structured_outputs=StructuredOutputsParams(json={"type": "foo"})))


def test_a_whitespace_pattern_shapes_the_json_over_http_and_grpc(colocated: Any) -> None:
    server, _ = colocated
    schema = {"type": "object", "properties": {"role": {"enum": ["admin", "user"]},
              "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
              "required": ["role", "zip"], "additionalProperties": False}  # fmt: skip
    out = oai(server).chat.completions.create(
        model=server.model_name, messages=ASK, max_tokens=MAX_TOKENS, temperature=0,  # type: ignore[arg-type]
        extra_body={"guided_json": schema, "guided_whitespace_pattern": "\n"},
    )
    text = out.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), schema)
    assert {c for c in text if c.isspace()} <= {"\n"}, text  # no string holds whitespace
    spec = StructuredOutputsParams(json=schema, whitespace_pattern="\n")
    with Client(server.grpc_target) as sdk:
        done = sdk.chat(ASK, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                            structured_outputs=spec))
    assert done.text == text
