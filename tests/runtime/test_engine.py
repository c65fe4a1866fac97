"""LLMEngine / LLM on the tiny random Llama: continuous batching, budgets, preemption,
pipeline depth, streaming, abort, the prefilled handoff and bad input."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

from bucketserve.runtime.core.outputs import RequestOutput
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import FinishReason, Sequence
from bucketserve.runtime.engine.llm import LLM
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir) -> ModelRunner:
    """Shared by every engine here: each engine brings its own BlockManager."""
    return ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=96)
    )


@pytest.fixture(scope="module")
def small_pool_runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=14)
    )


def token_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def varied_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 4)) for i in range(n)]


def reference(runner: ModelRunner, prompts, params) -> list[list[int]]:
    """Each prompt alone: no batching, no budget pressure."""
    llm = LLM(runner=runner, max_num_seqs=1)
    pairs = zip(prompts, params, strict=True)
    return [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in pairs]


def drain(engine: LLMEngine, check=None) -> dict[str, list[RequestOutput]]:
    """Step until idle; every request's outputs in order. `check(engine)` runs each step."""
    streams: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
        if check:
            check(engine)
    return streams


def test_continuous_batching_equals_one_at_a_time(tiny_runner):
    prompts, params = token_prompts(7), varied_params(7)  # max_tokens 4, 7, 10, 13, 4, ...
    engine = LLMEngine.from_kwargs(runner=tiny_runner, max_num_seqs=3)
    sizes = []
    got = drain_all(engine, prompts, params, lambda e: sizes.append(len(e.scheduler.running)))
    assert got == reference(tiny_runner, prompts, params)
    assert [len(tokens) for tokens in got] == [sp.max_tokens for sp in params]
    assert max(sizes) == 3 and engine.block_manager.num_free_blocks == 96
    assert engine.stats.num_generated_tokens == sum(sp.max_tokens for sp in params)
    assert engine.stats.num_finished == 7


def test_requests_join_as_soon_as_a_slot_frees(tiny_runner):
    prompts, params = token_prompts(4), varied_params(4)
    engine = LLMEngine.from_kwargs(runner=tiny_runner, max_num_seqs=3)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finals = {rid: outs[-1] for rid, outs in drain(engine).items()}
    first, second, third, fourth = (finals[rid].metrics for rid in ids)
    # the 4th waits for the 1st (4 tokens) to leave, then decodes beside the 2nd and 3rd
    assert first.finished_time <= fourth.first_scheduled_time < second.finished_time
    assert fourth.first_scheduled_time < third.finished_time


def test_priority_policy_runs_lower_priority_values_first_with_the_same_tokens(tiny_runner):
    prompts, params = token_prompts(4, seed=3), varied_params(4)
    llm = LLM(runner=tiny_runner, max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1, 0])
    assert [o.token_ids for o in outs] == reference(tiny_runner, prompts, params)
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]  # priority 0 in arrival order, then 1, then 2
    with pytest.raises(ValueError, match="4 prompts but 3 priorities"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, 1, 2])
    with pytest.raises(ValueError, match=r"an integer \(or a tuple of integers\), got 'high'"):
        llm.engine.add_request(prompts[0], GREEDY, priority="high")
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("spare_s", [600.0, None])
def test_a_request_past_its_ttft_deadline_yields_with_the_same_tokens(tiny_runner, spare_s):
    """The late request goes first when the on-time one behind it can spare the time
    (600 s); it yields when its prefill would cost that one its deadline (priced at 1 s a
    prompt token, the deadline lies halfway through the late prompt's prefill)."""
    prompts, params = token_prompts(3, seed=4), varied_params(3)
    engine = LLMEngine.from_kwargs(runner=tiny_runner, max_num_seqs=1)
    times = engine.scheduler.step_times
    times.decode_s, times.prefill_token_s = 0.1, 1.0
    now = time.monotonic()
    n0, n1 = len(prompts[0]), len(prompts[1])
    on_time = spare_s or 0.1 + (n1 - 1) + n0 / 2
    ids = [
        engine.add_request(prompts[0], params[0], ttft_deadline=now - 1.0),  # already late
        engine.add_request(prompts[1], params[1], ttft_deadline=now + on_time),
        engine.add_request(prompts[2], params[2]),  # no target: never late
    ]
    streams = drain(engine)
    assert [streams[i][-1].token_ids for i in ids] == reference(tiny_runner, prompts, params)
    started = [streams[i][-1].metrics.first_scheduled_time for i in ids]
    order = sorted(range(3), key=lambda i: started[i])
    assert order == ([0, 1, 2] if spare_s else [1, 0, 2])
    with pytest.raises(ValueError, match=r"ttft_deadline must be a time\.monotonic"):
        engine.add_request(prompts[0], GREEDY, ttft_deadline="soon")
    assert not engine.has_unfinished()


