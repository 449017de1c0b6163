"""Do two runs of the notebooks say the same things? (issue 40, item 5)

    python scripts/verdicts.py RUN_A RUN_B [--out reports/verdicts.md]

RUN_A and RUN_B are folders of executed notebooks (e.g. two `scripts/gpu_check.py --out-dir` runs under the Colab
emulation). A verdict is an output line that judges: faster, slower, fits, trains, within the noise, lower, higher and
the like. Numbers are masked (`#`) before comparing, so "x0.72, slower" and "x0.87, within the spread" differ (a flip)
while "x0.72, slower" and "x0.69, slower" agree. Each code cell's verdicts are compared between the two runs; the
report lists every cell whose verdicts differ, with both runs' lines.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

VERDICT = re.compile(r"\b(faster|slower|within (?:the )?(?:spread|noise)|no difference|fits?|does not fit|trains?|"
                     r"learns?|lower|higher|better|worse|refused|out of memory|falls|rises|beyond)\b", re.IGNORECASE)
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
PROGRESS = re.compile(r"\d+%\|")


def masked(line: str) -> str:
    return " ".join(NUMBER.sub("#", line).split())


def verdict_lines(path: Path) -> dict[int, list[str]]:
    """Code cell index -> its output lines that judge, numbers masked (progress bars left out)."""
    nb = nbformat.read(path, as_version=4)
    found: dict[int, list[str]] = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for o in cell.get("outputs", []):
            text = o.get("text", "") + o.get("data", {}).get("text/plain", "")
            for line in text.replace("\r", "\n").splitlines():
                if VERDICT.search(line) and not PROGRESS.search(line):
                    found.setdefault(i, []).append(masked(line))
    return found


def compare(a: Path, b: Path) -> dict[str, list[dict]]:
    """Notebook name -> the cells whose verdicts differ between folders `a` and `b` (both runs' lines)."""
    flips: dict[str, list[dict]] = {}
    for path in sorted(a.glob("*.ipynb")):
        other = b / path.name
        if not other.exists():
            continue
        va, vb = verdict_lines(path), verdict_lines(other)
        for cell in sorted(set(va) | set(vb)):
            if sorted(va.get(cell, [])) != sorted(vb.get(cell, [])):
                flips.setdefault(path.name, []).append({"cell": cell, "a": va.get(cell, []), "b": vb.get(cell, [])})
    return flips


def markdown(a: Path, b: Path, flips: dict[str, list[dict]]) -> str:
    names = sorted(p.name for p in a.glob("*.ipynb") if (b / p.name).exists())
    lines = ["# Verdicts of two runs compared (issue 40)", "",
             f"Run A: `{a}`; run B: `{b}`. `python scripts/verdicts.py A B`: every output line that judges (faster, "
             "slower, fits, trains, ...), numbers masked, compared cell by cell.", "",
             "| notebook | cells whose verdicts differ |", "|---|---|"]
    lines += [f"| {n} | {len(flips.get(n, []))} |" for n in names]
    for name, cells in flips.items():
        lines += ["", f"## {name}"]
        for c in cells:
            lines += ["", f"cell {c['cell']}:", "", "- A: " + (" / ".join(c["a"]) or "(no verdict)"),
                      "- B: " + (" / ".join(c["b"]) or "(no verdict)")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    flips = compare(args.run_a, args.run_b)
    text = markdown(args.run_a, args.run_b, flips)
    if args.out:
        args.out.write_text(text)
    print(text)
    if not any((args.run_b / p.name).exists() for p in args.run_a.glob("*.ipynb")):
        print(f"no notebook executed in both {args.run_a} and {args.run_b}: nothing was compared", file=sys.stderr)
        return 2
    return 1 if flips else 0


if __name__ == "__main__":
    sys.exit(main())
