"""Progress bars: widgets while they run, text once closed or in a saved run (helpers.progress)."""
import contextlib
import io

from tqdm.notebook import tqdm as notebook_tqdm

from helpers import progress


def test_a_closed_widget_bar_leaves_text_not_a_widget():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bar = progress._widget_tqdm(notebook_tqdm)(range(3), desc="train")
        for _ in bar:
            pass
    assert out.getvalue().splitlines()[-1].startswith("train: 100%")  # the last state, as text
    assert bar.container.comm is None  # the widget is closed: nothing for a reopened notebook to miss


def test_a_bar_that_is_not_kept_prints_nothing():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bar = progress._widget_tqdm(notebook_tqdm)(range(2), desc="eval", leave=False)
        list(bar)
    assert "eval: 100%" not in out.getvalue()


def test_saved_runs_get_text_bars(monkeypatch):
    monkeypatch.setenv(progress.SAVED_RUN_ENV, "1")
    bar = progress.progress_bar(total=2, desc="x")
    assert not hasattr(bar, "container")
    bar.close()