def test_tpot_targets_change_no_token_and_bad_ones_are_rejected(tiny_runner):
    prompts, params = token_prompts(6, seed=5), varied_params(6)
    engine = LLMEngine.from_kwargs(runner=tiny_runner, max_num_seqs=6)
    ids = [
        engine.add_request(p, s, tpot_target=0.002)
        for p, s in zip(prompts, params, strict=True)
    ]
    streams = drain(engine)
    assert [streams[i][-1].token_ids for i in ids] == reference(tiny_runner, prompts, params)
    for bad in (0, -1.0, "fast", True):
        with pytest.raises(ValueError, match="tpot_target must be a positive number"):
            engine.add_request(prompts[0], GREEDY, tpot_target=bad)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_token_budget_with_chunked_prefill_gives_the_same_tokens(tiny_runner):
    prompts, params = token_prompts(5, seed=1), varied_params(5)
    engine = LLMEngine.from_kwargs(runner=tiny_runner, max_num_batched_tokens=7)
    per_step = [0]

    def check(e: LLMEngine) -> None:
        per_step.append(e.stats.num_batched_tokens)

    got = drain_all(engine, prompts, params, check)
    assert got == reference(tiny_runner, prompts, params)
    sizes = [b - a for a, b in itertools.pairwise(per_step)]
    assert max(sizes) == 7 and sum(sizes) == sum(
        len(p) + sp.max_tokens - 1 for p, sp in zip(prompts, params, strict=True)
    )


def test_long_prompts_in_threshold_chunks_one_at_a_time_give_the_same_tokens(tiny_runner):
    prompts, params = token_prompts(5, seed=3), varied_params(5)
    assert max(len(p) for p in prompts) > 4
    engine = LLMEngine.from_kwargs(runner=tiny_runner, long_prefill_token_threshold=4)
    assert drain_all(engine, prompts, params) == reference(tiny_runner, prompts, params)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def drain_all(engine: LLMEngine, prompts, params, check=None) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    streams = drain(engine, check)
    return [streams[rid][-1].token_ids for rid in ids]


def test_preemption_and_resume_give_identical_greedy_output(small_pool_runner, tiny_runner):
    prompts = token_prompts(6, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=16)] * 6
    engine = LLMEngine.from_kwargs(runner=small_pool_runner, max_num_seqs=4)
    got = drain_all(engine, prompts, params)
    assert engine.stats.num_preemptions > 0
    assert got == reference(tiny_runner, prompts, params)
    assert engine.block_manager.num_free_blocks == 14


@pytest.mark.parametrize("depth", [2, 3])
def test_pipeline_depth_gives_the_same_tokens(tiny_runner, depth):
    prompts, params = token_prompts(6, seed=3), varied_params(6)
    engine = LLMEngine.from_kwargs(runner=tiny_runner, pipeline_depth=depth, max_num_seqs=4)
    depths = []

    def check(e: LLMEngine) -> None:
        batches = [{s.seq_id for s in b.seqs} for b in e.executor.in_flight]
        assert sum(map(len, batches)) == len(set().union(*batches))  # disjoint microbatches
        depths.append(len(batches))

    got = drain_all(engine, prompts, params, check)
    engine.close()
    assert got == reference(tiny_runner, prompts, params)
    assert max(depths) == depth - 1  # microbatches really stayed in flight across steps
    assert engine.block_manager.num_free_blocks == 96


