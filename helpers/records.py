"""Figures a notebook measured, collected for the GPU check and the reports (notebooks 00-05), and reading
committed reports' rows whatever their age.

`record_figure("peak_vram_gib", 2.9)` keeps the value in this kernel and, when the environment
variable DS_COURSE_FIGURES names a JSON file (scripts/gpu_check.py sets it), writes it there too.
`report_gb(row, "peak_rss")` reads a report row's host RAM or disk figure in GB (rows written before
issue 14 hold it in GiB as `peak_rss_gib`).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers.atomic import write_atomically

__all__ = ["record_figure", "record_figures", "report_gb", "report_for_learners"]

FIGURES_ENV = "DS_COURSE_FIGURES"
_FIGURES: dict[str, Any] = {}


def _plain(value: Any) -> Any:
    """`value` with numpy / torch scalars and arrays turned into Python numbers and lists (what json writes)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "ndim") and hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()  # a numpy scalar or array, a torch tensor (0-d: a number)
    return value


def record_figure(name: str, value: Any) -> None:
    """Remember a measured figure (JSON-serialisable) under `name`; numpy and torch numbers (`np.float32(1.5)`, a
    0-d tensor) and arrays are kept as Python numbers and lists (notebook 00).

    Returns nothing, so a notebook cell that ends with it shows no stray `Out[]` value."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a figure's name must be a non-empty str (got {name!r}). "
                         "Fix: record_figure('peak_vram_gib', value).")
    value = _plain(value)
    try:
        json.dumps(value)  # fail here, not in the report writer
    except (TypeError, ValueError) as exc:
        raise TypeError(f"record_figure({name!r}, ...) keeps numbers, strings, lists and dicts of them for the "
                         f"reports; got {type(value).__name__} ({exc}). Fix: record_figure({name!r}, float(value)) "
                         "for a number, or a dict / list of numbers.") from None
    _FIGURES[name] = value
    target = os.environ.get(FIGURES_ENV)
    if target:
        path = Path(target)
        data = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        data[name] = value
        text = json.dumps(data, indent=2)
        write_atomically(path, lambda tmp: tmp.write_text(text))


def record_figures(**figures: Any) -> None:
    """`record_figure` for several at once, one call at the end of a notebook cell (notebook 00):
    ``helpers.record_figures(tiny_loss_first=0.98, tiny_loss_last=0.12)``."""
    for name, value in figures.items():
        record_figure(name, value)


def recorded_figures() -> dict[str, Any]:
    """A copy of every figure recorded in this kernel."""
    return dict(_FIGURES)


def report_gb(row: dict[str, Any], name: str) -> float:
    """`row[name + "_gb"]`, or the older `row[name + "_gib"]` converted to GB (1e9 bytes); 0.0 without either
    (notebook 02).

    Host RAM and disk are recorded in GB, the unit of their budgets; reports committed before that used GiB.
    """
    if f"{name}_gb" in row:
        return float(row[f"{name}_gb"])
    return float(row.get(f"{name}_gib", 0.0)) * 2**30 / 1e9


def report_for_learners(markdown: str) -> str:
    """A committed benchmark report (reports/*.md) as a notebook prints it: the measurements, without the project's
    own targets ("(target >= 0.9: NOT met)"), which are for the course's developers, and with torch's out-of-memory
    text cut to what was asked for (it describes the whole 139.8 GiB GPU the budget was emulated on; notebooks 01, 02).
    """
    import re

    markdown = re.sub(r"CUDA out of memory(?:: CUDA out of memory)?\. Tried to allocate ([\d.]+ [KMGT]?i?B)\.[^|\n]*",
                      r"CUDA out of memory: tried to allocate \1 ", markdown)
    target = r"target [<>]=? ?[\d.]+%?: (?:NOT )?met"
    return re.sub(r"; " + target, "", re.sub(r" \(" + target + r"\)", "", markdown))
