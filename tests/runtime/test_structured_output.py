"""Structured output (llguidance) and logit_bias: the spec, the edge's validation, the
sampler's mask on whichever worker samples, and the grammar surviving preemption, a
re-prefill elsewhere and the prefill -> decode handoff."""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import re
from pathlib import Path

import jsonschema
import pytest

from bucketserve.runtime.core.grammar_compiler import GrammarCompiler, validate_structured_outputs
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import FinishReason, Sequence
from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams as Spec
from bucketserve.runtime.engine.llm import LLM
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

BLOCK = 4

# Every value bounded: whatever a random model's logits, the grammar ends in few tokens.
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "zip": {"type": "string", "pattern": "^[0-9]{3}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "tags", "address"],
    "additionalProperties": False,
}
COMPACT = Spec(json=PROFILE, disable_any_whitespace=True)
SMALL = {  # ends well within the 48 tokens of the handoff tests
    "type": "object",
    "properties": {
        "role": {"enum": ["admin", "user"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["role", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=128)
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def params(spec: Spec | None = COMPACT, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 96, "structured_outputs": spec,
                             **kwargs})  # fmt: skip


def generate(runner: ModelRunner, prompts_: list, params_: list, **engine) -> list:
    llm = LLM(runner=runner, **engine)
    return llm.generate(prompts_, params_, use_tqdm=False)


def valid_prefix(runner: ModelRunner, spec: Spec, token_ids: list[int]) -> bool:
    matcher = runner.structured.compiler.matcher(spec)
    return matcher.consume_tokens(token_ids) and not matcher.is_error()


# -- the spec and the edge ------------------------------------------------------------------


def test_spec_takes_exactly_one_constraint_and_travels_with_sampling_params():
    with pytest.raises(ValueError, match="exactly one of"):
        Spec()
    with pytest.raises(ValueError, match=r"exactly one of.*json, regex"):
        Spec(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        Spec(choice=[])
    with pytest.raises(ValueError, match=r"structured_outputs\.json: not valid JSON"):
        Spec(json="{nope")
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
    # a schema's text and its dict are one spec; property order is kept (it orders output)
    assert Spec(json='{"b": 1,  "a": 2}').key == Spec(json={"b": 1, "a": 2}).key
    assert Spec(json={"b": 1, "a": 2}).key != Spec(json={"a": 2, "b": 1}).key
    p = SamplingParams(n=2, seed=3, structured_outputs=Spec(regex="[0-9]+"), logit_bias={5: 1})
    copy = pickle.loads(pickle.dumps(p))
    assert copy == p and copy.sample(1).structured_outputs == p.structured_outputs
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs.kind == "choice"


def test_logit_bias_is_clamped_and_checked():
    p = SamplingParams(logit_bias={"7": 250, 9: -1e9, 11: 0.5})
    assert p.logit_bias == {7: 100.0, 9: -100.0, 11: 0.5}
    for bad, field in [({-1: 1.0}, "keys"), ({"x": 1.0}, "keys"), ({3: float("nan")}, "3")]:
        with pytest.raises(ValueError, match=f"logit_bias.*{field}|logit_bias\\[{field}"):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (Spec(json={"type": "foo"}), r"structured_outputs\.json: invalid JSON schema: .*foo"),
        (Spec(json={"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable"),
        (Spec(json={"type": "string", "format": "nope"}), "Unknown format"),
        (Spec(regex="(ab"), r"structured_outputs\.regex: invalid regex: .*unclosed group"),
        (Spec(grammar="start: missing"), r"structured_outputs\.grammar: .*unknown name"),
        (Spec(grammar='root ::= "a" | ('), r"structured_outputs\.grammar: invalid grammar"),
    ],
)
def test_the_edge_refuses_what_cannot_compile_naming_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        validate_structured_outputs(spec)
    with pytest.raises(ValueError, match=message):  # cached: the same answer
        validate_structured_outputs(spec)


def test_the_compiler_caches_by_spec():
    compiler = GrammarCompiler()
    for _ in range(3):
        compiler.validate(Spec(json=json.dumps(PROFILE, indent=2)))
        compiler.validate(Spec(json=PROFILE))
        compiler.validate(Spec(grammar='root ::= "x" [0-9]+'))  # GBNF, converted to Lark
        compiler.validate(Spec(json_object=True))
    assert compiler.num_compiled == 3
    validate_structured_outputs(None)


def test_the_engine_refuses_bad_constraints_before_admitting(tiny_runner):
    engine = LLMEngine.from_kwargs(runner=tiny_runner)
    with pytest.raises(ValueError, match="unknown name"):
        engine.add_request([5, 6, 7], params(Spec(grammar="start: nothing")))
    with pytest.raises(ValueError, match="unknown special token"):  # the model's tokens
        engine.add_request([5, 6, 7], params(Spec(grammar='start: "a" <|nope|>')))
    with pytest.raises(ValueError, match="logit_bias names token ids"):
        engine.add_request([5, 6, 7], params(None, logit_bias={49152: 1.0}))
    assert not engine.has_unfinished()


# -- masks in the sampler (tiny random model) -----------------------------------------------


def test_json_schema_output_validates_greedy_and_sampled(tiny_runner):
    n = 6
    spec_params = [params()] + [params(temperature=1.0, seed=s) for s in range(n - 1)]
    outs = generate(tiny_runner, prompts(n), spec_params)
    for out in outs:
        assert out.finish_reason == FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), PROFILE)
        assert out.token_ids[-1] in tiny_runner.eos_token_ids
    assert len({o.text for o in outs}) > 1  # the constraint left the model choices
    # free whitespace allowed: still valid JSON once it ends (the model may pad it)
    loose_params = [params(Spec(json=PROFILE), max_tokens=120)] * 2
    loose = generate(tiny_runner, prompts(2, seed=1), loose_params)
    for out in loose:
        if out.finish_reason == FinishReason.STOP:
            jsonschema.validate(json.loads(out.text), PROFILE)
        else:
            assert valid_prefix(tiny_runner, Spec(json=PROFILE), out.token_ids)


def test_masks_on_the_thread_or_after_the_forward_give_the_same_tokens(tiny_runner):
    sp = [params(temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    overlapped = generate(tiny_runner, prompts(4, seed=2), sp)
    tiny_runner.structured.overlap = False
    try:
        serial = generate(tiny_runner, prompts(4, seed=2), sp)
    finally:
        tiny_runner.structured.overlap = True
    assert [o.token_ids for o in serial] == [o.token_ids for o in overlapped]


def test_regex_choice_and_grammars_are_matched_exactly(tiny_runner):
    cases = [
        (Spec(regex=r"[a-z]{2,6}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", t)),
        (Spec(choice=["red", "green", "blue sky"]), lambda t: t in ("red", "green", "blue sky")),
        (Spec(grammar='start: ("ab" | "cd")+ "!"\n'), lambda t: re.fullmatch(r"(ab|cd)+!", t)),
        (Spec(grammar='root ::= "x" [0-9] [0-9]?'), lambda t: re.fullmatch(r"x[0-9]{1,2}", t)),
    ]
    work = [(p, params(spec, temperature=t, seed=1, max_tokens=64))
            for spec, _ in cases for p, t in zip(prompts(2, seed=3), (0, 1.0), strict=True)]
    outs = generate(tiny_runner, [p for p, _ in work], [sp for _, sp in work])
    for i, out in enumerate(outs):
        assert cases[i // 2][1](out.text), (cases[i // 2][0], out.text)
        assert out.finish_reason == FinishReason.STOP


def test_too_few_tokens_end_with_length_and_a_valid_prefix(tiny_runner):
    outs = generate(tiny_runner, prompts(3), [params(max_tokens=m) for m in (1, 4, 9)])
    for out, m in zip(outs, (1, 4, 9), strict=True):
        assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == m
        assert valid_prefix(tiny_runner, COMPACT, out.token_ids)
        assert out.text.startswith("{")


def test_a_constrained_row_leaves_its_batch_neighbours_alone(tiny_runner):
    ps = prompts(4, seed=5)
    free = [SamplingParams(temperature=0, max_tokens=10), SamplingParams(temperature=0.8, seed=4)]
    alone = generate(tiny_runner, ps[:2], free)
    mixed = generate(tiny_runner, ps, [*free, params(), params(Spec(choice=["yes", "no"]))])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].text), PROFILE)
    assert mixed[3].text in ("yes", "no")


def test_logit_bias_changes_the_greedy_choice(tiny_runner):
    prompt = prompts(1, seed=7)[0]
    plain = generate(tiny_runner, [prompt], [SamplingParams(temperature=0, max_tokens=3)])[0]
    first = plain.token_ids[0]
    pushed = generate(tiny_runner, [prompt], [SamplingParams(
        temperature=0, max_tokens=3, logit_bias={1234: 100})])[0]  # fmt: skip
    assert pushed.token_ids == [1234] * 3
    banned = generate(tiny_runner, [prompt], [SamplingParams(
        temperature=0, max_tokens=3, logit_bias={first: -100})])[0]  # fmt: skip
    assert banned.token_ids[0] != first
    # a bias cannot break a grammar: the mask still wins
    forced = generate(tiny_runner, [prompt], [params(Spec(choice=["yes", "no"]),
                                                     logit_bias={1234: 100})])[0]  # fmt: skip
    assert forced.text in ("yes", "no")


def test_min_tokens_against_a_finished_grammar_does_not_break(tiny_runner):
    """EOS is banned until min_tokens, but the grammar allows nothing else: the grammar wins
    and the request still ends with the choice."""
    out = generate(tiny_runner, prompts(1), [params(Spec(choice=["ok"]), min_tokens=4)])[0]
    assert out.text == "ok" and out.finish_reason == FinishReason.STOP


def test_preempted_and_recomputed_sequences_still_obey_their_grammar(tiny_model_dir, tiny_runner):
    small = ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=24)
    )
    ps = prompts(6, seed=11)
    sp = [params(temperature=0.7 * (i % 2), seed=i) for i in range(6)]
    engine = LLMEngine.from_kwargs(runner=small, max_num_seqs=4)
    ids = [engine.add_request(p, s) for p, s in zip(ps, sp, strict=True)]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            final[out.request_id] = out
    assert engine.stats.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 24
    reference = generate(tiny_runner, ps, sp, max_num_seqs=1)
    for rid, ref in zip(ids, reference, strict=True):
        assert final[rid].token_ids == ref.token_ids
        jsonschema.validate(json.loads(final[rid].text), PROFILE)


