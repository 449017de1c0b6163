"""Do two runs of the notebooks say the same things? (issue 40, item 5; issue 52, item 1)

    python scripts/verdicts.py RUN_A RUN_B [--out reports/verdicts.md] [--tolerance 0.10]

RUN_A and RUN_B are folders of executed notebooks (e.g. two `scripts/gpu_check.py --out-dir` runs under the Colab
emulation). Exit status: 0 no flip, 1 flips, 2 nothing compared (no notebook executed in both).

Two things are compared, code cell by code cell, in every printed output line except progress bars (tqdm's and
datasets' bars: a `%|`, `it/s`, `s/it`, `examples/s`, an elapsed-time bracket `[00:01<...` or `[00:00, ...`, and
datasets' `Generating train split: ...` / `Map: ...` lines):

- Words. A verdict is a line that judges: faster, slower, fits, trains, within the noise, lower, higher and the like.
  Numbers are masked (`#`) before comparing, so "x0.72, slower" and "x0.87, within the spread" differ (a flip) while
  "x0.72, slower" and "x0.69, slower" agree.
- Ratios. A ratio is printed "x0.69" or "0.69x", with or without a range after it: "x0.69 (x0.65-x0.80)",
  "x0.46 (x0.37-x0.55 between the middle halves of their steps)", "0.69x (0.65-0.80x)"; a range may also stand alone
  (a noise statement such as "run-to-run noise x0.97-x1.03"). A line's ratios are matched to the other run's by the
  line's text before its first ratio (numbers masked) and its place among the cell's lines of that text. Two ranges
  for the same ratio that do not overlap are a flip (both runs' lines are reported). A ratio without a range on
  either side is compared by its value: further apart than the tolerance (default 10 %: the larger over the smaller
  above 1.10) is a flip. A ratio printed in one run only, or a line with another number of ratios, is listed as
  unjudged (not a flip); in such a line the ratios that carry a range are still compared one for one when both runs
  printed as many of them ("x0.80 (x0.69-x1.03) within the noise (reference ran x1.11 apart)" against "x0.66
  (x0.55-x0.83) 34% fewer tokens/s": the two ranges are compared, the extra x1.11 is listed).

Notebook 01 (issue 52 item 2) prints no word per ratio: `helpers.speed_rounds` runs every config twice and prints
"ZeRO-2  x0.72 (x0.58-x0.90)  runs 13,481 and 13,745 tokens/s, 2% apart", then one line on the noise; two runs of it
agree when each row's ranges overlap.

The report lists every cell whose verdicts differ, every ratio flip with both runs' lines, and the unjudged ratios.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import nbformat

from course_shape import PROGRESS_BAR  # scripts/ is on the path: this script's folder

VERDICT = re.compile(r"\b(faster|slower|within (?:the )?(?:spread|noise)|no difference|fits?|does not fit|trains?|"
                     r"learns?|lower|higher|better|worse|refused|out of memory|falls|rises|beyond)\b", re.IGNORECASE)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
# a progress bar (tqdm: "63%|", "it/s", "s/it", an elapsed-time bracket; datasets: "examples/s", "Generating train
# split: 9851 examples [00:00, ...]", "Map: ...") is not a verdict, whatever words its description holds
# (course_shape.PROGRESS_BAR, what a reader skips, and the lines that only name what a bar is doing)
PROGRESS = re.compile(PROGRESS_BAR.pattern + r"|\[\d+:\d\d(?::\d\d)?\s*[<,]|"
                      r"^\s*(?:Generating \w+ split|Map(?: \(num_proc=\d+\))?|Filter|Saving the dataset)\b.*:")
# a ratio: "x0.69" or "0.69x" (decimals required: "micro-batch x2" is a name, not a ratio)
RATIO = re.compile(r"(?<![\w.])(?:x(\d+\.\d+)|(\d+\.\d+)x)(?![\w.])")
# a range: "x0.65-x0.80", "0.65-0.80x", "x0.65 to x0.80" (at least one `x`: "0.65-0.80" alone is not a ratio's)
RANGE = re.compile(r"(?<![\w.])(x?)(\d+\.\d+)(x?)\s*(?:-|–|to)\s*(x?)(\d+\.\d+)(x?)(?![\w.])")
TOLERANCE = 0.10


def masked(line: str) -> str:
    return " ".join(NUMBER.sub("#", line).split())


def is_progress(line: str) -> bool:
    return bool(PROGRESS.search(line))


def printed_lines(cell: nbformat.NotebookNode) -> list[str]:
    """A code cell's printed output lines, progress bars left out."""
    lines = []
    for o in cell.get("outputs", []):
        text = o.get("text", "") + o.get("data", {}).get("text/plain", "")
        lines += [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip() and not is_progress(ln)]
    return lines


