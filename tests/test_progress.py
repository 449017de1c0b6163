"""Progress bars: widgets while they run, text once closed or in a saved run (helpers.progress)."""
from tqdm.notebook import tqdm as notebook_tqdm

from helpers import progress


class _Handle:
    def __init__(self, obj):
        self.shown, self.updates = obj, []

    def update(self, obj, raw=False):
        self.updates.append((obj, raw))


def _capture_displays(monkeypatch):
    handles = []

    def display(obj, display_id=None):
        assert display_id is True  # shown under a display id, so that it can be replaced
        handles.append(_Handle(obj))
        return handles[-1]

    monkeypatch.setattr("IPython.display.display", display)
    return handles


def test_a_finished_widget_bar_is_replaced_in_place_by_its_last_line(monkeypatch):
    handles = _capture_displays(monkeypatch)
    bar = progress._widget_tqdm(notebook_tqdm)(range(3), desc="train")
    for _ in bar:
        pass
    (handle,) = handles
    assert handle.shown is bar.container  # the widget while it runs
    (update, raw), = handle.updates
    assert raw and update["text/plain"].startswith("train: 100%|")  # then its final state, as text, in its place
    assert bar.container.comm is None  # the widget is closed: nothing for a reopened notebook to miss


def test_a_bar_that_is_not_kept_leaves_nothing(monkeypatch):
    handles = _capture_displays(monkeypatch)
    list(progress._widget_tqdm(notebook_tqdm)(range(2), desc="eval", leave=False))
    assert handles[0].updates == [({"text/plain": ""}, True)]


def test_text_bars_are_left_as_they_are_and_wrapping_twice_changes_nothing():
    from tqdm.std import tqdm as text_tqdm

    assert progress._widget_tqdm(text_tqdm) is text_tqdm
    once = progress._widget_tqdm(notebook_tqdm)
    assert progress._widget_tqdm(once) is once  # a re-run bootstrap does not display each bar twice


def test_the_bootstrap_patches_the_notebooks_own_tqdm(monkeypatch):
    import tqdm.auto
    import tqdm.autonotebook

    monkeypatch.setattr(tqdm.auto, "tqdm", notebook_tqdm)  # as in a notebook
    monkeypatch.setattr(tqdm.autonotebook, "tqdm", notebook_tqdm)
    monkeypatch.delenv(progress.SAVED_RUN_ENV, raising=False)
    assert progress.course_progress_bars() == "widget" and tqdm.auto.tqdm.closes_to_text
    monkeypatch.setenv(progress.SAVED_RUN_ENV, "1")
    assert progress.course_progress_bars() == "text" and not hasattr(tqdm.auto.tqdm, "closes_to_text")


def test_saved_runs_get_text_bars(monkeypatch):
    monkeypatch.setenv(progress.SAVED_RUN_ENV, "1")
    bar = progress.progress_bar(total=2, desc="x")
    assert not hasattr(bar, "container")
    bar.close()
