import subprocess
import sys

from bucketserve.cli import main
from tests.bucket_manager.test_shape_buckets import DOC_DECODE, DOC_PROMPT, DOC_PROMPT_CONFIG


def test_buckets_prints_the_doc_default(capsys):
    assert main(["buckets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == DOC_PROMPT_CONFIG
    assert lines[2:] == [DOC_PROMPT, DOC_DECODE]


def test_flags_override_the_config_file(tmp_path, capsys):
    config = tmp_path / "service.yaml"
    config.write_text(
        "buckets:\n"
        "  shape_buckets:\n"
        "    strategy: linear\n"
        "    max_model_len: 512\n"
        "    prompt: {bs: [1, 2, 2], query: [128, 128, 512], ctx: [0, 1, 0]}\n"
        "    decode: {bs: [1, 1, 1], blocks: [4, 4, 8]}\n"
    )
    assert main(["buckets", "--config", str(config), "--decode-block", "2", "32", "8"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "Prompt bucket config (min, step, max_warmup) bs:[1, 2, 2], seq:[128, 128, 512]",
        "Decode bucket config (min, step, max_warmup) bs:[1, 1, 1], block:[2, 32, 8]",
        "Generated 8 prompt buckets [bs, query, num_blocks]: [(1, 128, 0), (1, 256, 0), "
        "(1, 384, 0), (1, 512, 0), (2, 128, 0), (2, 256, 0), (2, 384, 0), (2, 512, 0)]",
        "Generated 3 decode buckets [bs, query, num_blocks]: [(1, 1, 2), (1, 1, 4), (1, 1, 8)]",
    ]


def test_file_strategy_and_errors(tmp_path, capsys):
    path = tmp_path / "b.txt"
    path.write_text("(1, [256, 512], 0)\n(2, 1, range(4, 8, 4))\n")
    assert main(["buckets", "--strategy", "file", "--file", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"Bucket file: {path}",
        "Generated 2 prompt buckets [bs, query, num_blocks]: [(1, 256, 0), (1, 512, 0)]",
        "Generated 2 decode buckets [bs, query, num_blocks]: [(2, 1, 4), (2, 1, 8)]",
    ]
    path.write_text("(1, 2, 3)\n(1, 2 3)\n")
    assert main(["buckets", "--strategy", "file", "--file", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}:2:7: expected ',' between the three tuple elements, got '3'\n"
    )
    assert main(["buckets", "--prompt-seq", "128", "128"]) == 2
    assert "--prompt-seq: must be [min, step, max]" in capsys.readouterr().err


def test_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "bucketserve.cli", "buckets", "--prompt-bs", "1", "2", "4", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.splitlines()[2].startswith("Generated 108 prompt buckets")


def test_the_gaudi_config_yields_its_decode_buckets(capsys):
    """serve-gaudi.yaml's decode blocks count the batch's total KV blocks (vllm-gaudi's
    meaning): 32 (one 4096-token sequence of 128-token blocks) up to 128 x 32 = 4096."""
    assert main(["buckets", "--config", "bucketserve/deploy/serve-gaudi.yaml"]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert lines[1] == "Decode bucket config (min, step, max_warmup, limit) bs:[1, 2, 128, 8], " \
        "block:[32, 32, 4096, 14]"
    assert lines[3].startswith("Generated 112 decode buckets") and "(128, 1, 4096)" in lines[3]
    assert "57 of 112 decode buckets are reachable (blocks <= batch x 32" in out.err
