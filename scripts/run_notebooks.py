"""Execute course notebooks top to bottom (optionally twice in one kernel) and save them with outputs.

    python scripts/run_notebooks.py                      # every notebook, outputs into build/notebooks/
    python scripts/run_notebooks.py --twice notebooks/00_setup_and_ds_report.ipynb

Sizes follow the hardware: smoke-sized on CPU, full-sized on a GPU (T4 budget mode with
DS_COURSE_T4_BUDGET=1). Used by scripts/course.sh, tests/learner_habits.py (the test command's nbmake pass) and scripts/gpu_check.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def kernel_env() -> dict[str, str]:
    """The environment of a kernel started here: it saves its outputs to be read later, where a widget's state is
    lost, so progress bars are text and the planner a static rendering (helpers/progress.py)."""
    return {**os.environ, "DS_COURSE_SAVED_RUN": "1"}


# ipykernel warns once per kernel that it runs over TCP without encryption (on localhost, started by us): noise
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]


def save_executed(nb: nbformat.NotebookNode, path: Path) -> None:
    """Write an executed notebook as a reader sees it: each cell's consecutive stream outputs joined and every line a
    carriage return overwrote dropped (nbconvert's CoalesceStreamsPreprocessor), so a progress bar is saved as its
    final line, not as one output per refresh (notebook 03 had 1,809)."""
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor

    nb, _ = CoalesceStreamsPreprocessor().preprocess(nb, {})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def tidy_executed(path: Path, to: Path | None = None) -> None:
    """`save_executed` for a notebook file already written (nbmake's --overwrite copy), into `to` (default: itself)."""
    save_executed(nbformat.read(path, as_version=4), to or path)


def sync_markdown(executed: Path, source: Path) -> int:
    """Give an executed copy the markdown of the notebook it ran (a text edited after the run: an intro's T4 time
    from that very run), cell by cell; its code and outputs are kept. Refuses when the code cells differ (the copy
    would show outputs of other code). Returns how many markdown cells changed."""
    ran, now = nbformat.read(executed, as_version=4), nbformat.read(source, as_version=4)
    code = [c.source for c in ran.cells if c.cell_type == "code"]
    if code != [c.source for c in now.cells if c.cell_type == "code"] or len(ran.cells) != len(now.cells):
        raise ValueError(f"{executed} did not run {source}'s code: run it again (scripts/gpu_evidence.sh) instead")
    changed = 0
    for old, new in zip(ran.cells, now.cells):
        if old.cell_type == "markdown" and old.source != new.source:
            old.source = new.source
            changed += 1
    if changed:
        nbformat.write(ran, executed)
    return changed


def execute(path: Path, *, twice: bool = False, timeout_s: int = 1800, out_dir: Path | None = None,
            figures_file: Path | None = None, kernel_name: str = "python3",
            on_kernel_start: Callable[[int], None] | None = None) -> dict:
    """Run one notebook (twice in the same kernel if asked); returns {'passed', 'seconds', 'error'}.

    `kernel_name` picks the kernelspec (scripts/colab_emulation.py passes one whose kernel starts inside its
    limits); `on_kernel_start(pid)` is called with the kernel's process id once it runs.
    """
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("DS_COURSE_FIGURES")
    if figures_file is not None:
        figures_file.unlink(missing_ok=True)
        os.environ["DS_COURSE_FIGURES"] = str(figures_file)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(path.parent)}}, extra_arguments=KERNEL_ARGS)
    start = time.perf_counter()
    error = ""
    try:
        with client.setup_kernel(env=kernel_env()):
            if on_kernel_start is not None:
                on_kernel_start(_kernel_pid(client))
            for round_ in range(2 if twice else 1):
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type == "code":
                        client.execute_cell(cell, index)
    except Exception as exc:  # CellExecutionError carries the traceback text
        error = f"{type(exc).__name__}: {exc}"[-4000:]
    finally:
        if figures_file is not None:
            if env_before is None:
                os.environ.pop("DS_COURSE_FIGURES", None)
            else:
                os.environ["DS_COURSE_FIGURES"] = env_before
    seconds = time.perf_counter() - start
    if out_dir is not None:
        save_executed(nb, out_dir / path.name)
    return {"passed": not error, "seconds": round(seconds, 1), "error": error}


HABITS_CHECK = """
import helpers
_engines = helpers.runtime.live_engines()
print(f"live DeepSpeed engines: {len(_engines)}")
for _e in _engines:  # what still holds it, for the failure message (a closure cell: a hook; a dict: a namespace)
    import gc
    print("  held by", sorted({type(r).__name__ for r in gc.get_referrers(_e) if r is not _engines}),
          "module", type(getattr(_e, "module", None)).__name__, "optimizer", type(getattr(_e, "optimizer", None)).__name__)
assert not _engines, f"{len(_engines)} DeepSpeed engine(s) still alive at the end of the notebook"
del _engines
"""