def test_a_request_resumed_on_another_worker_rebuilds_its_grammar(tiny_model_dir, tiny_runner):
    """A re-prefill after a worker death: a fresh runner gets the prompt and the tokens
    generated so far, and continues exactly as the uninterrupted run did."""
    prompt = prompts(1, seed=13)[0]
    sp = params(temperature=1.0, seed=5)
    whole = generate(tiny_runner, [prompt], [sp])[0].token_ids
    other = ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=64)
    )
    for cut in (1, len(whole) // 2, len(whole) - 1):
        engine = LLMEngine.from_kwargs(runner=other)
        rid = engine.add_request(prompt, sp, output_token_ids=whole[:cut])
        out = None
        while engine.has_unfinished():
            out = next((o for o in engine.step() if o.request_id == rid), out)
        assert out.token_ids == whole


def test_the_manager_rebuilds_a_matcher_whose_tokens_changed(tiny_runner):
    manager = tiny_runner.structured
    spec = Spec(choice=["yes", "no"])
    tok = tiny_runner.tokenizer
    seq = Sequence([5, 6], params(spec), seq_id="rebuild")
    start = manager.mask([seq]).disallowed[0]
    seq.append_token(tok.encode("no", add_special_tokens=False)[0])
    after_no = manager.mask([seq]).disallowed[0]
    assert not after_no.equal(start)
    again = Sequence([5, 6], params(spec), seq_id="rebuild")  # same id, tokens dropped
    assert manager.mask([again]).disallowed[0].equal(start)
    seq = Sequence([5, 6], params(spec), seq_id="rebuild")
    seq.append_token(tok.encode("no", add_special_tokens=False)[0])
    assert manager.mask([seq]).disallowed[0].equal(after_no)
    held = manager._grammars["rebuild"]
    other = Sequence([5, 6, 7], params(spec), seq_id="rebuild")  # another request's id
    other.append_token(seq.output_token_ids[0])
    manager.mask([other])
    assert manager._grammars["rebuild"] is not held
    # a spec the edge would refuse, sent to a worker anyway: that sequence may only end
    bad = Sequence([5, 6], params(Spec(grammar='start: "a" <|nope|>')), seq_id="bad")
    allowed = (~manager.mask([bad]).disallowed[0]).nonzero().flatten().tolist()
    assert set(allowed) <= tiny_runner.eos_token_ids and allowed


# -- prefill -> decode (local in-process workers) -------------------------------------------


def _disagg_work(ignore_eos: bool) -> list[tuple[list[int], SamplingParams]]:
    specs = [
        Spec(json=SMALL, disable_any_whitespace=True),
        Spec(regex=r"[a-z]{3,8}( [a-z]{2,5}){2}"),
        Spec(choice=["alpha", "beta"]),
    ]
    work = []
    for i, prompt in enumerate(prompts(6, seed=17)):
        work.append((prompt, params(specs[i % 3], temperature=0.9 * (i % 2), seed=i,
                                    ignore_eos=ignore_eos, max_tokens=48)))  # fmt: skip
    return work


def _reference(runner: ModelRunner, work: list) -> list[list[int]]:
    return [o.token_ids for o in generate(runner, [p for p, _ in work], [s for _, s in work])]


def _check_texts(runner: ModelRunner, work: list, outputs: list[list[int]]) -> None:
    """Each text matches its constraint, having ended (EOS) within max_tokens."""
    for (_, sp), ids in zip(work, outputs, strict=True):
        assert runner.tokenizer.eos_token_id in ids
        spec = sp.structured_outputs
        text = runner.tokenizer.decode(ids)
        if spec.kind == "json":
            jsonschema.validate(json.loads(text), SMALL)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.regex, text), text
        else:
            assert text in spec.choice


