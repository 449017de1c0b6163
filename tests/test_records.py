import json

import pytest

from helpers.records import FIGURES_ENV, record_figure, record_figures, recorded_figures


def test_record_figure_keeps_and_writes(tmp_path, monkeypatch):
    target = tmp_path / "figures.json"
    monkeypatch.setenv(FIGURES_ENV, str(target))
    record_figure("peak_vram_gib", 2.5)
    record_figure("passed", True)
    assert json.loads(target.read_text()) == {"peak_vram_gib": 2.5, "passed": True}
    assert recorded_figures()["peak_vram_gib"] == 2.5


def test_record_figure_refuses_what_json_cannot_hold():
    with pytest.raises(TypeError, match=r"keeps numbers, strings, lists and dicts .*Fix: record_figure\('bad', "):
        record_figure("bad", object())


def test_record_figure_writes_numpy_and_torch_scalars_as_numbers(tmp_path, monkeypatch):
    """Issue 23 item 10: numpy.float32(1.5) or a 0-d tensor was 'not JSON serializable'."""
    import numpy
    import torch

    target = tmp_path / "figures.json"
    monkeypatch.setenv(FIGURES_ENV, str(target))
    record_figure("np", numpy.float32(1.5))
    record_figure("tensor", torch.tensor(2.0))
    assert json.loads(target.read_text()) == {"np": 1.5, "tensor": 2.0}
    assert type(recorded_figures()["tensor"]) is float


def test_report_gb_reads_new_rows_and_converts_old_gib_rows():
    from helpers.records import report_gb

    assert report_gb({"peak_rss_gb": 12.5, "peak_rss_gib": 1.0}, "peak_rss") == 12.5  # GB wins
    assert report_gb({"peak_rss_gib": 10.0}, "peak_rss") == pytest.approx(10.737, abs=1e-3)  # 10 GiB in GB
    assert report_gb({}, "disk") == 0.0


def test_reports_are_printed_to_learners_without_the_projects_targets():
    from helpers.records import report_for_learners

    line = ("- gpt2: ZeRO-2 / plain tokens/s = 0.612 (target >= 0.9: NOT met); worst estimate error 8% "
            "(zero3; target <= 15%: met)")
    assert report_for_learners(line) == "- gpt2: ZeRO-2 / plain tokens/s = 0.612; worst estimate error 8% (zero3)"
    assert report_for_learners("largest / plain: 4.39 (target >= 4: met)\n| a | b |") == "largest / plain: 4.39\n| a | b |"
    oom = "| plain | CUDA out of memory: CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a total capacity of 139.80 GiB |"
    assert report_for_learners(oom) == "| plain | CUDA out of memory: tried to allocate 26.00 MiB |"


def test_record_figures_keeps_several_in_one_call(tmp_path, monkeypatch):
    target = tmp_path / "figures.json"
    monkeypatch.setenv(FIGURES_ENV, str(target))
    record_figures(a_loss=1.5, b_steps=3)
    assert json.loads(target.read_text()) == {"a_loss": 1.5, "b_steps": 3}
    assert recorded_figures()["b_steps"] == 3