def test_streamed_deltas_add_up_to_one_final_output(tiny_runner):
    engine = LLMEngine.from_kwargs(runner=tiny_runner, max_num_seqs=2)
    ids = [engine.add_request(p, GREEDY) for p in ["Hello there", "Once upon", "Why?"]]
    streams = drain(engine)
    for rid in ids:
        outs = streams[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final = outs[-1]
        assert [t for o in outs for t in o.delta_token_ids] == final.token_ids
        assert "".join(o.delta_text for o in outs) == final.text
        assert all(len(o.delta_token_ids) == 1 for o in outs)
        assert final.finish_reason == FinishReason.LENGTH and len(final.token_ids) == 12
        m = final.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft == m.first_token_time - m.arrival_time
    assert streams[ids[0]][-1].prompt == "Hello there"


def test_abort_frees_blocks_at_once_and_reports_cancelled(tiny_runner):
    engine = LLMEngine.from_kwargs(runner=tiny_runner)
    a = engine.add_request([5, 6, 7, 8, 9, 10], GREEDY)
    b = engine.add_request([11, 12, 13], GREEDY)
    engine.step()
    engine.step()  # a: 8 tokens in 2 blocks, b: 5 tokens, its 5th not given a slot yet
    assert engine.block_manager.num_free_blocks == 96 - 2 - 1
    assert engine.abort(a) is True
    assert engine.block_manager.num_free_blocks == 96 - 1
    assert engine.abort(a) is False
    outs = engine.step()
    cancelled = [o for o in outs if o.request_id == a]
    assert len(cancelled) == 1 and cancelled[0].finish_reason == FinishReason.CANCELLED
    assert cancelled[0].finished and len(cancelled[0].token_ids) == 2
    streams = drain(engine)
    assert a not in streams and streams[b][-1].finished
    assert engine.block_manager.num_free_blocks == 96


def test_abort_during_a_pipelined_flight_frees_blocks_when_it_lands(tiny_runner):
    engine = LLMEngine.from_kwargs(runner=tiny_runner, pipeline_depth=2, max_num_seqs=2)
    a = engine.add_request([5, 6, 7, 8, 9], GREEDY)
    b = engine.add_request([11, 12, 13], GREEDY)
    engine.step()  # a's microbatch (one sequence: half the running limit) is in flight
    assert [s.seq_id for s in engine.executor.in_flight[0].seqs] == [a]
    assert engine.abort(a)
    assert engine.block_manager.num_free_blocks == 96 - 2  # a's blocks wait for the landing
    streams = drain(engine)
    engine.close()
    assert [o.finish_reason for o in streams[a]] == [FinishReason.CANCELLED]
    assert streams[b][-1].finish_reason == FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == 96


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on CUDA the bad id trips a device-side assert, which poisons the process's CUDA "
    "context: the worker is restarted instead (the controller's fault recovery)",
)
def test_a_failing_microbatch_ends_its_requests_with_an_error(tiny_runner):
    engine = LLMEngine.from_kwargs(runner=tiny_runner)
    bad = engine.add_request([5, 6, 7], GREEDY)
    engine.scheduler.get(bad).token_ids[1] = 10**6  # corrupted after validation
    good = engine.add_request([8, 9], GREEDY)
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {
        bad: FinishReason.ERROR,
        good: FinishReason.ERROR,
    }
    assert engine.block_manager.num_free_blocks == 96 and not engine.has_unfinished()
    retry = engine.add_request([8, 9], GREEDY)
    assert drain(engine)[retry][-1].finish_reason == FinishReason.LENGTH


