import pytest

from bucketserve.bucket_manager import BucketFileError, BucketFileParser
from bucketserve.bucket_manager.bucket_file import split_prompt_decode


def parse(text: str) -> list[tuple[int, int, int]]:
    return BucketFileParser("buckets.txt").parse_text(text)


def test_doc_precise_buckets():
    buckets = parse("(1, 2048, 0)\n(64, 1, 1024)\n")
    assert buckets == [(1, 2048, 0), (64, 1, 1024)]
    assert split_prompt_decode(buckets) == ([(1, 2048, 0)], [(64, 1, 1024)])


def test_doc_list_is_a_cartesian_product():
    assert parse("(1, [256, 512], [0, 4, 8])") == [
        (1, 256, 0), (1, 256, 4), (1, 256, 8), (1, 512, 0), (1, 512, 4), (1, 512, 8)
    ]


def test_doc_range_includes_its_end():
    assert parse("(1, 1, range(256, 512, 128))") == [(1, 1, 256), (1, 1, 384), (1, 1, 512)]
    assert parse("(1, 1, range(1, 3))") == [(1, 1, 1), (1, 1, 2), (1, 1, 3)]
    assert parse("(1, 1, range(0, 10, 4))") == [(1, 1, 0), (1, 1, 4), (1, 1, 8)]


def test_doc_mixed_line_and_whole_file_with_comments(tmp_path):
    buckets = parse("([64, 128, 256], 1, range(512, 1024, 32))")
    assert len(buckets) == 3 * 17
    assert buckets[:2] == [(64, 1, 512), (64, 1, 544)]
    assert buckets[-1] == (256, 1, 1024)
    path = tmp_path / "b.txt"
    path.write_text("# prompt\n(1, 2048, 0)\n\n  (1, [256, 512], 0)  # two more\n(1, 256, 0)\n")
    assert BucketFileParser().parse_file(path) == [(1, 256, 0), (1, 512, 0), (1, 2048, 0)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("1, 2, 3", r"buckets.txt:2:1: expected '\(' opening a \(bs, query, blocks\) tuple"),
        ("(1, 2)", r"buckets.txt:2:6: expected ',' between the three tuple elements, got '\)'"),
        ("(1, 2, 3, 4)", r"buckets.txt:2:9: expected '\)' after exactly three elements"),
        ("(1, 2, 3) x", r"buckets.txt:2:11: expected end of line after the tuple, got 'x'"),
        ("(1, [2, 3, 4)", r"buckets.txt:2:13: expected ',' or '\]' closing the list"),
        ("(1, [], 4)", r"buckets.txt:2:6: expected an integer in the list, got '\]'"),
        ("(1, 2, range(5))", r"expected range\(start, stop\[, step\]\) with at least two"),
        ("(1, 2, range(5, 1, 1))", r"expected range with step >= 1 and stop >= start"),
        ("(1, 2, range(1, 5, 0))", r"expected range with step >= 1 and stop >= start"),
        ("(1, -2, 3)", r"buckets.txt:2:5: unexpected character '-'"),
        ("(0, 2, 3)", r"buckets.txt:2: expected bs values >= 1, got 0"),
        ("(1, 2.5, 3)", r"buckets.txt:2:6: unexpected character '.'"),
        ("(__import__('os'), 1, 1)", r"buckets.txt:2:13: unexpected character \"'\""),
        ("(__import__, 1, 1)", r"buckets.txt:2:2: expected an integer, a list"),
        ("(1, 1, eval(3))", r"buckets.txt:2:8: expected an integer, a list"),
        ("(1, 1", r"buckets.txt:2: expected ',' between the three tuple elements, got end of"),
    ],
)
def test_malformed_lines_name_file_line_and_expectation(line, message):
    with pytest.raises(BucketFileError, match=message):
        parse(f"(1, 128, 0)\n{line}\n")


def test_empty_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(BucketFileError, match="no bucket specs found"):
        parse("# nothing\n\n")
    with pytest.raises(BucketFileError, match="cannot read bucket file"):
        BucketFileParser().parse_file(tmp_path / "missing.txt")