def ratios(line: str) -> list[dict]:
    """The ratios a line prints, in order: {"value": float | None, "low": float | None, "high": float | None}.

    A range right after a ratio ("x0.69 (x0.65-x0.80", "x0.69, x0.65-x0.80") is that ratio's; a range with no ratio
    before it stands alone (value None)."""
    ranges = [m for m in RANGE.finditer(line) if any(m.group(g) for g in (1, 3, 4, 6))]
    inside = [(m.start(), m.end()) for m in ranges]
    found: list[tuple[int, dict]] = []
    taken: set[int] = set()
    for m in RATIO.finditer(line):
        if any(s <= m.start() < e for s, e in inside):
            continue
        item = {"value": float(m.group(1) or m.group(2)), "low": None, "high": None}
        for k, r in enumerate(ranges):
            if k not in taken and r.start() >= m.end() and re.fullmatch(r"[\s(,;:]*", line[m.end():r.start()]):
                item["low"], item["high"] = float(r.group(2)), float(r.group(5))
                taken.add(k)
                break
        found.append((m.start(), item))
    found += [(r.start(), {"value": None, "low": float(r.group(2)), "high": float(r.group(5))})
              for k, r in enumerate(ranges) if k not in taken]
    return [item for _, item in sorted(found, key=lambda f: f[0])]


def _ratio_key(line: str) -> str:
    """The line's text before its first ratio or range, numbers masked: what names the ratio."""
    starts = [m.start() for m in RATIO.finditer(line)] + [m.start() for m in RANGE.finditer(line)]
    return masked(line[:min(starts)]) if starts else masked(line)


def verdict_lines(path: Path) -> dict[int, list[str]]:
    """Code cell index -> its output lines that judge, numbers masked (progress bars left out)."""
    nb = nbformat.read(path, as_version=4)
    found: dict[int, list[str]] = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for line in printed_lines(cell):
            if VERDICT.search(line):
                found.setdefault(i, []).append(masked(line))
    return found


def ratio_lines(path: Path) -> dict[int, dict[tuple[str, int], tuple[str, list[dict]]]]:
    """Code cell index -> {(the line's key, its place among the cell's lines of that key): (line, its ratios)}."""
    nb = nbformat.read(path, as_version=4)
    found: dict[int, dict[tuple[str, int], tuple[str, list[dict]]]] = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        seen: Counter = Counter()
        for line in printed_lines(cell):
            items = ratios(line)
            if items:
                key = _ratio_key(line)
                found.setdefault(i, {})[(key, seen[key])] = (line.strip(), items)
                seen[key] += 1
    return found


def _text(item: dict) -> str:
    value = "" if item["value"] is None else f"x{item['value']:g}"
    spread = "" if item["low"] is None else f"(x{item['low']:g}-x{item['high']:g})"
    return " ".join(p for p in (value, spread) if p)


def judge(a: dict, b: dict, tolerance: float = TOLERANCE) -> str | None:
    """Why two runs' readings of one ratio disagree ('ranges do not overlap', 'values further apart than ...'), None
    where they agree; raises ValueError where they cannot be judged (a range alone on one side, a value on the other)."""
    if a["low"] is not None and b["low"] is not None:
        if a["high"] < b["low"] or b["high"] < a["low"]:
            return f"ranges do not overlap: {_text(a)} vs {_text(b)}"
        return None
    if a["value"] is None or b["value"] is None:
        raise ValueError("a range in one run, a ratio without one in the other")
    small, large = sorted((a["value"], b["value"]))
    if large == small or (small > 0 and large / small <= 1 + tolerance):
        return None
    return f"no range; values further apart than {tolerance:.0%}: {_text(a)} vs {_text(b)}"


def compare_ratios(a: Path, b: Path, tolerance: float = TOLERANCE) -> tuple[list[dict], list[dict]]:
    """(flips, unjudged) between two executed copies of one notebook: each a dict of cell, both lines and why."""
    ra, rb = ratio_lines(a), ratio_lines(b)
    flips, unjudged = [], []
    for cell in sorted(set(ra) | set(rb)):
        la, lb = ra.get(cell, {}), rb.get(cell, {})
        for key in sorted(set(la) | set(lb), key=lambda k: (k[1], k[0])):
            line_a, items_a = la.get(key, ("", []))
            line_b, items_b = lb.get(key, ("", []))
            row = {"cell": cell, "a": line_a or "(not printed)", "b": line_b or "(not printed)"}
            if not items_a or not items_b:
                unjudged.append(row | {"why": "printed in one run only"})
                continue
            pairs = list(zip(items_a, items_b))
            if len(items_a) != len(items_b):
                # e.g. "x0.80 (x0.69-x1.03) within the noise (reference ran x1.11 apart)" vs "x0.66 (x0.55-x0.83) 34%
                # fewer tokens/s": the ratios with a range, one for one, are still compared; the rest are listed
                ranged_a, ranged_b = ([x for x in items if x["low"] is not None] for items in (items_a, items_b))
                unjudged.append(row | {"why": f"{len(items_a)} ratios vs {len(items_b)}" + (
                    f"; the {len(ranged_a)} with a range compared" if ranged_a and len(ranged_a) == len(ranged_b)
                    else "")})
                if not ranged_a or len(ranged_a) != len(ranged_b):
                    continue
                pairs = list(zip(ranged_a, ranged_b))
            for x, y in pairs:
                try:
                    why = judge(x, y, tolerance)
                except ValueError as e:
                    unjudged.append(row | {"why": str(e)})
                    continue
                if why:
                    flips.append(row | {"why": why})
    return flips, unjudged