def test_disaggregated_requests_obey_their_grammar_across_the_handoff(tiny_model_dir, tiny_runner):
    """The prefill worker masks the first token, the decode worker rebuilds the matcher from
    the tokens it is handed and masks the rest: tokens equal the in-process engine's."""
    from bucketserve.controller.controller import Controller
    from tests.disagg.helpers import controller_config, serve_and_drain, small_batches

    work = _disagg_work(ignore_eos=False)
    reference = _reference(tiny_runner, work)

    async def main() -> list[list[int]]:
        config = controller_config(tiny_model_dir, mode="local", buckets=small_batches())
        controller = Controller(config)
        await controller.start()
        outputs, stats = await serve_and_drain(controller, work, "grammar")
        assert stats.transfers > 0
        return outputs

    outputs = asyncio.run(main())
    assert outputs == reference
    _check_texts(tiny_runner, work, outputs)


def test_a_decode_worker_killed_mid_request_is_re_prefilled_under_its_grammar(
    tiny_model_dir, tiny_runner
):
    """ignore_eos keeps every request decoding for 48 tokens (EOS repeats once its grammar
    is done), so the kill lands mid-generation; the re-prefilled requests rebuild their
    matchers from the tokens they had and end exactly as without the kill."""
    from bucketserve.controller.controller import Controller
    from tests.disagg.helpers import (
        assert_drained,
        controller_config,
        generate_killing,
        small_batches,
        tokens,
    )

    work = _disagg_work(ignore_eos=True)
    reference = _reference(tiny_runner, work)

    async def main() -> list[list[int]]:
        config = controller_config(tiny_model_dir, mode="local", buckets=small_batches())
        controller = Controller(config)
        await controller.start()
        try:
            outputs = tokens(await generate_killing(controller, work, "decode"))
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker_restarts >= 1 and stats.requests_requeued >= 1
        return outputs

    outputs = asyncio.run(main())
    assert outputs == reference
    _check_texts(tiny_runner, work, outputs)


