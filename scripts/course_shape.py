"""The shape of each notebook as a learner meets it (issue 40): how much there is to read on the main path, how much of
the code on the page is DeepSpeed's and how much the course's `helpers`, jargon on the main path, and how long the
saved outputs are.

    python scripts/course_shape.py            # notebooks/ and their executed copies in reports/executed/
    python scripts/course_shape.py --json     # the same as JSON
    python scripts/course_shape.py --time-line notebooks/drafts/01_*.ipynb   # the intro's full Time line, computed

The main path is every cell before the `## Going deeper` heading (the whole notebook where there is none). Words are
markdown words (code spans included, code cells not). Outputs are read from reports/executed/ (the GPU check's copies):
a printed output's lines, and progress bars saved as more than one line.

The time a learner spends reading (`reading_minutes`, the second half of an intro's `**Time:**` line, issue 52): the
main path's words at a stated speed, since the T4 estimate counts compute only. Markdown at 200 words a minute (a
careful pace for technical prose: adults read non-fiction at about 240, Brysbaert 2019), code at 100 (half that:
code is read token by token; a word is anything between spaces), printed outputs at 200 (text and tables a learner
reads for their verdict; progress bars and a folded output's hidden text are not read), and 15 seconds per figure.
Outputs are the executed copy's (reports/executed/, the GPU check's run) where there is one, cell by cell id; without
one, outputs are not counted.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
GOING_DEEPER = re.compile(r"^##\s+Going deeper", re.MULTILINE)
# internals a learner does not need on the main path (issue 40's list); each may appear once explained, in one line
JARGON = ("Psi", "roofline", "has_overflow", "stage3.py", "glibc", "mmap threshold", "cgroup", "enclosure",
          "step on host", "staging", "1F1B", "AutoEP")
# DeepSpeed's own API, as a learner would copy it into a project without helpers
DEEPSPEED_API = ("deepspeed.initialize", ".backward(", ".step(", "save_checkpoint", "load_checkpoint",
                 "zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint", "HfDeepSpeedConfig", "TiledMLP",
                 "TiledFusedLogitsLoss", "deepspeed.moe", "deepspeed.zero.Init", "offload_optimizer", "offload_param",
                 "DeepSpeedPlugin", "PipelineModule", "deepspeed.checkpointing")
HELPERS_CALL = re.compile(r"\bhelpers\.[A-Za-z_]\w*\(")
PROGRESS_LINE = re.compile(r"\d+%\|")
# state bookkeeping and records: at most one call of each kind per main-path cell (issue 40 item 2)
BOOKKEEPING = re.compile(r"\bhelpers\.(clean_slate|require|setup_single_process|reset_peak_stats)\(")
RECORDS = re.compile(r"\bhelpers\.record_figures?\(")
# the intro's time line: "**Time:** about 6-9 minutes on a Colab T4" (the part every check parses), and in full
# (issue 52): "**Time:** about 6-9 minutes on a Colab T4 to run (the GPU check's estimate, see the README), plus about
# 12 minutes to read" (the parenthesis may say more before its close, e.g. what the estimate leaves out)
TIME_LINE = re.compile(r"\*\*Time:\*\* about (\d+)-(\d+) minutes on a Colab T4")
FULL_TIME_LINE = re.compile(r"\*\*Time:\*\* about (\d+)-(\d+) minutes on a Colab T4 to run \(the GPU check's estimate, "
                            r"see the README[^)]*\), plus about (\d+) minutes? to read\b")
# a notebook the GPU check has not run yet (a new draft, no entry in reports/gpu_check.json) says so instead of a T4 time:
# "**Time:** not yet measured on a GPU (no GPU-check run of this notebook yet), plus about 12 minutes to read"
UNMEASURED_TIME_LINE = re.compile(r"\*\*Time:\*\* not yet measured on a GPU \(no GPU-check run of this notebook yet\), "
                                  r"plus about (\d+) minutes? to read\b")
# reading speeds (words a minute) and a figure's seconds: see the module's docstring
READING_WPM = {"markdown": 200, "code": 100, "outputs": 200}
FIGURE_SECONDS = 15
# what a reader does not read in a saved output: progress bars (tqdm's, datasets')
PROGRESS_BAR = re.compile(r"%\||(?:it/s|s/it|examples/s)\b")

# The budget a learner-shaped notebook keeps (issue 40). A notebook the edit has reached waits in notebooks/drafts/
# (held to the budget of its text and code) until its GPU run gives it an executed copy; it then replaces the one in
# notebooks/ and joins EDITED (held to the budget of its outputs too). docs/decisions.md ("Promoting drafts") says how.
MAX_MAIN_PATH_WORDS = 1300
MAX_OUTPUT_LINES = 25
EDITED: tuple[str, ...] = ("00_setup_and_ds_report.ipynb", "01_zero2_finetune_and_stages.ipynb",
                           "02_zero3_offload_nvme.ipynb", "03_mixture_of_experts.ipynb",
                           "04_hf_trainer_and_accelerate.ipynb", "05_scaling_out.ipynb", "06_long_context.ipynb",
                           "07_your_model_on_a_t4.ipynb")


def t4_minutes(estimate: dict) -> tuple[int, int]:
    """A report's T4 estimate (`low_s`, `high_s`) as the whole minutes an intro names: low rounded, high rounded up."""
    import math

    low = max(1, round(estimate["low_s"] / 60))
    return low, max(low + 1, math.ceil(estimate["high_s"] / 60))


