"""Unified steps: a colocated engine's step (prompt chunks and decode rows, with prefix-cached
blocks several rows hold) padded to one (query, shared blocks, unique blocks, is_causal)
bucket and run as one compiled graph per bucket: the same greedy tokens as the unpadded
eager step, nothing compiled after warm-up, one compile per miss."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch._dynamo.utils import counters

from bucketserve.bucket_manager.config import ShapeBucketConfig
from bucketserve.bucket_manager.shape_buckets import ShapeBuckets
from bucketserve.bucket_manager.unified_buckets import unified_need
from bucketserve.runtime.attention.unified import NOT_HELD
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.engine.engine_config import EngineConfig
from bucketserve.runtime.engine.llm_engine import LLMEngine
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.step_inputs import InputBuilder
from tests.runtime.test_engine_prefix_cache import shared_prompts

pytestmark = pytest.mark.slow  # compiles graphs

BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# small step limits, so prompts are chunked beside decode rows
LIMITS = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
SHAPES = ShapeBucketConfig(
    strategy="unified",
    block_size=BLOCK,
    max_model_len=64,
    max_num_seqs=LIMITS.max_num_seqs,
    max_num_batched_tokens=LIMITS.max_num_batched_tokens,
    num_blocks=NUM_BLOCKS,
)
# the buckets the shared prompts' steps pad to (asserted below): fresh prompts; chunks
# after cached blocks, beside decode rows; decode rows with and without shared blocks
WARMED = [
    (4, 0, 24, 0),
    (4, 4, 24, 0),
    (16, 0, 0, 1),
    (16, 4, 0, 1),
    (16, 16, 4, 1),
    (16, 16, 24, 1),
]


def new_runner(model_dir, execution: str) -> ModelRunner:
    config = ModelRunnerConfig(
        model=str(model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, execution=execution
    )
    return ModelRunner(config)


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def generate(runner: ModelRunner, prompts, pad_fn=None) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(scheduler=LIMITS), runner, pad_fn=pad_fn)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i].token_ids for i in ids]


class UnifiedPadding:
    """A decode worker's pad function: each step's need, padded to its unified bucket."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.shapes = ShapeBuckets(SHAPES, log=False)
        self.needs: list[tuple[int, int, int, int]] = []

    def __call__(self, seqs: list[Sequence], counts: list[int]) -> tuple[int, int, int, int]:
        tables = [s.block_table for s in seqs]
        need = unified_need(tables, [s.num_computed_tokens for s in seqs], counts, BLOCK)
        assert need == self.runner.inputs.unified_need(seqs, counts)  # one definition
        self.needs.append(need)
        return self.shapes.pad_unified(need).shape


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[list[int]]:
    return generate(new_runner(tiny_model_dir, "eager"), shared_prompts())


@pytest.fixture(scope="module")
def graphs_runner(tiny_model_dir) -> ModelRunner:
    runner = new_runner(tiny_model_dir, "graphs")
    torch._dynamo.reset()  # so every region here compiles (dynamo caches per code object)
    before = compiled_graphs()
    seconds = runner.warmup(WARMED)
    assert sorted(runner.graphs.shapes) == WARMED and set(seconds) == set(WARMED)
    assert runner.graphs.unified and all(s > 0 for s in seconds.values())
    if not runner.device.captures_whole_step:
        # per bucket its decoder layer; the head and the final norm per query length
        lengths = len({b[0] for b in WARMED})
        assert compiled_graphs() - before == len(WARMED) + 2 * lengths
    return runner


