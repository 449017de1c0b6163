"""nbmake's pass, run the way a learner runs a notebook (issues 27 and 39).

    python -m pytest --nbmake -p tests.learner_habits notebooks/[0-9][0-9]_*.ipynb

nbmake collects each notebook as a test and reports a failure as it always does (the cell, its traceback). With this
plugin each notebook's one run in the test command is scripts/run_notebooks.py's `execute_with_habits`, in one kernel:

1. top to bottom, each cell tagged `heavy` (training, launching) interrupted after 3 s, as the stop button does, and
   run again;
2. a second pass in the same kernel: each heavy cell again, with the cells after it that read its results;
3. no DeepSpeed engine alive at the end, and the executed notebook reads clean (`hygiene_problems`: every figure
   shown, no stray Out[] value, no progress bar saved as a widget, none of the runner's noise).

Notebook 02, the one that meets the RAM wall, runs with its kernel inside a 3 GB memory cgroup where the machine
allows one (scripts/colab_emulation.py), and no process of it may be killed there.

So each notebook executes twice in the whole test command (the two passes above); the plain nbmake pass that used to
follow them repeated the first. Without `-p tests.learner_habits`, `pytest --nbmake` is plain nbmake (one pass).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# notebook 02 smoke-sized as a learner runs it peaked at ~2 GB (kernel + its largest child)
RAM_LIMIT_BYTES = {"02_zero3_offload_nvme.ipynb": int(3e9)}


def _scripts():
    if str(ROOT / "scripts") not in sys.path:  # plugins load before pytest's `pythonpath` setting applies
        sys.path.insert(0, str(ROOT / "scripts"))
    import colab_emulation
    import run_notebooks

    return colab_emulation, run_notebooks


def build_ops_outside() -> None:
    """DeepSpeed's JIT op builds (g++ on 2 cores) need more RAM than the smoke run itself: inside a 3 GB group they
    were killed on a fresh machine. Build them first, outside (the notebooks then load them from the cache):
    helpers.runtime.build_ops, which on CPU adds DeepSpeed's shm all-reduce and pin_memory ops."""
    import helpers

    helpers.runtime.build_ops("cpu_adam", "async_io")


def run_as_a_learner(path: Path, out_dir: Path, timeout_s: int = 1800) -> tuple[dict, list[str]]:
    """Run `path` with learner habits; returns the runner's dict and the problems found (empty: it passed)."""
    emu, runner = _scripts()
    limit = RAM_LIMIT_BYTES.get(path.name)
    mechanism, _ = emu.probe()
    problems: list[str] = []
    if limit and mechanism.startswith("cgroup"):
        build_ops_outside()
        result = emu.run_notebook(path, out_dir=out_dir, limits=emu.ColabLimits(ram_bytes=limit), habits=True,
                                  timeout_s=timeout_s)
        enc = result["enclosure"]
        if enc["mechanism"] != mechanism or enc["oom_kills"]:
            problems.append(f"in its {limit / 1e9:.0f} GB memory cgroup: {enc}")
        if not 0.3 < enc["peak_ram_gb"] <= limit / 1e9:
            problems.append(f"peak RAM {enc['peak_ram_gb']} GB: not inside (0.3, {limit / 1e9}] GB, the group's limit")
        if emu.leftover_groups():
            problems.append(f"memory cgroups left behind: {emu.leftover_groups()}")
    else:
        result = runner.execute_with_habits(path, out_dir=out_dir, timeout_s=timeout_s)
    if not result["passed"]:
        return result, [result["error"]]
    import nbformat

    problems += runner.hygiene_problems(nbformat.read(out_dir / path.name, as_version=4))
    log = result["log"]
    if not log or log[-1] != "live DeepSpeed engines: 0":
        problems.append(f"DeepSpeed engines alive at the end: {log[-1:] or 'no check ran'}")
    if not any("run again" in line for line in log):
        problems.append("no heavy cell was run again: tag training and launching cells `heavy`")
    return result, problems


def pytest_configure(config: pytest.Config) -> None:
    import nbmake.pytest_items as items
    from nbmake.nb_result import NotebookError, NotebookResult
    from nbmake.nb_run import NotebookRun

    class LearnerHabitsRun(NotebookRun):
        def execute(self) -> NotebookResult:
            import nbformat

            with tempfile.TemporaryDirectory(prefix="learner-habits-") as tmp:
                start = time.perf_counter()
                result, problems = run_as_a_learner(Path(self.filename), Path(tmp), timeout_s=self.default_timeout)
                out = Path(tmp) / Path(self.filename).name
                nb = nbformat.read(out if out.exists() else self.filename, as_version=4)
            seconds = time.perf_counter() - start
            print(f"{Path(self.filename).name}: {seconds:.0f} s as a learner runs it; " + "; ".join(result["log"]))
            if not problems:
                return NotebookResult(nb=nb, error=None)
            cell_error = self._get_error(nb) if not result["passed"] else None
            trace = "\n".join(problems)
            if cell_error is not None:
                return NotebookResult(nb=nb, error=NotebookError(summary=cell_error.summary,
                                                                 trace=cell_error.trace + "\n\n" + trace,
                                                                 failing_cell_index=cell_error.failing_cell_index))
            return NotebookResult(nb=nb, error=NotebookError(summary=problems[0].splitlines()[-1][:200], trace=trace,
                                                             failing_cell_index=-1))

    items.NotebookRun = LearnerHabitsRun


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Notebooks with the most heavy cells first: with pytest-xdist the longest should not start last."""
    import nbformat

    def heavy_cells(item: pytest.Item) -> int:
        if not getattr(item, "nbmake", False):
            return 0
        nb = nbformat.read(item.filename, as_version=4)
        return sum("heavy" in c.metadata.get("tags", []) for c in nb.cells)

    items.sort(key=heavy_cells, reverse=True)