def main_path(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    """The cells before `## Going deeper` (all of them where there is no such heading)."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and GOING_DEEPER.search(cell.source):
            return nb.cells[:i]
    return list(nb.cells)


def words(text: str) -> int:
    return len(re.findall(r"\S+", text))


def time_line(minutes: tuple[int, int] | None, read: int, caveat: str = "") -> str:
    """The intro's full `**Time:**` line (FULL_TIME_LINE), e.g. `time_line(t4_minutes(estimate), reading_minutes(p))`;
    `caveat` goes inside the parenthesis, after the README ("; plus the disk's own time ..."). `minutes` None: a
    notebook with no GPU-check entry yet (UNMEASURED_TIME_LINE)."""
    if minutes is None:
        return (f"**Time:** not yet measured on a GPU (no GPU-check run of this notebook yet), plus about {read} "
                f"minute{'s' if read != 1 else ''} to read")
    low, high = minutes
    return (f"**Time:** about {low}-{high} minutes on a Colab T4 to run (the GPU check's estimate, see the README"
            f"{caveat}), plus about {read} minute{'s' if read != 1 else ''} to read")


def reading_words(path: Path, executed: Path | None = None) -> dict:
    """What a learner reads on the main path: words of markdown, of code and of printed outputs, and the figures.

    `executed` defaults to reports/executed/<name> (the GPU check's copy) when it exists; outputs are taken from it
    for the main path's code cells by cell id."""
    nb = nbformat.read(path, as_version=4)
    main = main_path(nb)
    counts = {"markdown": sum(words(c.source) for c in main if c.cell_type == "markdown"),
              "code": sum(words(c.source) for c in main if c.cell_type == "code"), "outputs": 0, "figures": 0}
    if executed is None:
        executed = ROOT / "reports" / "executed" / path.name
    if not executed.exists():
        return counts
    ids = {c.get("id") for c in main if c.cell_type == "code"}
    for cell in nbformat.read(executed, as_version=4).cells:
        if cell.cell_type != "code" or cell.get("id") not in ids:
            continue
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if any(k.startswith("image/") for k in data):
                counts["figures"] += 1
                continue
            text = o.get("text", "") + data.get("text/plain", "")
            counts["outputs"] += sum(words(ln) for ln in text.replace("\r", "\n").splitlines()
                                     if not PROGRESS_BAR.search(ln))
    return counts


def reading_time(path: Path, executed: Path | None = None) -> float:
    """Minutes to read the main path (module docstring: the speeds and what counts)."""
    c = reading_words(path, executed)
    return sum(c[k] / wpm for k, wpm in READING_WPM.items()) + c["figures"] * FIGURE_SECONDS / 60


def reading_minutes(path: Path, executed: Path | None = None) -> int:
    """`reading_time` in whole minutes (rounded, at least 1): the R of an intro's "plus about R minutes to read"."""
    return max(1, round(reading_time(path, executed)))


def shape(path: Path, executed: Path | None = None) -> dict:
    nb = nbformat.read(path, as_version=4)
    main = main_path(nb)
    md = [c.source for c in main if c.cell_type == "markdown"]
    code = [c.source for c in main if c.cell_type == "code"]
    all_code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    text = "\n".join(md)
    row = {"notebook": path.name, "cells": len(nb.cells), "main_path_cells": len(main),
           "main_path_words": words(text), "longest_markdown_cell_words": max((words(m) for m in md), default=0),
           "has_going_deeper": len(main) < len(nb.cells),
           "helpers_calls_main_path": sum(len(HELPERS_CALL.findall(c)) for c in code),
           "helpers_calls": len(HELPERS_CALL.findall(all_code)),
           "deepspeed_api_main_path": {a: n for a in DEEPSPEED_API if (n := "\n".join(code).count(a))},
           "jargon_main_path": {j: n for j in JARGON if (n := len(re.findall(rf"\b{re.escape(j)}", text)))},
           "code_lines_main_path": sum(len(c.strip().splitlines()) for c in code),
           "max_bookkeeping_calls_per_cell": max((len(BOOKKEEPING.findall(c)) for c in code), default=0),
           "max_record_calls_per_cell": max((len(RECORDS.findall(c)) for c in code), default=0),
           "sections_before_going_deeper": [h for h in ("## Summary", "## Exercises") if h in text],
           "time_line": [int(x) for x in m.groups()] if (m := TIME_LINE.search(text)) else None,
           "full_time_line": [int(x) for x in m.groups()] if (m := FULL_TIME_LINE.search(text)) else None,
           "unmeasured_time_line": int(m.group(1)) if (m := UNMEASURED_TIME_LINE.search(text)) else None}
    if executed is not None and executed.exists():
        ex = nbformat.read(executed, as_version=4)
        longest, longest_main, bars, outputs = 0, 0, 0, 0
        main_ids = {c.get("id") for c in main}
        for cell in ex.cells:
            if cell.cell_type != "code":
                continue
            for o in cell.get("outputs", []):
                outputs += 1
                out = o.get("text", "") + o.get("data", {}).get("text/plain", "")
                lines = [ln for ln in out.replace("\r", "\n").splitlines() if ln.strip()]
                printed = sum(not PROGRESS_LINE.search(ln) for ln in lines)
                longest = max(longest, printed)
                if cell.get("id") in main_ids:
                    longest_main = max(longest_main, printed)
                # a bar saved as more than its final line: its refreshes kept behind carriage returns (what
                # run_notebooks.save_executed folds away)
                bars += out.count("\r")
        row.update({"saved_outputs": outputs, "longest_printed_output_lines": longest,
                    "longest_main_path_output_lines": longest_main, "extra_progress_bar_lines": bars})
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| notebook | main-path words | longest md cell | helpers calls (main / all) | DeepSpeed API on the page "
             "| jargon on the main path | saved outputs | longest output (lines) | reading (min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        api = ", ".join(f"{a.strip('.(')} {n}" for a, n in r["deepspeed_api_main_path"].items()) or "-"
        jargon = ", ".join(f"{j} {n}" for j, n in r["jargon_main_path"].items()) or "-"
        lines.append(f"| {r['notebook']} | {r['main_path_words']} | {r['longest_markdown_cell_words']} | "
                     f"{r['helpers_calls_main_path']} / {r['helpers_calls']} | {api} | {jargon} | "
                     f"{r.get('saved_outputs', '-')} | {r.get('longest_printed_output_lines', '-')} | "
                     f"{r.get('reading_minutes', '-')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--time-line", action="store_true",
                        help="print each notebook's full **Time:** line (T4 minutes from reports/gpu_check.json)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if args.time_line:
        report = json.loads((ROOT / "reports" / "gpu_check.json").read_text())["notebooks"]
        for p in paths:
            minutes = t4_minutes(report[p.name]["t4_estimate"]) if p.name in report else None  # None: not run yet
            print(f"{p}: {time_line(minutes, reading_minutes(p))}")
        return 0
    rows = [shape(p, ROOT / "reports" / "executed" / p.name) | {"reading_minutes": round(reading_time(p), 1)}
            for p in paths]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
