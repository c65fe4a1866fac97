"""`bucketserve offline` on the tiny model."""

from __future__ import annotations

import pytest

from bucketserve.cli import main


def test_offline_prints_each_reply(tiny_model_dir, capsys):
    argv = ["offline", "--model", str(tiny_model_dir), "--max-tokens", "3", "--device", "cpu"]
    assert main([*argv, "Hello", "Name one fruit."]) == 0
    out = capsys.readouterr().out
    assert out.index("### Hello\n") < out.index("### Name one fruit.\n")
    assert out.count("[3 tokens, length]") == 2
    assert "2 replies, 6 tokens in" in out


def test_offline_rejects_bad_sampling_flags(tiny_model_dir):
    argv = ["offline", "--model", str(tiny_model_dir), "--temperature", "-1"]
    with pytest.raises(SystemExit, match="temperature must be in"):
        main(argv)
