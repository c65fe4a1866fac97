"""ModelRunner.execute: the scheduler contract, padding, seeding, handoff and bad input."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.worker.kv_cache import KVCache
from bucketserve.runtime.worker.model_runner import ModelRunner
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

BLOCK = 4
NUM_BLOCKS = 48


@pytest.fixture
def runner(tiny_model_dir) -> ModelRunner:
    config = ModelRunnerConfig(
        model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS
    )
    return ModelRunner(config)


class Blocks:
    """A shuffled free list standing in for the block manager's bookkeeping."""

    def __init__(self, n: int = NUM_BLOCKS, seed: int = 0) -> None:
        self.free = list(range(n))
        random.Random(seed).shuffle(self.free)

    def cover(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK < num_tokens:
            seq.block_table.append(self.free.pop())


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def generate(
    runner: ModelRunner,
    seqs: list[Sequence],
    steps: int,
    blocks: Blocks,
    chunk: int | None = None,
    pad: bool = False,
) -> list[list[int]]:
    """A minimal engine loop: (chunked) prefill, then decode; returns the output tokens."""
    while any(s.num_output_tokens < steps for s in seqs):
        live = [s for s in seqs if s.num_output_tokens < steps]
        counts = [min(len(s) - s.num_computed_tokens, chunk or len(s)) for s in live]
        for s, n in zip(live, counts, strict=True):
            blocks.cover(s, s.num_computed_tokens + n)
        pad_to = None
        if pad:
            need = max(
                -(-(s.num_computed_tokens + n) // BLOCK) for s, n in zip(live, counts, strict=True)
            )
            pad_to = (len(live) + 2, max(counts) + 3, need + 2)
        out = runner.execute(live, counts, pad_to)
        for s, n, token in zip(live, counts, out, strict=True):
            s.num_computed_tokens += n
            if token is not None:
                s.append_token(token)
    return [s.output_token_ids for s in seqs]


def new_seqs(token_lists, **params) -> list[Sequence]:
    return [Sequence(t, SamplingParams(**{"temperature": 0, **params})) for t in token_lists]


def test_greedy_generation_matches_transformers(gemm_backend, tiny_model_dir):
    runner = ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    )
    token_lists = prompts(3)
    got = generate(runner, new_seqs(token_lists), 6, Blocks())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for ids, outputs in zip(token_lists, got, strict=True):
        ids = list(ids)
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert outputs == ids[-6:]


def test_padding_and_chunking_never_change_outputs(runner):
    token_lists = prompts(4, seed=1)
    plain = generate(runner, new_seqs(token_lists), 5, Blocks(seed=1))
    padded = generate(runner, new_seqs(token_lists), 5, Blocks(seed=2), pad=True)
    chunked = generate(runner, new_seqs(token_lists), 5, Blocks(seed=3), chunk=3)
    assert padded == plain
    assert chunked == plain


def test_execute_contract(runner):
    seqs = new_seqs([[5, 6, 7, 8, 9, 10], [11, 12, 13]])
    blocks = Blocks()
    for s in seqs:
        blocks.cover(s, len(s))
    before = [(list(s.token_ids), s.num_computed_tokens, list(s.block_table)) for s in seqs]
    out = runner.execute(seqs, [4, 3])  # a partial chunk, then a whole prompt
    assert out[0] is None and isinstance(out[1], int) and 0 <= out[1] < 49152
    assert [(s.token_ids, s.num_computed_tokens, s.block_table) for s in seqs] == before


def test_padding_writes_only_the_real_slots(runner):
    seq = new_seqs([[5, 6, 7, 8, 9]])[0]
    seq.block_table = [9, 3]
    before = runner.kv_cache.kv
    runner.execute([seq], [5], pad_to=(3, 8, 4))
    changed = (runner.kv_cache.kv != before).any(-1).any(2)  # [layer, k/v, block, slot]
    written = torch.nonzero(changed.any(0).any(0)).tolist()
    real = {(9, 0), (9, 1), (9, 2), (9, 3), (3, 0)}
    null = runner.kv_cache.null_block
    assert {(b, o) for b, o in written if b != null} == real


def test_warmup_leaves_allocatable_blocks_untouched(runner):
    before = runner.kv_cache.kv[:, :, :, :NUM_BLOCKS].clone()
    runner.warmup([(1, 8, 2), (4, 1, 6), (2, 4, 3)])
    assert torch.equal(runner.kv_cache.kv[:, :, :, :NUM_BLOCKS], before)
    with pytest.raises(ValueError, match="shape must be"):
        runner.warmup([(0, 1, 1)])
    with pytest.raises(ValueError, match="more blocks than max_model_len"):
        runner.warmup([(1, 1, 1000)])


def test_seeded_sampling_is_batch_and_recompute_invariant(runner):
    token_lists = prompts(3, seed=4)
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
    alone = generate(runner, new_seqs(token_lists[:1], **params), 6, Blocks())
    crowd = new_seqs(token_lists, **params)
    crowd[1].sampling_params = SamplingParams(temperature=0.7, seed=99)
    crowd[2].sampling_params = SamplingParams(temperature=1.3)  # unseeded
    together = generate(runner, crowd, 6, Blocks(seed=5))
    assert together[0] == alone[0]
    # Preemption by recompute: forget the KV, recompute prompt + 3 outputs, continue.
    seq = new_seqs(token_lists[:1], **params)[0]
    generate(runner, [seq], 3, Blocks(seed=6))
    seq.num_computed_tokens, seq.block_table = 0, []
    generate(runner, [seq], 6, Blocks(seed=7))
    assert seq.output_token_ids == alone[0]


def test_prefill_decode_handoff_through_kv_export(runner, tiny_model_dir):
    token_lists = prompts(2, seed=8)
    params = {"temperature": 0.8, "seed": 7}
    reference = generate(runner, new_seqs(token_lists, **params), 5, Blocks())

    decode_runner = ModelRunner(
        ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    )
    seqs = new_seqs(token_lists, **params)
    prefill_blocks, decode_blocks = Blocks(seed=9), Blocks(seed=10)
    for s in seqs:
        prefill_blocks.cover(s, len(s))
    first = runner.execute(seqs, [len(s) for s in seqs])
    for s, token in zip(seqs, first, strict=True):
        src = list(s.block_table)
        s.num_computed_tokens = len(s)
        s.append_token(token)
        s.block_table = []
        decode_blocks.cover(s, s.num_computed_tokens)
        for layer in range(runner.kv_cache.num_layers):
            data = runner.kv_cache.export_blocks(layer, src)
            decode_runner.kv_cache.import_blocks(layer, s.block_table, data)
    assert generate(decode_runner, seqs, 5, decode_blocks) == reference


@pytest.mark.parametrize("execution", ["eager", "graphs"])
def test_bad_steps_raise_and_change_nothing(tiny_model_dir, execution):
    """Validated before anything runs, in both modes (graphs mode groups rows first)."""
    runner = ModelRunner(ModelRunnerConfig(
        model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, execution=execution
    ))
    seq = new_seqs([[5, 6, 7, 8, 9]])[0]
    seq.block_table = [1, 2]
    pool = runner.kv_cache.kv.clone()
    cases = [
        (([seq], [5, 1]), "1 sequences but 2 num_new_tokens"),
        (([seq], [0]), "num_new_tokens 0 must be in"),
        (([seq], [6]), "num_new_tokens 6 must be in"),
        (([], []), "at least one sequence"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            runner.execute(*args)
    with pytest.raises(ValueError, match=r"pad_to .* is smaller than the step"):
        runner.execute([seq], [5], pad_to=(1, 4, 2))
    with pytest.raises(ValueError, match="shape must be"):
        runner.execute([seq], [5], pad_to=(1, 8))
    short = new_seqs([[5] * 9])[0]
    short.block_table = [1, 2]
    with pytest.raises(ValueError, match="block_table has 2 blocks, 3 are needed"):
        runner.execute([short], [9])
    seq.block_table = [1, NUM_BLOCKS]
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 48\)"):
        runner.execute([seq], [5])
    assert torch.equal(runner.kv_cache.kv, pool)


def test_config_errors(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"block_size\n  Input should be greater than or equal"):
        ModelRunnerConfig(block_size=0)
    with pytest.raises(ValueError, match=r"num_kv_blocks\n  Input should be greater than"):
        ModelRunnerConfig(num_kv_blocks=0)
    with pytest.raises(ValueError, match=r"kv_memory_fraction\n  Input should be less than"):
        ModelRunnerConfig(kv_memory_fraction=1.5)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        ModelRunner(ModelRunnerConfig(model=str(tiny_model_dir), max_model_len=1024))
    with pytest.raises(ValueError, match="does not exist"):
        ModelRunner(ModelRunnerConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match=r"has no config\.json"):
        ModelRunner(ModelRunnerConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match=r"device\n  Value error, must be one of \['auto', 'cpu'"):
        ModelRunnerConfig(model=str(tiny_model_dir), device="tpu")
    with pytest.raises(ValueError, match=r"dtype\n  Input should be 'auto', 'float32'"):
        ModelRunnerConfig(model=str(tiny_model_dir), dtype="float8")


def test_max_model_len_is_enforced(tiny_model_dir):
    runner = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_model_dir), block_size=BLOCK, num_kv_blocks=8, max_model_len=6
        )
    )
    seq = new_seqs([[5, 6, 7, 8, 9, 10, 11]])[0]
    seq.block_table = [0, 1]
    with pytest.raises(ValueError, match="7 tokens exceed max_model_len 6"):
        runner.execute([seq], [7])