def compare(a: Path, b: Path, tolerance: float = TOLERANCE) -> dict[str, list[dict]]:
    """Notebook name -> the cells whose verdicts differ between folders `a` and `b`: per cell, both runs' verdict
    lines (`a`, `b`) and the ratio flips (`ratios`: both lines and why)."""
    return comparison(a, b, tolerance)[0]


def comparison(a: Path, b: Path, tolerance: float = TOLERANCE) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(flips, unjudged ratios), each by notebook name; see `compare`."""
    flips: dict[str, list[dict]] = {}
    unjudged: dict[str, list[dict]] = {}
    for path in sorted(a.glob("*.ipynb")):
        other = b / path.name
        if not other.exists():
            continue
        va, vb = verdict_lines(path), verdict_lines(other)
        ratio_flips, not_judged = compare_ratios(path, other, tolerance)
        if not_judged:
            unjudged[path.name] = not_judged
        for cell in sorted(set(va) | set(vb) | {f["cell"] for f in ratio_flips}):
            words_differ = sorted(va.get(cell, [])) != sorted(vb.get(cell, []))
            cell_ratios = [f for f in ratio_flips if f["cell"] == cell]
            if words_differ or cell_ratios:
                flips.setdefault(path.name, []).append({"cell": cell, "a": va.get(cell, []), "b": vb.get(cell, []),
                                                        "words_differ": words_differ, "ratios": cell_ratios})
    return flips, unjudged


def markdown(a: Path, b: Path, flips: dict[str, list[dict]], unjudged: dict[str, list[dict]] | None = None,
             tolerance: float = TOLERANCE) -> str:
    unjudged = unjudged or {}
    names = sorted(p.name for p in a.glob("*.ipynb") if (b / p.name).exists())
    lines = ["# Verdicts of two runs compared (issues 40, 52)", "",
             f"Run A: `{a}`; run B: `{b}`. `python scripts/verdicts.py A B`: every printed line that judges (faster, "
             "slower, fits, trains, ...), numbers masked, compared cell by cell; every printed ratio (`x0.69`, "
             "`0.69x`) too: two ranges of the same ratio that do not overlap are a flip, a ratio without a range "
             f"flips when the two runs' values are more than {tolerance:.0%} apart. Progress bars are left out.", "",
             "| notebook | cells whose verdicts differ | ratio flips | ratios unjudged |", "|---|---|---|---|"]
    lines += [f"| {n} | {len(flips.get(n, []))} | {sum(len(c['ratios']) for c in flips.get(n, []))} | "
              f"{len(unjudged.get(n, []))} |" for n in names]
    for name, cells in flips.items():
        lines += ["", f"## {name}"]
        for c in cells:
            lines += ["", f"cell {c['cell']}:"]
            if c.get("words_differ", True):
                lines += ["", "- A: " + (" / ".join(c["a"]) or "(no verdict)"),
                          "- B: " + (" / ".join(c["b"]) or "(no verdict)")]
            for r in c.get("ratios", []):
                lines += ["", f"- ratio flip ({r['why']})", f"  - A: {r['a']}", f"  - B: {r['b']}"]
    if unjudged:
        lines += ["", "## Ratios not judged"]
        for name, rows in unjudged.items():
            lines += [""] + [f"- {name}, cell {r['cell']} ({r['why']}): A `{r['a']}`; B `{r['b']}`" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="how far apart two runs' ratios printed without a range may be (0.10: 10 %%)")
    args = parser.parse_args(argv)
    flips, unjudged = comparison(args.run_a, args.run_b, args.tolerance)
    text = markdown(args.run_a, args.run_b, flips, unjudged, args.tolerance)
    if args.out:
        args.out.write_text(text)
    print(text)
    if not any((args.run_b / p.name).exists() for p in args.run_a.glob("*.ipynb")):
        print(f"no notebook executed in both {args.run_a} and {args.run_b}: nothing was compared", file=sys.stderr)
        return 2
    return 1 if flips else 0


if __name__ == "__main__":
    sys.exit(main())
