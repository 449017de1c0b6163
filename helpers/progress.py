"""Progress bars (and the planner): widgets in a live notebook, plain output when a runner saves the notebook to be read.

A tqdm widget's state is not kept in a saved notebook: an executed copy showed `0/40` above a finished run. The
course's runners (scripts/run_notebooks.py and what imports it) set DS_COURSE_SAVED_RUN=1 for the kernels they
start, and every bar is then text, whose final state is saved with the outputs: the helpers' own bars, and the
notebooks' `from tqdm.auto import tqdm` (the bootstrap calls `course_progress_bars`).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable

__all__ = []

SAVED_RUN_ENV = "DS_COURSE_SAVED_RUN"


def saved_run() -> bool:
    """True when a runner executes the notebook to save its outputs (DS_COURSE_SAVED_RUN): widgets would be lost."""
    return bool(os.environ.get(SAVED_RUN_ENV))


def _text_tqdm() -> type:
    """tqdm's text bar, on stdout (not the red stderr stream) and in ASCII: the bar of a saved run."""
    from tqdm.std import tqdm as std_tqdm

    class TextTqdm(std_tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("file", sys.stdout)
            kwargs.setdefault("ascii", True)
            super().__init__(*args, **kwargs)

    return TextTqdm


def _widget_bundle(widget: Any) -> dict[str, Any]:
    """What ipywidgets 7 (`Widget._ipython_display_`) and 8 (`Widget._repr_mimebundle_`) both display for `widget`:
    its view (the same `version_major` 2 / `version_minor` 0 and model id in both, `get_view_spec`) and its repr,
    cut at 110 characters as they cut it, as the text shown where no widget can be (a tqdm bar's repr is its text)."""
    text = repr(widget)
    return {"text/plain": text if len(text) <= 110 else text[:110] + "\u2026",
            "application/vnd.jupyter.widget-view+json": widget.get_view_spec()}


def _widget_tqdm(base: type) -> type:
    """`base` (tqdm.auto's class) whose notebook widget becomes its last line of text, in place, once closed.

    A widget's state is not saved with the notebook: a finished bar reopened without its kernel read "Error
    displaying widget: model not found". The bar is displayed under a display id and, on close, that output is
    replaced by the bar's final text (closing the widget alone leaves its output, which is what fails on reopen).
    The widget's mimebundle is displayed here (`_widget_bundle`), not the widget: ipywidgets 7 (Colab's 7.7.1)
    displays a widget from its `_ipython_display_`, which ignores `display_id`, so the update replaced nothing and
    the finished bar vanished (its saved output read `0%`). Outside a notebook `base` is the text bar and is
    returned as it is.
    """
    from tqdm.notebook import tqdm as notebook_tqdm

    if not issubclass(base, notebook_tqdm) or getattr(base, "closes_to_text", False):
        return base  # a text bar, or already this class (the bootstrap ran twice)

    class ClosingToText(base):  # type: ignore[misc,valid-type]
        closes_to_text = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["display"] = False
            super().__init__(*args, **kwargs)
            self._handle = None
            if not self.disable:
                from IPython.display import display

                self._handle = display(_widget_bundle(self.container), raw=True, display_id=True)
                self.displayed = True  # tqdm's `delay` would display the widget again, without the display id

        def close(self) -> None:
            handle, self._handle = getattr(self, "_handle", None), None
            super().close()
            if handle is not None:
                handle.update({"text/plain": str(self) if self.leave else ""}, raw=True)
                self.container.close()

    return ClosingToText


def progress_bar(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str | None = None,
                 disable: bool = False, leave: bool = True) -> Any:
    """A tqdm bar (notebooks 00-05 through `train_run`, `train_in_fresh_process`, the Accelerate driver).

    In a live notebook it is a widget while it runs and a line of text once closed (`_widget_tqdm`).
    """
    if saved_run():
        tqdm = _text_tqdm()
    else:
        from tqdm.auto import tqdm as auto

        tqdm = _widget_tqdm(auto)
    return tqdm(iterable, total=total, desc=desc, disable=disable, leave=leave)


def course_progress_bars() -> str:
    """Make the notebooks' own `from tqdm.auto import tqdm` behave as `progress_bar`; returns "text" or "widget".

    Called by every notebook's bootstrap, before the notebook imports tqdm. A runner saving the executed notebook
    (DS_COURSE_SAVED_RUN) gets text bars on stdout; a live notebook keeps widget bars, which become their last line of
    text once closed (`_widget_tqdm`), so a reopened notebook shows no "Error displaying widget". Outside a notebook
    tqdm.auto is the text bar already and is left alone.
    """
    import tqdm.auto
    import tqdm.autonotebook

    if saved_run():
        tqdm.auto.tqdm = tqdm.autonotebook.tqdm = _text_tqdm()
        return "text"
    bar = _widget_tqdm(tqdm.auto.tqdm)
    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = bar
    return "widget" if getattr(bar, "closes_to_text", False) else "text"
