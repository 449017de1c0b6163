"""Write the course's bootstrap cell (helpers.bootstrap.BOOTSTRAP_CELL) into notebooks, and trim their imports cell.

    python scripts/apply_bootstrap.py                 # every notebooks/NN_*.ipynb
    python scripts/apply_bootstrap.py --dry-run notebooks/02_zero3_offload_nvme.ipynb

In each notebook the bootstrap cell is the code cell that defines COURSE_REPO (the first code cell, or the first
after cells that do not use the course, as notebook 00's nvidia-smi cell): its text is replaced, its id and tags are
kept. In the code cell right after it (the imports cell), the lines `helpers.start_notebook()` now does are removed:
`%matplotlib inline`, `import helpers`, warnings filters, `helpers.runtime.warm_up_deepspeed()`, `runtime =
helpers.detect_runtime()`, `print(runtime)` and the torch/deepspeed version print. Outputs stay stripped. Prints what
changed and the names the old cells defined that later cells still use and the new ones no longer define.
Running it again changes nothing.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import nbformat

from helpers.bootstrap import BOOTSTRAP_CELL

ROOT = Path(__file__).resolve().parent.parent
# lines of the old imports cell that start_notebook() does now (a trailing comment-only line continues one)
DONE_BY_START = [
    re.compile(r"^%matplotlib inline\s*$"),
    re.compile(r"^import helpers\s*$"),
    re.compile(r"^warnings\.filterwarnings\(.*\)\s*$"),
    re.compile(r"^helpers\.warm_up_deepspeed\(\).*$"),
    re.compile(r"^runtime = helpers\.detect_runtime\(\)\s*$"),
    re.compile(r"^print\(runtime\)\s*$"),
    re.compile(r'^print\("torch", torch\.__version__, "\| deepspeed", deepspeed\.__version__\)\s*$'),
]
# what the new bootstrap cell defines in the notebook (start_notebook's own names stay inside helpers)
NEW_NAMES = {"os", "sys", "subprocess", "pathlib", "COURSE_REPO", "COURSE_ROOT", "helpers"}


def python_of(source: str) -> str:
    """A cell's source without IPython magics and shell lines, for ast."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def defined_names(source: str) -> set[str]:
    """Names a cell binds at top level (imports, assignments, defs)."""
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def used_names(source: str) -> set[str]:
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return set(re.findall(r"\b[A-Za-z_]\w*\b", source))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def trim_imports(source: str) -> str:
    """The imports cell without what start_notebook() does; an unused `warnings` import goes too."""
    out: list[str] = []
    dropped_previous = False
    for line in source.splitlines():
        if any(p.match(line) for p in DONE_BY_START):
            dropped_previous = True
            continue
        if dropped_previous and line.startswith(" ") and line.strip().startswith("#"):
            continue  # the comment continuing a removed line
        dropped_previous = False
        out.append(line)
    text = "\n".join(out)
    if "warnings." not in text:
        text = re.sub(r"^(import .*?)\bwarnings, |^(import .*?), warnings\b", lambda m: m.group(1) or m.group(2),
                      text, flags=re.M)
        text = re.sub(r"^import warnings\n", "", text, flags=re.M)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text


def apply(path: Path, *, write: bool = True) -> list[str]:
    """Put BOOTSTRAP_CELL into the notebook at `path`; returns lines describing what changed."""
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    boot = [i for i in code if "COURSE_REPO = " in nb.cells[i].source]
    if len(boot) != 1:
        raise SystemExit(f"{path.name}: expected one code cell defining COURSE_REPO, found {len(boot)}")
    b = boot[0]
    report: list[str] = []
    old_defined = defined_names(nb.cells[b].source)
    if nb.cells[b].source != BOOTSTRAP_CELL:
        nb.cells[b].source = BOOTSTRAP_CELL
        report.append(f"bootstrap cell {nb.cells[b].get('id')} replaced")
    after = [i for i in code if i > b]
    if after:
        imp = nb.cells[after[0]]
        is_imports = "parameters" not in imp.metadata.get("tags", []) and re.search(r"^import ", imp.source, re.M)
        if is_imports:
            trimmed = trim_imports(imp.source)
            if trimmed != imp.source:
                old_defined |= defined_names(imp.source) - defined_names(trimmed)
                report.append(f"imports cell {imp.get('id')} trimmed to:\n    " + trimmed.replace("\n", "\n    "))
                imp.source = trimmed
    later = set().union(*(used_names(nb.cells[i].source) for i in after)) if after else set()
    later_defined = set().union(*(defined_names(nb.cells[i].source) for i in after)) if after else set()
    gone = sorted((old_defined - NEW_NAMES - later_defined) & later)
    if gone:
        report.append("names the old cells defined, later cells use, and nothing defines now: " + ", ".join(gone))
    for c in nb.cells:  # outputs stay stripped
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    if write and report:
        nbformat.write(nb, path)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for path in paths:
        report = apply(path, write=not args.dry_run)
        print(f"{path.name}: " + ("\n  ".join(report) if report else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
