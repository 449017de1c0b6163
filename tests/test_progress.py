"""Progress bars: widgets while they run, text once closed or in a saved run (helpers.progress)."""
import types

import pytest
from tqdm.notebook import tqdm as notebook_tqdm

from helpers import progress


class _Handle:
    def __init__(self, obj):
        self.shown, self.updates = obj, []

    def update(self, obj, raw=False):
        self.updates.append((obj, raw))


def _capture_displays(monkeypatch):
    handles = []

    def display(obj, raw=False, display_id=None):
        assert raw and display_id is True  # a mimebundle under a display id, so that it can be replaced
        handles.append(_Handle(obj))
        return handles[-1]

    monkeypatch.setattr("IPython.display.display", display)
    return handles


def test_a_finished_widget_bar_is_replaced_in_place_by_its_last_line(monkeypatch):
    handles = _capture_displays(monkeypatch)
    bar = progress._widget_tqdm(notebook_tqdm)(range(3), desc="train")
    model_id = bar.container.model_id
    for _ in bar:
        pass
    (handle,) = handles
    view = handle.shown[WIDGET_VIEW]  # the widget while it runs
    assert view == {"version_major": 2, "version_minor": 0, "model_id": model_id}
    assert handle.shown["text/plain"].startswith("train:   0%|")  # where no widget can be shown: its text
    (update, raw), = handle.updates
    assert raw and update["text/plain"].startswith("train: 100%|")  # then its final state, as text, in its place
    assert bar.container.comm is None  # the widget is closed: nothing for a reopened notebook to miss


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class _Publisher:
    """The kernel's display publisher, recording the messages a front end would get."""

    def __init__(self):
        self.messages = []

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **_):
        self.messages.append({"data": data, "display_id": (transient or {}).get("display_id"), "update": update})


def _ipywidgets7_display(self, **kwargs):
    """ipywidgets 7.7.1's Widget._ipython_display_ (Colab's): it displays its own mimebundle, with no display id."""
    from IPython.display import display

    display({"text/plain": repr(self), WIDGET_VIEW: self.get_view_spec()}, raw=True)


@pytest.mark.parametrize("widgets", ["installed", "ipywidgets 7"])
def test_the_final_line_replaces_the_bar_s_own_output_under_ipywidgets_7_and_8(monkeypatch, widgets):
    """Through IPython's own display(), as in a kernel: the bar's output carries a display id, and close() updates
    that output. Under ipywidgets 7 display(widget, display_id=True) left the id off (the widget's
    _ipython_display_ displays itself), so the update went nowhere and the finished bar vanished."""
    import ipywidgets
    from IPython.core.formatters import DisplayFormatter
    from IPython.core.interactiveshell import InteractiveShell

    publisher = _Publisher()
    shell = types.SimpleNamespace(display_pub=publisher, display_formatter=DisplayFormatter())
    monkeypatch.setattr(InteractiveShell, "initialized", classmethod(lambda cls: True))
    monkeypatch.setattr(InteractiveShell, "instance", classmethod(lambda cls, *a, **k: shell))
    if widgets == "ipywidgets 7":
        monkeypatch.setattr(ipywidgets.Widget, "_repr_mimebundle_", None, raising=False)
        monkeypatch.setattr(ipywidgets.Widget, "_ipython_display_", _ipywidgets7_display, raising=False)
    bar = progress._widget_tqdm(notebook_tqdm)(range(4), desc="training")
    model_id = bar.container.model_id
    for _ in bar:
        pass
    shown, *rest = publisher.messages
    assert shown["display_id"] and not shown["update"]
    assert shown["data"][WIDGET_VIEW]["model_id"] == model_id
    assert [(m["display_id"], m["update"]) for m in rest] == [(shown["display_id"], True)], rest
    (final,) = rest[0]["data"].values()  # text only: the widget's view is gone from the output
    assert list(rest[0]["data"]) == ["text/plain"] and final.startswith("training: 100%|") and "| 4/4 [" in final


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
