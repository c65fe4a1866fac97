import pytest

from benchmarks.simulator.cost_model import ACTIVATION_RESERVE_BYTES, CostModel
from benchmarks.simulator.hardware import HARDWARE, LINKS, HardwareSpec
from benchmarks.simulator.model_spec import MODELS, ModelSpec
from bucketserve.runtime.io.model_config import ModelConfig


def norms(layers: int, hidden: int) -> int:
    return layers * 2 * hidden + hidden


@pytest.mark.parametrize(
    ("name", "config"),
    [
        (
            "smollm2-135m",
            dict(
                vocab_size=49152,
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                head_dim=64,
                tie_word_embeddings=True,
            ),
        ),
        (
            "llama-2-7b",
            dict(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
                head_dim=128,
            ),
        ),
        (
            "llama-2-13b",
            dict(
                vocab_size=32000,
                hidden_size=5120,
                intermediate_size=13824,
                num_hidden_layers=40,
                num_attention_heads=40,
                num_key_value_heads=40,
                head_dim=128,
            ),
        ),
    ],
)
def test_parameter_counts_match_the_runtime_model_config(name, config):
    runtime = ModelConfig(**config)
    spec = MODELS[name]
    assert spec.num_params == runtime.num_params - norms(spec.num_layers, spec.hidden)


def test_published_sizes():
    """Hugging Face's parameter counts, which include the RMS norms the spec leaves out."""
    assert MODELS["llama-2-7b"].num_params + norms(32, 4096) == 6_738_415_616
    assert MODELS["llama-2-13b"].num_params + norms(40, 5120) == 13_015_864_320
    assert round(MODELS["opt-13b"].num_params / 1e9, 2) == 12.84  # OPT paper: 12.85B w/ biases
    assert MODELS["llama-2-13b"].kv_bytes_per_token == 2 * 40 * 5120 * 2  # 800 KiB


def test_decode_roofline_hand_checked_llama_2_7b_on_a100():
    cost = CostModel(MODELS["llama-2-7b"], HARDWARE["a100-40gb"])
    parts = cost.breakdown(cost.decode_work(1, 0))
    weights = 6_738_149_376 * 2
    assert parts["dense"] == pytest.approx(weights / (1.555e12 * 0.8))  # 10.83 ms, memory bound
    assert parts["dense"] == pytest.approx(10.833e-3, rel=1e-3)
    assert parts["attention"] == pytest.approx(524_288 / (1.555e12 * 0.8))  # one token of K/V
    assert parts["overhead"] == 2e-3 and parts["allreduce"] == 0.0
    assert cost.decode_time(1, 0) == pytest.approx(12.834e-3, rel=1e-3)


def test_prefill_roofline_hand_checked_llama_2_7b_on_a100():
    cost = CostModel(MODELS["llama-2-7b"], HARDWARE["a100-40gb"])
    parts = cost.breakdown(cost.work([1024], [0]))
    gemm = 2 * 6_476_005_376 * 1024 + 2 * 131_072_000  # layers x tokens + LM head x 1 row
    assert parts["dense"] == pytest.approx(gemm / (312e12 * 0.6))  # 70.85 ms, compute bound
    pairs = 1024 * 1025 / 2  # causal
    assert parts["attention"] == pytest.approx(pairs * 4 * 32 * 32 * 128 / (312e12 * 0.4))
    assert cost.prefill_time([1024]) == pytest.approx(75.05e-3, rel=1e-3)


def test_padding_and_growth_never_make_a_step_cheaper():
    cost = CostModel(MODELS["llama-2-13b"], HARDWARE["a100-40gb"])
    assert cost.prefill_time([100, 900], (2, 900)) > cost.prefill_time([100, 900])
    assert cost.prefill_time([100, 900], (4, 1024)) > cost.prefill_time([100, 900], (2, 900))
    for b in (1, 8, 64):
        assert cost.decode_time(b, b * 512) < cost.decode_time(b, b * 2048)
        assert cost.decode_time(b, b * 512) <= cost.decode_time(2 * b, 2 * b * 512)