def test_the_runner_and_the_bucket_manager_count_a_steps_blocks_alike():
    """Random steps whose rows hold some of the same leading blocks (a cached prefix):
    the runner's need (numpy) is the pad function's (pure Python), and its layout holds
    every shared block for each token whose row has it, and every unique one for one."""
    rng = random.Random(0)
    builder = InputBuilder(BLOCK, NUM_BLOCKS, NUM_BLOCKS, 256, torch.device("cpu"))
    for _ in range(200):
        prefix = rng.sample(range(NUM_BLOCKS), 3)
        free = [b for b in range(NUM_BLOCKS) if b not in prefix]
        rng.shuffle(free)
        seqs, counts = [], []
        for _ in range(rng.randint(1, 5)):
            seq = Sequence([7] * rng.randint(1, 40), SamplingParams())
            seq.num_computed_tokens = rng.randrange(len(seq))
            counts.append(rng.choice([1, len(seq) - seq.num_computed_tokens]))
            held = rng.randint(0, 3)
            needed = -(-(seq.num_computed_tokens + counts[-1]) // BLOCK)
            seq.block_table = (prefix[:held] + [free.pop() for _ in range(needed)])[:needed]
            seqs.append(seq)
        tables = [s.block_table for s in seqs]
        computed = [s.num_computed_tokens for s in seqs]
        need = unified_need(tables, computed, counts, BLOCK)
        assert builder.unified_need(seqs, counts) == need
        step = builder.build_unified(seqs, counts, need)
        token_rows, starts, owners = step.flat[3], step.flat[6], step.flat[8]
        reads = sum(n * -(-c // BLOCK) for n, c in zip(counts, computed, strict=True))
        assert int((starts < NOT_HELD).sum()) == reads - need[2]  # (token, block) pairs
        assert all(counts[token_rows[t]] == 1 for t in owners.tolist())  # a decode row's


def test_eager_unified_steps_match_unpadded_steps(tiny_model_dir, reference):
    """The unified layout run eagerly (no compiler): mixed steps, cached prefixes shared by
    several rows, partial blocks: the unpadded engine's tokens."""
    runner = new_runner(tiny_model_dir, "eager")
    pad = UnifiedPadding(runner)
    assert generate(runner, shared_prompts(), pad) == reference
    # the steps had it all: prompt chunks beside decode rows, reading shared blocks too
    assert any(causal and shared and unique for _, shared, unique, causal in pad.needs)
    assert any(not causal and shared for _, shared, _, causal in pad.needs)
    assert sorted({pad.shapes.pad_unified(n).shape for n in pad.needs}) == WARMED


def test_graphs_mode_runs_every_step_as_one_warmed_unified_graph(graphs_runner, reference):
    before, misses = compiled_graphs(), graphs_runner.graph_stats.misses
    assert generate(graphs_runner, shared_prompts()) == reference
    assert compiled_graphs() == before and graphs_runner.graph_stats.misses == misses
    stats = graphs_runner.graph_stats
    assert stats.prompt_tokens > 0 and stats.prompt_padded_tokens >= stats.prompt_tokens


def test_padded_to_the_decode_workers_bucket_in_graphs_mode(graphs_runner, reference):
    """The bucket the pad function chooses (a decode worker's) runs its warmed graph."""
    pad = UnifiedPadding(graphs_runner)
    misses = graphs_runner.graph_stats.misses
    assert generate(graphs_runner, shared_prompts(), pad) == reference
    assert graphs_runner.graph_stats.misses == misses


def test_a_step_beyond_every_warmed_bucket_compiles_once_and_counts_once(
    graphs_runner, tiny_model_dir
):
    """Five 6-token prompts at once (with the engine's default limits): 30 tokens, more
    than any warmed bucket holds; the miss compiles (32, 0, 0, 1) once, reused after."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(6)] for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=2)

    def run(runner: ModelRunner) -> list[list[int]]:
        engine = LLMEngine(runner=runner)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return [done[i] for i in ids]

    stats = graphs_runner.graph_stats
    misses = stats.misses
    got = run(graphs_runner)
    assert stats.misses - misses == 1 and (32, 0, 0, 1) in graphs_runner.graphs
    assert run(graphs_runner) == got and stats.misses - misses == 1
    assert got == run(new_runner(tiny_model_dir, "eager"))


def test_layerwise_kv_is_reported_per_layer(graphs_runner):
    seq = Sequence([5, 6, 7, 8, 9], SamplingParams(temperature=0))
    seq.block_table = [10, 11]
    seen: list[int] = []
    graphs_runner.execute([seq], [5], pad_to=(16, 0, 0, 1), on_layer=seen.append)
    assert seen == [0, 1]


def test_bad_unified_shapes_are_refused(graphs_runner):
    seq = Sequence([5, 6, 7, 8, 9], SamplingParams(temperature=0))
    seq.block_table = [10, 11]
    with pytest.raises(ValueError, match="smaller than the step"):
        graphs_runner.execute([seq], [5], pad_to=(4, 0, 0, 1))
    with pytest.raises(ValueError, match="smaller than the step"):  # a prompt needs causal
        graphs_runner.execute([seq], [5], pad_to=(16, 0, 0, 0))
    with pytest.raises(ValueError, match="a unified shape is"):
        graphs_runner.execute([seq], [5], pad_to=(16, -1, 0, 1))


def test_a_colocated_decode_worker_pads_every_step_to_its_unified_buckets(tiny_model_dir):
    """strategy unified on a colocated decode worker: its buckets sized for its engine and
    pool, every step (prompt chunks too) padded to one, the unpadded engine's tokens."""
    from bucketserve.decode_worker.config import DecodeWorkerConfig
    from bucketserve.decode_worker.decode_worker import DecodeWorker
    from bucketserve.messages import ServeRequest, WorkerRequest

    runner = ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=64)
    config = DecodeWorkerConfig(
        engine=EngineConfig(runner=runner, scheduler=LIMITS),
        shape_buckets=SHAPES,
        pad_to_shape_buckets=True,
        prefills=True,
        transport="inprocess",
    )
    prompts = shared_prompts()
    worker = DecodeWorker(config)
    try:
        shapes = worker.shapes.config
        assert (shapes.max_num_seqs, shapes.max_num_batched_tokens) == (4, 16)
        assert shapes.num_blocks == 64 and worker.shapes.unified
        padded: list = []
        execute = worker.runner.execute

        def spy(seqs, counts, pad_to=None, on_layer=None):
            padded.append(pad_to)
            return execute(seqs, counts, pad_to, on_layer)

        worker.runner.execute = spy
        requests = [
            WorkerRequest(ServeRequest(f"r{i}", p, GREEDY), []) for i, p in enumerate(prompts)
        ]
        admitted = worker.admit_prompts(requests).admitted
        assert sorted(admitted) == sorted(r.request_id for r in requests)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        finished: set[str] = set()
        deadline = time.monotonic() + 60
        while len(finished) < len(requests) and time.monotonic() < deadline:
            for step in worker.next_outputs(timeout_s=0.5):
                for delta in step.deltas:
                    tokens[delta.request_id] += delta.token_ids
                    if delta.finished:
                        finished.add(delta.request_id)
        assert worker.stats().graph_misses == 0
    finally:
        worker.shutdown()
    eager = new_runner(tiny_model_dir, "eager")
    assert [tokens[r.request_id] for r in requests] == generate(eager, prompts)
    assert padded and all(p is not None and len(p) == 4 for p in padded)
    assert any(p[3] == 1 for p in padded) and any(p[3] == 0 for p in padded)