# -- the real model -------------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "London", "Rome"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}, "name": {"type": "string"}},
            "required": ["kind", "name"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "city", "hobbies", "pet"],
    "additionalProperties": False,
}


CAPITAL = r"The capital of France is [A-Z][a-z]+\."


@pytest.mark.smollm
def test_smollm_json_regex_and_choice(smollm_dir):
    llm = LLM(str(smollm_dir), dtype="float32", device="cpu", num_kv_blocks=256)
    ask = "Describe a fictional person as JSON: name, age, city, hobbies and their pet."
    chats = [[{"role": "user", "content": ask}]] * 3 + [
        [{"role": "user", "content": "What is the capital of France? One word."}],
        [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
    ]
    sp = [
        SamplingParams(temperature=0, max_tokens=120, structured_outputs=Spec(json=PERSON)),
        *(
            SamplingParams(
                temperature=0.7, seed=s, max_tokens=120, structured_outputs=Spec(json=PERSON)
            )
            for s in (1, 2)
        ),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=Spec(regex=CAPITAL)),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=Spec(choice=["yes", "no"])),
    ]
    outs = llm.chat(chats, sp, use_tqdm=False)
    for out in outs[:3]:
        assert out.finish_reason == FinishReason.STOP, out.text
        print(len(out.token_ids), out.text)
        jsonschema.validate(json.loads(out.text), PERSON)
    print(outs[3].text)
    assert re.fullmatch(CAPITAL, outs[3].text) and outs[3].finish_reason == FinishReason.STOP
    assert outs[4].text in ("yes", "no")


def test_a_whitespace_pattern_is_the_only_whitespace_between_json_tokens(tiny_runner):
    spec = Spec(json=SMALL, whitespace_pattern=r"\n")
    work = [params(spec, temperature=1.0, seed=s, max_tokens=60) for s in range(4)]
    outs = generate(tiny_runner, prompts(4), work)
    for out in outs:  # SMALL's strings hold no whitespace: all of it lies between tokens
        assert out.finish_reason == FinishReason.STOP, out.text
        jsonschema.validate(json.loads(out.text), SMALL)
        assert {c for c in out.text if c.isspace()} <= {"\n"}, out.text
    assert any("\n" in out.text for out in outs)  # the pattern's whitespace, not none at all
