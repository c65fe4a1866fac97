import pytest

from benchmarks.simulator.__main__ import main


def test_online_plot_is_a_png_of_the_stated_size(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from benchmarks.simulator.plots import plot_online

    rows = [
        {"rate": rate, "system": name, "slo_attainment": att, "server_rps": rate * att}
        for name in ("bucketserve", "fcfs")
        for rate, att in ((1.0, 1.0), (2.0, 0.5))
    ]
    (path,) = plot_online({"workloads": {"short": {"rows": rows}}}, tmp_path)
    assert path == tmp_path / "fig5ce_online_short.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (440, 1100)  # 10 x 4 inches at 110 dpi


def test_cli_refuses_bad_arguments_before_running_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["offline", "--seeds", "0", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--seeds must be positive, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--out", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []
