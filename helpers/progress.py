"""Progress bars (and the planner): widgets in a live notebook, plain output when a runner saves the notebook to be read.

A tqdm widget's state is not kept in a saved notebook: an executed copy showed `0/40` above a finished run. The
course's runners (scripts/run_notebooks.py and what imports it) set DS_COURSE_SAVED_RUN=1 for the kernels they
start, and every bar is then text, whose final state is saved with the outputs: the helpers' own bars, and the
notebooks' `from tqdm.auto import tqdm` (the bootstrap calls `text_progress_if_asked`).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Iterable

__all__ = ["SAVED_RUN_ENV", "progress_bar", "saved_run", "text_progress_if_asked"]

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


def _widget_tqdm(base: type) -> type:
    """`base` (tqdm.auto's class) whose notebook widget, once closed, leaves its last line as text instead.

    A widget's state is not saved with the notebook: a finished bar reopened without its kernel reads "Error
    displaying widget: model not found". Outside a notebook `base` is the text bar and nothing changes.
    """
    class ClosingToText(base):  # type: ignore[misc,valid-type]
        def close(self) -> None:
            container = getattr(self, "container", None)
            shown = container is not None and not self.disable and self.leave
            super().close()
            if shown:
                line = str(self)
                container.close()
                print(line)

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


def text_progress_if_asked() -> bool:
    """With DS_COURSE_SAVED_RUN set, make `from tqdm.auto import tqdm` give text bars on stdout; True if it did.

    Called by every notebook's bootstrap, before the notebook imports tqdm. Without the variable (Colab, a learner's
    Jupyter) nothing changes: the bars stay widgets.
    """
    if not saved_run():
        return False
    import tqdm.auto
    import tqdm.autonotebook

    tqdm.auto.tqdm = tqdm.autonotebook.tqdm = _text_tqdm()
    return True