def test_kv_capacity_and_tensor_parallelism():
    model, a100 = MODELS["llama-2-13b"], HARDWARE["a100-40gb"]
    one = CostModel(model, a100)
    free = 40e9 * 0.9 - model.weight_bytes - ACTIVATION_RESERVE_BYTES
    assert one.kv_capacity_tokens() == int(free // 819_200)
    two = CostModel(model, a100, tp=2, tp_link=LINKS["nvlink3"])
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()  # half the weights each
    parts = two.breakdown(two.decode_work(1, 0))
    assert parts["dense"] == pytest.approx(one.breakdown(one.decode_work(1, 0))["dense"] / 2)
    volume = 5120 * 2 * 2 * (2 - 1) / 2  # one token's hidden state, ring all-reduce over 2
    assert parts["allreduce"] == pytest.approx(2 * 40 * (5e-6 + volume / (300e9 * 0.8)))


def test_bad_specs_and_shapes_raise_clear_errors():
    small = HARDWARE["a100-40gb"].with_(mem_bytes=20e9)
    with pytest.raises(ValueError, match="leaves no KV memory"):
        CostModel(MODELS["llama-2-13b"], small).kv_capacity_tokens()
    with pytest.raises(ValueError, match="needs the tp_link"):
        CostModel(MODELS["llama-2-7b"], HARDWARE["h100-sxm"], tp=2)
    with pytest.raises(ValueError, match="must divide"):
        CostModel(MODELS["smollm2-135m"], HARDWARE["h100-sxm"], tp=2, tp_link=LINKS["nvlink4"])
    with pytest.raises(ValueError, match="flops_efficiency"):
        HardwareSpec("x", 1e12, 1e12, 1e9, flops_efficiency=1.5)
    with pytest.raises(ValueError, match="num_heads"):
        ModelSpec("odd", 2, 100, 3, 3, 10, 10, 64)
    cost = CostModel(MODELS["llama-2-7b"], HARDWARE["a100-40gb"])
    with pytest.raises(ValueError, match="cannot hold"):
        cost.prefill_time([100, 900], (2, 512))
    with pytest.raises(ValueError, match="one context length per row"):
        cost.step_time([1, 1], [5])


def test_kv_transfer_time_from_link_bandwidth():
    cost = CostModel(MODELS["llama-2-13b"], HARDWARE["a100-40gb"])
    assert cost.transfer_time(1000, LINKS["nvlink3"]) == pytest.approx(
        5e-6 + 1000 * 819_200 / (300e9 * 0.8)
    )
    assert cost.transfer_time(1000, LINKS["roce-100g"]) > 20 * cost.transfer_time(
        1000, LINKS["nvlink3"]
    )


def test_roofline_table_covers_every_paper_model_on_every_accelerator():
    from benchmarks.simulator.roofline_table import run_roofline_table

    rows = run_roofline_table()["rows"]
    assert {(r["hardware"], r["model"]) for r in rows} == {
        (h, m)
        for h in ("a100-40gb", "h100-sxm", "gaudi2")
        for m in ("llama-2-7b", "llama-2-13b", "opt-13b")
    }
    gaudi = next(r for r in rows if r["hardware"] == "gaudi2" and r["model"] == "llama-2-13b")
    # 1024 tokens x 800 KiB over 3 x 100 GbE at 80 %, plus 20 us latency
    assert gaudi["kv_transfer_1024_ms"] == pytest.approx(1e3 * (20e-6 + 1024 * 819_200 / 30e9))
    a100 = next(r for r in rows if r["hardware"] == "a100-40gb" and r["model"] == "llama-2-7b")
    assert a100["decode_b1_ms"] == pytest.approx(
        1e3 * CostModel(MODELS["llama-2-7b"], HARDWARE["a100-40gb"]).decode_time(1, 1024)
    )
    assert not a100["b64_fits"] and a100["kv_tokens"] < 64 * 1025