def test_kv_pool_sized_from_cpu_cap(tiny_model_dir):
    per_block = KVCache.block_bytes(2, BLOCK, 2, 16, torch.float32)
    assert per_block == 2 * 2 * BLOCK * 2 * 16 * 4
    runner = ModelRunner(
        ModelRunnerConfig(
            model=str(tiny_model_dir), block_size=BLOCK, cpu_kv_cache_bytes=10 * per_block,
            device="cpu",
        )
    )
    assert runner.num_kv_blocks == 10
    assert runner.kv_cache.bytes_per_block == per_block
    assert runner.kv_cache.kv.shape == (2, 2, 2, 11, BLOCK, 16)  # + the null block


@pytest.fixture(scope="module")
def smollm_hf_greedy(smollm_dir) -> Callable[[list[int]], list[int]]:
    """transformers' 12 greedy tokens after a prompt, each prompt computed once: they do not
    depend on the GEMM backend ours runs on."""
    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    done: dict[tuple[int, ...], list[int]] = {}

    def greedy(ids: list[int]) -> list[int]:
        if tuple(ids) not in done:
            prompt = torch.tensor([ids])
            # An explicit mask: the prompt holds <|im_end|>, which is also the pad token.
            ref = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            done[tuple(ids)] = ref[0, len(ids) :].tolist()
        return done[tuple(ids)]

    return greedy