def test_prefilled_request_continues_where_the_prefill_left_off(tiny_runner):
    prompt = token_prompts(1, seed=4)[0]
    expected = reference(tiny_runner, [prompt], [GREEDY])[0]
    engine = LLMEngine.from_kwargs(runner=tiny_runner)
    blocks = engine.block_manager.reserve(-(-len(prompt) // BLOCK))
    staged = Sequence(prompt, GREEDY)  # what a prefill worker computes into those blocks
    staged.block_table = list(blocks)
    first = tiny_runner.execute([staged], [len(prompt)])[0]
    rid = engine.add_prefilled_request(prompt, first, blocks, GREEDY)
    streams = drain(engine)
    assert streams[rid][0].delta_token_ids == [first]
    assert streams[rid][-1].token_ids == expected
    assert engine.block_manager.num_free_blocks == 96


def test_bad_requests_are_rejected_without_a_trace(tiny_runner):
    engine = LLMEngine.from_kwargs(runner=tiny_runner)
    engine.add_request([5, 6], GREEDY, request_id="taken")
    cases = [
        (([1, 49152],), r"token ids \[49152\] are not integers in \[0, 49152\)"),
        (([],), "at least one token"),
        (([1] * 384,), r"within 384 \(max_model_len 512, KV pool of 96 blocks"),
        ((3.5,), "must be a str or a list"),
        (([1, 2], "greedy"), "must be a SamplingParams"),
        (([1, 2], GREEDY, "taken"), "already in use"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(*args)
    with pytest.raises(ValueError, match="not integers"):
        engine.add_requests([[5], [7, -1]], [GREEDY, GREEDY])
    assert engine.num_unfinished == 1 and len(engine.scheduler.waiting) == 1
    streams = drain(engine)
    assert list(streams) == ["taken"]
    assert engine.block_manager.num_free_blocks == 96


def test_llm_generate_and_chat_keep_input_order(tiny_runner):
    llm = LLM(runner=tiny_runner, max_num_seqs=2)
    prompts = token_prompts(4, seed=5)
    params = varied_params(4)[::-1]  # the first prompts finish last
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [sp.max_tokens for sp in params]
    assert outs[0].token_ids == llm.generate(prompts[0], params[0], use_tqdm=False)[0].token_ids
    chat = llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)
    assert chat[0].prompt.endswith("<|im_start|>assistant\n")
    assert chat[0].prompt_token_ids == llm.tokenizer.encode(chat[0].prompt, False)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 4 prompts"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    bad = r"token ids \[-1, 49152\] are not integers in \[0, 49152\)"
    with pytest.raises(ValueError, match=bad):
        llm.generate([prompts[0], [5, -1, 49152]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(runner=tiny_runner, max_num_seq=2)
    with pytest.raises(ValueError, match="not both"):
        LLM(runner=tiny_runner, num_kv_blocks=8)
    assert not llm.engine.has_unfinished()


def test_batched_sampling_features_match_one_at_a_time_and_keep_logprobs(
    small_pool_runner, tiny_runner
):
    """Penalties, min_p, min_tokens and logprobs in a batch under preemption equal each
    request alone; each output token has its logprobs, deltas adding up to the whole."""
    prompts = token_prompts(6, seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=12, frequency_penalty=1.0, logprobs=2),
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, presence_penalty=0.5, min_p=0.1),
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, logprobs=0),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12, min_tokens=12, logprobs=1),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=12, presence_penalty=-1.0, logprobs=3),
    ]
    engine = LLMEngine.from_kwargs(runner=small_pool_runner, max_num_seqs=4)
    ids = engine.add_requests(prompts, params)
    streams = drain(engine)
    assert engine.stats.num_preemptions > 0
    got = [streams[i][-1].token_ids for i in ids]
    assert got == reference(tiny_runner, prompts, params)
    for request_id, p in zip(ids, params, strict=True):
        final = streams[request_id][-1]
        if p.logprobs is None:
            assert final.logprobs is None
            continue
        assert len(final.logprobs) == len(final.token_ids)
        assert all(lp is not None and len(lp.top) == p.logprobs for lp in final.logprobs)
        pieces = [lp for out in streams[request_id] for lp in out.delta_logprobs]
        assert pieces == final.logprobs
