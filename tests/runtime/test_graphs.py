"""Graphs mode: one compiled graph per shape bucket, the same greedy tokens as eager and as
transformers, nothing compiled after warm-up while batches fit, one compile per miss."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.cpu import gemm_plan, kernels, mkl_sgemm
from bucketserve.runtime.cpu.graph_ops import is_panels
from bucketserve.runtime.engine.llm import LLM
from bucketserve.runtime.worker.device import Device, graph_backend_for, hpu_lazy_mode
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from tests.runtime.test_model_runner import BLOCK, NUM_BLOCKS, Blocks, generate, new_seqs, prompts

pytestmark = pytest.mark.slow  # compiles graphs

# prompt buckets (batch, query, table width) and decode buckets (batch, 1, the batch's blocks)
BUCKETS = [(1, 16, 4), (4, 16, 4), (1, 1, 8), (4, 1, 32)]


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def regions(runner: ModelRunner) -> int:
    """Dynamo graphs one shape compiles: three regions (head, one decoder layer shared by
    all layers, tail) where the device compiles them; none where it captures the whole
    step instead (a CUDA graph per shape records the eager kernels)."""
    return 0 if runner.device.captures_whole_step else 3


@pytest.fixture(scope="module")
def graphs_runner(tiny_model_dir) -> ModelRunner:
    config = ModelRunnerConfig(
        model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, execution="graphs"
    )
    runner = ModelRunner(config)
    # dynamo caches per code object, so graphs an earlier test compiled for the same shapes
    # would be reused: start from none, so every bucket here compiles
    torch._dynamo.reset()
    before = compiled_graphs()
    seconds = runner.warmup(BUCKETS)
    assert compiled_graphs() - before == regions(runner) * len(BUCKETS)
    assert sorted(runner.graphs.shapes) == sorted(BUCKETS)
    assert set(seconds) == set(BUCKETS) and all(s > 0 for s in seconds.values())
    return runner


def eager(tiny_model_dir) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    )


def hf_greedy(model_dir, token_lists: list[list[int]], steps: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ids in token_lists:
        ids = list(ids)
        with torch.no_grad():
            for _ in range(steps):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[-steps:])
    return out


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_every_bucket_matches_eager_and_transformers(graphs_runner, tiny_model_dir, batch):
    """Batches of 1..4 (2 and 3 pad dummy rows) through prompt and decode buckets, their
    context padded to the buckets' table width: same tokens, and nothing compiled while
    serving."""
    token_lists = prompts(batch, seed=batch)
    before, misses = compiled_graphs(), graphs_runner.graph_stats.misses
    got = generate(graphs_runner, new_seqs(token_lists), 5, Blocks(seed=batch))
    assert compiled_graphs() == before and graphs_runner.graph_stats.misses == misses
    assert got == generate(eager(tiny_model_dir), new_seqs(token_lists), 5, Blocks(seed=9))
    assert got == hf_greedy(tiny_model_dir, token_lists, 5)


def test_a_batch_beyond_the_largest_bucket_compiles_once_and_counts_once(graphs_runner):
    # six 12-token prompts: one prefill part, padded to (8, 16, 4), 128 tokens, a count no
    # warmed shape has (a head region is told apart by its tokens alone where no mask is built)
    token_lists = [(p * 12)[:12] for p in prompts(6, seed=7)]
    reference = generate(graphs_runner, new_seqs(token_lists[:3]), 3, Blocks(seed=1))
    before, stats = compiled_graphs(), graphs_runner.graph_stats
    misses, miss_s = stats.misses, stats.miss_compile_s
    seqs = new_seqs(token_lists)  # 6 rows: beyond the largest bucket's 4
    got = generate(graphs_runner, seqs, 3, Blocks(seed=2))
    assert got[:3] == reference
    # the prefill step and the decode steps each miss once: one compile each, reused after
    assert stats.misses - misses == 2
    compiled = regions(graphs_runner) * 2
    assert compiled_graphs() - before == compiled
    assert stats.miss_compile_s > miss_s
    again = generate(graphs_runner, new_seqs(token_lists), 3, Blocks(seed=3))
    assert again == got and stats.misses - misses == 2
    assert compiled_graphs() - before == compiled


def test_layerwise_kv_is_reported_per_layer_on_cpu(graphs_runner):
    """Per layer as each region returns on CPU; after the replay where a graph runs whole."""
    seq = new_seqs(prompts(1, seed=11))[0]
    Blocks(seed=4).cover(seq, len(seq))
    seen: list[int] = []
    graphs_runner.execute([seq], [len(seq)], pad_to=(1, 16, 4), on_layer=seen.append)
    whole = graphs_runner.device.captures_whole_step
    assert seen == [0, 1]
    assert graphs_runner.graph_stats.kv_export == ("after_graph" if whole else "per_layer")


def test_offline_llm_in_graphs_mode_matches_eager(tiny_model_dir):
    token_lists = prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=4)
    options = {"block_size": BLOCK, "num_kv_blocks": NUM_BLOCKS, "max_num_seqs": 4}
    graphs = LLM(str(tiny_model_dir), execution="graphs", **options)
    assert graphs.engine.runner.execution == "graphs"
    graphs.warmup([(4, 16, 4), (4, 1, 32)])
    got = [o.token_ids for o in graphs.generate(token_lists, params, use_tqdm=False)]
    ref = LLM(str(tiny_model_dir), execution="eager", **options)
    assert ref.engine.runner.graphs is None
    assert got == [o.token_ids for o in ref.generate(token_lists, params, use_tqdm=False)]
    assert graphs.engine.runner.graph_stats.misses == 0


def test_execution_mode_and_graph_backend_per_device():
    assert ModelRunnerConfig().execution == "auto"
    with pytest.raises(ValueError, match=r"execution\n  Input should be 'auto', 'eager' or 'gr"):
        ModelRunnerConfig(execution="jit")
    cpu = Device("cpu")
    assert cpu.graph_backend == "inductor" and not cpu.captures_whole_step
    assert graph_backend_for("cuda") == "cuda_graphs"
    # Gaudi: eager mode (the default since software 1.21) compiles with hpu_backend; lazy
    # mode captures HPU graphs, chosen from PT_HPU_LAZY_MODE as vllm-gaudi does
    assert not hpu_lazy_mode({}) and not hpu_lazy_mode({"PT_HPU_LAZY_MODE": "0"})
    assert hpu_lazy_mode({"PT_HPU_LAZY_MODE": "1"})
    assert graph_backend_for("hpu", lazy=False) == "hpu_backend"
    assert graph_backend_for("hpu", lazy=True) == "hpu_graphs"


def test_eager_decode_padded_to_total_blocks_matches_unpadded(tiny_model_dir):
    """A decode shape's blocks are the batch's total (vllm-gaudi's meaning): a ragged batch
    padded to (4, 1, 32) reads one flat block list, with the same tokens as unpadded."""
    runner = eager(tiny_model_dir)
    token_lists = [p * 3 for p in prompts(3, seed=8)]  # ragged: 9..33 tokens
    plain = generate(runner, new_seqs(token_lists), 4, Blocks(seed=6))
    seqs, blocks = new_seqs(token_lists), Blocks(seed=7)
    for s in seqs:
        blocks.cover(s, len(s))
    for step in range(4):
        counts = [1] * 3 if step else [len(s) for s in seqs]
        out = runner.execute(seqs, counts, pad_to=(4, 1, 32) if step else None)
        for s, token in zip(seqs, out, strict=True):
            s.num_computed_tokens = len(s)
            s.append_token(token)
            blocks.cover(s, len(s))
    tables = [len(s.block_table) for s in seqs]
    assert sum(tables) <= 32 and len(set(tables)) == 3  # ragged rows, 32 blocks in all
    assert [s.output_token_ids for s in seqs] == plain


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU graphs: on a GPU the runner captures CUDA graphs"
)
def test_cpu_graphs_call_the_eager_kernels_inside_the_compiled_regions(
    gemm_backend, tiny_model_dir, monkeypatch
):
    """Graphs mode on CPU: every layer's attention is a C kernel (a custom op the compiled
    region calls, once per layer and step: the decode kernel, or the varlen kernel over a
    prompt rectangle's real tokens), and the GEMMs read the weights packed
    as the eager steps' backend packs them (panels for the kernels' GEMM, and MKL's packing
    beside them for the prompt rectangle's rows); same tokens as eager and `transformers`,
    and one compile per region and shape, whatever the layer."""
    calls = {"paged_decode": 0, "paged_prefill": 0, "gemm_panels": 0, "mkl": 0}
    for name in ("paged_decode", "paged_prefill", "gemm_panels"):
        real = getattr(kernels.CpuKernels, name)

        def counted(self, *args, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(kernels.CpuKernels, name, counted)
    real_mkl = mkl_sgemm.compute

    def counted_mkl(*args):
        calls["mkl"] += 1
        return real_mkl(*args)

    monkeypatch.setattr(mkl_sgemm, "compute", counted_mkl)
    # the 2 x 16 prompt rectangle's GEMMs take MKL's path (32 rows), decode's the panels
    monkeypatch.setattr(gemm_plan, "PREFILL_GEMM_ROWS", 32)
    mkl_rows = gemm_plan.prefill_gemm_rows(gemm_backend, 0) is not None
    config = ModelRunnerConfig(
        model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, execution="graphs"
    )
    runner = ModelRunner(config)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert (
        is_panels(qkv.packed[0]) == (gemm_backend == "kernels") and runner.graphs.attention_kernels
    )
    torch._dynamo.reset()
    before = compiled_graphs()
    runner.warmup([(2, 16, 4), (2, 1, 16)])
    assert compiled_graphs() - before == 2 * regions(runner)
    token_lists = prompts(2, seed=13)
    calls.update(dict.fromkeys(calls, 0))  # warm-up ran them too
    got = generate(runner, new_seqs(token_lists), 4, Blocks(seed=5))
    assert compiled_graphs() - before == 2 * regions(runner) and runner.graph_stats.misses == 0
    layers = runner.num_layers
    assert calls["paged_decode"] == 3 * layers  # three decode steps after the prefill
    assert calls["paged_prefill"] == layers  # the prompt rectangle: one varlen call a layer
    gemms_per_step = 5 * layers + 1  # qkv, o, gate, up, down; the head
    prompt_mkl = 5 * layers if mkl_rows else 0  # the head's 2 rows stay on the panels
    assert calls["mkl"] == prompt_mkl
    panels = 4 * gemms_per_step - prompt_mkl if gemm_backend == "kernels" else 0
    assert calls["gemm_panels"] == panels
    assert mkl_rows == (gemm_backend == "kernels" and mkl_sgemm.available())
    assert got == generate(eager(tiny_model_dir), new_seqs(token_lists), 4, Blocks(seed=9))
    assert got == hf_greedy(tiny_model_dir, token_lists, 4)