def execute_with_habits(path: Path, *, interrupt_after_s: float = 3.0, timeout_s: int = 1800,
                        out_dir: Path | None = None, kernel_name: str = "python3",
                        on_kernel_start: Callable[[int], None] | None = None) -> dict:
    """Run a notebook as a learner does (tests/learner_habits.py); returns execute()'s dict + 'log'.

    1. Top to bottom, but each cell tagged `heavy` (training, launching) is interrupted after `interrupt_after_s`
       (SIGINT to the kernel, as the stop button does) and then run again.
    2. Then each heavy cell is run again on its own, followed by the cells after it up to the next heavy cell
       (those read its results): a second run of the notebook, segment by segment.
    3. Finally no DeepSpeed engine may be alive in the kernel.
    """
    import signal
    import threading

    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(path.parent)}}, extra_arguments=KERNEL_ARGS)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    heavy = [i for i in code if "heavy" in nb.cells[i].metadata.get("tags", [])]
    log: list[str] = []
    start = time.perf_counter()
    error = ""
    try:
        with client.setup_kernel(env=kernel_env()):
            pid = _kernel_pid(client)
            if on_kernel_start is not None:
                on_kernel_start(pid)
            for i in code:
                if i in heavy:
                    sent = threading.Event()

                    def interrupt(pid: int = pid, sent: threading.Event = sent) -> None:
                        os.kill(pid, signal.SIGINT)
                        sent.set()

                    timer = threading.Timer(interrupt_after_s, interrupt)
                    timer.start()
                    try:
                        client.execute_cell(nb.cells[i], i)
                        log.append(f"cell {i}: finished within {interrupt_after_s} s, not interrupted")
                    except CellExecutionError as exc:
                        timer.cancel()
                        if not sent.is_set():  # an error of the cell's own: no interrupt was sent
                            raise
                        # A SIGINT that lands inside native code can surface as that code's own error (safetensors'
                        # load_file raises "ValueError: could not determine the shape ..."): what a learner sees
                        # too. The cell must still work when run again, which the next line checks.
                        raised = "KeyboardInterrupt" if "KeyboardInterrupt" in str(exc) else exc.ename
                        log.append(f"cell {i}: interrupted after {interrupt_after_s} s (raised {raised}), run again")
                    finally:
                        timer.cancel()
                client.execute_cell(nb.cells[i], i)
            for n, h in enumerate(heavy):
                end = heavy[n + 1] if n + 1 < len(heavy) else len(nb.cells)
                segment = [i for i in code if h <= i < end]
                log.append(f"cells {segment}: run again")
                for i in segment:
                    client.execute_cell(nb.cells[i], i)
            check = nbformat.v4.new_code_cell(HABITS_CHECK)
            nb.cells.append(check)
            client.execute_cell(check, len(nb.cells) - 1)
            log.append("".join(o.get("text", "") for o in check.outputs).strip())
    except Exception as exc:  # CellExecutionError carries the traceback text
        error = f"{type(exc).__name__}: {exc}"[-4000:]
    if out_dir is not None:
        save_executed(nb, out_dir / path.name)
    return {"passed": not error, "seconds": round(time.perf_counter() - start, 1), "error": error, "log": log}


# output a learner should never read: developer targets, runner noise, setup noise
NOISE = ("NOT met", "not met)", "Kernel is running over TCP", "Failed to initialize NumPy", "GPU 0 has a total capacity")
PLOT_CALL = re.compile(r"^helpers\.plot_\w+\(", re.MULTILINE)  # a figure made at the top level of a cell


def hygiene_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What reads wrong in an executed notebook: a figure made but not shown, a stray Out[] value, a progress bar
    saved as a widget (its state is lost: it reads 0/40 above a finished run), noise."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        images = sum("image/png" in o.get("data", {}) for o in outputs)
        if len(PLOT_CALL.findall(cell.source)) > images:
            problems.append(f"cell {i}: {len(PLOT_CALL.findall(cell.source))} figure(s) made, {images} shown")
        for o in outputs:
            data = o.get("data", {})
            last = cell.source.strip().splitlines()[-1] if cell.source.strip() else ""
            if o.output_type == "execute_result" and set(data) == {"text/plain"} and last.startswith("helpers."):
                # a helper's return value nobody asked to see (a cell that ends with a dict to show it is fine)
                problems.append(f"cell {i}: stray Out[] value {data['text/plain'][:60]!r}")
            if "application/vnd.jupyter.widget-view+json" in data and "%|" in data.get("text/plain", ""):
                problems.append(f"cell {i}: a progress bar saved as a widget ({data['text/plain'][:40]!r})")
            text = o.get("text", "") + data.get("text/plain", "")
            problems += [f"cell {i}: prints {n!r}" for n in NOISE if n in text]
    return problems


def _kernel_pid(client: NotebookClient) -> int:
    """Process id of the client's kernel (jupyter_client's local provisioner)."""
    provisioner = getattr(client.km, "provisioner", None)
    process = getattr(provisioner, "process", None)
    return int(getattr(process, "pid", 0) or getattr(provisioner, "pid", 0) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--twice", action="store_true", help="run every cell twice in one kernel")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "build" / "notebooks")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    parser.add_argument("--tidy", action="store_true",
                        help="only rewrite the given executed notebooks as save_executed would, and stop")
    parser.add_argument("--markdown-from", type=Path, default=None,
                        help="only give the given executed notebooks the markdown of the same-named notebooks in "
                             "this folder (sync_markdown), and stop")
    args = parser.parse_args(argv)
    if args.tidy or args.markdown_from:
        for path in args.notebooks:
            if args.tidy:
                tidy_executed(path)
            if args.markdown_from:
                print(f"{path.name}: {sync_markdown(path, args.markdown_from / path.name)} markdown cell(s) updated")
        return 0
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    results = {}
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        results[path.name] = execute(path, twice=args.twice, timeout_s=args.timeout, out_dir=args.out_dir)
        r = results[path.name]
        print(f"  {'passed' if r['passed'] else 'FAILED'} in {r['seconds']} s", flush=True)
        if r["error"]:
            print(r["error"], file=sys.stderr)
    print(json.dumps({k: {"passed": v["passed"], "seconds": v["seconds"]} for k, v in results.items()}, indent=2))
    print(f"executed notebooks with outputs: {args.out_dir}")
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
