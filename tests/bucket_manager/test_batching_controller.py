import pytest

from bucketserve.bucket_manager import BatchingConfig, BatchingController, BucketRequest

# Llama-2-13B: L = 40 layers, H = 40 heads, D = 128, B = 2 bytes (fp16)
# 2LHDB = 819_200 bytes per token; M_remain = 10 GiB = 10_737_418_240 bytes
# M_safe = 0.9 x M_remain = 9_663_676_416 -> 9_663_676_416 / 819_200 = 11_796.48 tokens
LLAMA_13B = {"num_layers": 40, "num_heads": 40, "head_dim": 128, "dtype_bytes": 2}
TEN_GIB = 10 * 1024**3


@pytest.mark.parametrize(
    ("seq_lens", "n_max"),
    [
        ([4000, 4000, 3000, 1000], 3),  # 11_000 fits, 12_000 does not
        ([5000, 6796], 2),  # exactly 11_796 tokens fit
        ([5000, 6797], 1),
        ([11797], 0),
        ([100] * 200, 117),  # 11_700 fits, 11_800 does not
    ],
)
def test_eq6_in_bytes_matches_hand_computed_values(seq_lens, n_max):
    controller = BatchingController(BatchingConfig())
    assert controller.max_batch_size_from_memory(seq_lens, TEN_GIB, **LLAMA_13B) == n_max


def test_eq5_safe_blocks_is_exact():
    controller = BatchingController(BatchingConfig())
    assert [controller.safe_blocks(n) for n in (0, 9, 10, 1000, 1001)] == [0, 8, 9, 900, 900]
    half = BatchingController(BatchingConfig(safety_fraction=0.5))
    assert half.safe_blocks(7) == 3


def test_eq6_in_blocks_with_the_sequence_cap():
    controller = BatchingController(BatchingConfig(max_num_seqs=4))
    assert controller.admit([300, 300, 300, 1], free_blocks=1000) == 3  # 900 safe blocks
    assert controller.admit([450, 450], free_blocks=1000) == 2
    assert controller.admit([901], free_blocks=1000) == 0
    assert controller.admit([1] * 10, free_blocks=1000) == 4  # max_num_seqs
    assert controller.n_max(free_blocks=1000, mean_blocks=100) == 4
    wide = BatchingController(BatchingConfig())
    assert wide.n_max(free_blocks=1000, mean_blocks=7.5) == 120  # 900 / 7.5
    assert wide.n_max(free_blocks=0, mean_blocks=3) == 1  # never below one


def test_kv_blocks_count_output_tokens_by_default():
    request = BucketRequest("a", prompt_len=20, max_tokens=13)
    assert BatchingController(BatchingConfig()).kv_blocks(request, block_size=16) == 3  # 33
    prompt_only = BatchingController(BatchingConfig(count_output_tokens=False))
    assert prompt_only.kv_blocks(request, block_size=16) == 2  # 20
    assert prompt_only.kv_blocks(BucketRequest("b", 32), block_size=16) == 2


def test_kv_blocks_of_n_samples_count_the_shared_prompt_blocks_once():
    """Prompt 40 in blocks of 16: blocks 0-1 (32 tokens) are shared, each sample holds its
    own copy of the block with the last prompt token and its growth."""
    one = BucketRequest("a", prompt_len=40, max_tokens=30)  # 70 tokens: 5 blocks
    four = BucketRequest("b", prompt_len=40, max_tokens=30, samples=4)
    controller = BatchingController(BatchingConfig())
    assert controller.kv_blocks(one, block_size=16) == 5
    assert controller.kv_blocks(four, block_size=16) == 5 + 3 * (5 - 2)
    prompt_only = BatchingController(BatchingConfig(count_output_tokens=False))
    assert prompt_only.kv_blocks(four, block_size=16) == 3 + 3  # a tail block each
    with pytest.raises(ValueError, match="samples must be an integer >= 1"):
        BucketRequest("c", prompt_len=4, samples=0)


def test_memory_eq6_rejects_bad_geometry():
    controller = BatchingController(BatchingConfig())
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1, got 0"):
        controller.max_batch_size_from_memory([1], TEN_GIB, 40, 0, 128, 2)