@pytest.mark.smollm
def test_smollm_batched_greedy_chat_matches_transformers(
    smollm_dir, gemm_backend, smollm_hf_greedy
):
    config = ModelRunnerConfig(model=str(smollm_dir), block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    runner = ModelRunner(config)
    tok = runner.tokenizer
    questions = ["What is the capital of France?", "Name three colors.", "Count from 1 to 5."]
    token_lists = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions
    ]
    got = generate(runner, new_seqs(token_lists), 12, Blocks())
    for ids, outputs in zip(token_lists, got, strict=True):
        assert outputs == smollm_hf_greedy(ids)


def test_device_choice_on_a_cpu_machine():
    from bucketserve.runtime.cpu.gemm import linear
    from bucketserve.runtime.worker.device import Device

    auto = Device("auto")
    assert auto.torch_device == torch.device("cpu") or torch.cuda.is_available()
    cpu = Device("cpu")
    assert (cpu.type, cpu.default_dtype) == ("cpu", torch.float32)
    assert cpu.resolve_dtype("auto") is torch.float32  # even with native bf16: see default_dtype
    assert isinstance(cpu.native_bf16, bool)
    assert cpu.resolve_dtype("bf16") is torch.bfloat16
    assert cpu.free_memory() > 0
    fn = lambda x: x + 1  # noqa: E731
    assert cpu.graph(fn, (torch.zeros(2),)) is fn
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        cpu.resolve_dtype("int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Device("cuda:0")
    x, w, b = torch.randn(5, 8), torch.randn(3, 8), torch.randn(3)
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_packed_weights_replace_the_plain_ones(tiny_model_dir, gemm_backend):
    """Eager CPU steps read packed copies (oneDNN's, MKL's or the panels), so the plain
    Linear weights are dropped rather than held twice (the packed model's tokens:
    test_greedy_generation_matches_...). With the panels, the layers' weights also have
    MKL's packing for prefill-sized GEMMs (a tiny model fits); the LM head does not."""
    from bucketserve.runtime.cpu import mkl_sgemm
    from bucketserve.runtime.cpu.host_gemm import RowSplitGemm
    from bucketserve.runtime.cpu.mkl_sgemm import PackedSgemm
    from bucketserve.runtime.cpu.panel_gemm import PanelGemm

    runner = ModelRunner(ModelRunnerConfig(model=str(tiny_model_dir), block_size=BLOCK,
                                           num_kv_blocks=NUM_BLOCKS, device="cpu"))
    linears = [m for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert all(m.packed is not None and m.weight.numel() == 0 for m in linears)
    layers = [p for m in linears for p in m.packed]
    split = gemm_backend == "kernels" and mkl_sgemm.available()
    assert all(isinstance(p, RowSplitGemm) == split for p in layers)
    assert all(isinstance(p.large, PackedSgemm) for p in layers if split)
    packed = [p.small if split else p for p in layers] + [runner.model.lm_head.packed]
    assert all(isinstance(p, PackedSgemm) == (gemm_backend == "mkl") for p in packed)
    assert all(isinstance(p, PanelGemm) == (gemm_backend == "kernels") for p in packed)
