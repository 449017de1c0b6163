"""The course's promises about itself: README commands, CI, notebook hygiene, one repository address."""
import json
import re

import nbformat

from conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# a notebook written but not yet run on the GPU machine (no executed copy, no README row yet): the same form
DRAFTS = sorted((ROOT / "notebooks" / "drafts").glob("[0-9][0-9]_*.ipynb"))
README = (ROOT / "README.md").read_text()
COURSE_COMMAND = "bash scripts/course.sh"
TEST_COMMAND = "bash scripts/test.sh"


def test_readme_gives_exactly_the_two_commands():
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", README, flags=re.S)
    commands = [line.strip() for b in blocks for line in b.splitlines()
                if line.strip() and not line.strip().startswith("#")]
    assert COURSE_COMMAND in commands and TEST_COMMAND in commands
    assert len([c for c in commands if c.startswith("bash scripts/")]) == 2


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert TEST_COMMAND in ci


def test_readme_lists_every_notebook_with_a_colab_badge():
    assert NOTEBOOKS
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.name}" in README, nb.name
        assert re.search(r"colab\.research\.google\.com/github/[^)]*" + re.escape(nb.name), README), nb.name


def test_notebooks_are_stripped_and_have_one_parameters_cell():
    for path in NOTEBOOKS + DRAFTS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name}: strip outputs"
        assert "colab" not in nb.metadata and "widgets" not in nb.metadata, f"{path.name}: Colab metadata"
        tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
        text = "\n".join(c.source for c in nb.cells)
        assert "## Summary" in text and "## Exercises" in text and "You will learn" in text, path.name


def test_one_repository_address_everywhere():
    addresses = set()
    for path in NOTEBOOKS + DRAFTS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            addresses.update(re.findall(r'COURSE_REPO = "([^"]+)"', "".join(cell["source"])))
    assert len(addresses) == 1, addresses
    (repo,) = addresses
    owner_name = repo.removeprefix("https://github.com/")
    assert f"colab.research.google.com/github/{owner_name}/blob/main/notebooks/" in README
    assert repo in README


def test_requirements_never_reinstall_torch():
    reqs = (ROOT / "requirements.txt").read_text().splitlines()
    assert not [r for r in reqs if re.match(r"^\s*torch\b", r)], "Colab ships torch; never list it"
    from helpers.overflow_check import CHECKED_DEEPSPEED

    assert f"deepspeed=={CHECKED_DEEPSPEED}" in reqs


def test_readme_gpu_times_are_the_reports_and_link_the_executed_copies():
    """The README's GPU-time column is reports/gpu_check.json's emulated run, and each executed copy is committed."""
    import json
    import re

    report = json.loads((ROOT / "reports" / "gpu_check.json").read_text())
    assert report["emulation"]["mechanism"].startswith("cgroup") and report["emulation"]["cpus"] == 2
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        entry = report["notebooks"][path.name]
        assert entry["passed"] and entry["oom_kills"] == 0, path.name
        link = f"[{entry['wall_seconds']:.0f} s, peak RAM {entry['peak_ram_gb']:.1f} GB](reports/executed/{path.name})"
        assert link in readme, link
        executed = ROOT / "reports" / "executed" / path.name
        assert executed.exists() and re.search(r'"image/png"', executed.read_text()), path.name


def test_executed_copies_are_the_current_notebooks():
    """reports/executed/ is what the README links as each notebook's run: its code cells must be the notebook's own
    (a copy left from an older notebook shows outputs of code that no longer exists). Regenerate with
    scripts/gpu_evidence.sh on the GPU machine when a notebook's code changes."""
    for path in NOTEBOOKS:
        code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        copy = nbformat.read(ROOT / "reports" / "executed" / path.name, as_version=4)
        ran = [c.source for c in copy.cells if c.cell_type == "code"]
        assert ran == code, (f"reports/executed/{path.name} is not the current notebook: {len(ran)} code cells vs "
                             f"{len(code)}, first difference at code cell "
                             f"{next((i for i, (a, b) in enumerate(zip(ran, code)) if a != b), min(len(ran), len(code)))}")


# library log lines a learner read ten times per notebook (issue 22), now filtered by helpers.bootstrap.quiet_warnings
LIBRARY_NOISE = ("Attempting to get learning rate from scheduler before it has started",
                 "`loss_type=None` was set in the config but it is unrecognised",
                 "`loss_type=None` was set in the config but it is unrecognized",
                 "pytorch allocator cache flushes since last step")


def test_executed_copies_carry_no_library_noise():
    """The GPU runs' executed copies (what the README links) print none of the library lines quiet_warnings drops."""
    for path in NOTEBOOKS:
        text = (ROOT / "reports" / "executed" / path.name).read_text()
        found = [n for n in LIBRARY_NOISE if n in text]
        assert not found, (path.name, found)


def test_smoke_size_colab_values_are_the_parameters_cells():
    """helpers.smoke_size(globals(), runtime, NAME=(colab, cpu)) shrinks NAME only while it holds its Colab value:
    that value must be the parameters cell's, or an untouched parameter would count as the learner's own. Both
    values pass smoke_size's check of a parameter's kind (issue 41), or an untouched notebook would be refused."""
    import ast

    from helpers.hardware import _check_parameter

    checked = 0
    for path in NOTEBOOKS + DRAFTS:
        nb = nbformat.read(path, as_version=4)
        params_cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        params: dict = {}
        exec(params_cell.source, {}, params)
        for cell in nb.cells:
            if cell.cell_type != "code" or "smoke_size(" not in cell.source:
                continue
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "smoke_size":
                    for kw in node.keywords:
                        colab_value, cpu_value = ast.literal_eval(kw.value)
                        assert params[kw.arg] == colab_value, (path.name, kw.arg, params[kw.arg], colab_value)
                        for value in (colab_value, cpu_value):  # smoke_size's check of a value's kind takes both
                            _check_parameter(kw.arg, value, colab_value, cpu_value)
                        checked += 1
    assert checked >= 20


# ------------------------------------------------------------------ one notebook bootstrap

def test_every_notebook_opens_with_the_one_bootstrap_cell():
    """The bootstrap cell is helpers.bootstrap.BOOTSTRAP_CELL word for word (scripts/apply_bootstrap.py writes it),
    before the parameters cell and before any code cell that uses the course."""
    from helpers.bootstrap import BOOTSTRAP_CELL

    assert len(NOTEBOOKS) == 8
    for path in NOTEBOOKS + DRAFTS:
        cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        boot = [i for i, c in enumerate(cells) if c.source == BOOTSTRAP_CELL]
        assert len(boot) == 1, f"{path.name}: run python scripts/apply_bootstrap.py {path.relative_to(ROOT)}"
        before = [c.source for c in cells[:boot[0]]]
        assert not [s for s in before if "helpers" in s or "COURSE_ROOT" in s], f"{path.name}: course code before it"
        params = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
        assert params > boot[0], f"{path.name}: the parameters cell must come after the bootstrap cell"


def test_apply_bootstrap_rewrites_an_old_notebook_once_and_names_what_it_took(tmp_path):
    from apply_bootstrap import apply

    from helpers.bootstrap import BOOTSTRAP_CELL

    nb = nbformat.v4.new_notebook()
    old = ('import os, sys, subprocess, pathlib\nCOURSE_REPO = "https://example.org/x"\n\n\ndef find_checkout():\n'
           '    return pathlib.Path.cwd()\n\n\nCOURSE_ROOT = find_checkout()\nsys.path.insert(0, str(COURSE_ROOT))')
    imports = ('%matplotlib inline\nimport json, warnings\n\nimport torch\n\nimport helpers\n\n'
               'warnings.filterwarnings("ignore", category=FutureWarning)\nruntime = helpers.detect_runtime()\n'
               'print(runtime)\nhelpers.warm_up_deepspeed()  # what the first engine imports\n'
               '                            # cannot leave them half-imported')
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell(old),
                nbformat.v4.new_code_cell(imports), nbformat.v4.new_code_cell("SEED = 0"),
                nbformat.v4.new_code_cell("print(json.dumps(runtime.label), find_checkout(), os.sep)")]
    nb.cells[1].metadata["tags"] = ["keep-me"]
    nb.cells[3].metadata["tags"] = ["parameters"]
    ids = [c.id for c in nb.cells]
    path = tmp_path / "06_new.ipynb"
    nbformat.write(nb, path)
    report = apply(path)
    assert any("find_checkout" in line for line in report), report  # later cells use what nothing defines now
    new = nbformat.read(path, as_version=4)
    assert [c.id for c in new.cells] == ids and new.cells[1].metadata["tags"] == ["keep-me"]
    assert new.cells[1].source == BOOTSTRAP_CELL
    assert new.cells[2].source == "import json\n\nimport torch"
    assert new.cells[3].source == "SEED = 0"
    assert apply(path) == []  # a second run changes nothing


def test_no_code_reads_datasets_through_its_torch_or_numpy_format():
    """datasets 4.0.0 (Colab's) breaks those formatters beside torchvision 0.26 (huggingface/datasets#8085): the course
    makes tensors with helpers.as_tensors (Dataset.with_transform) instead, in helpers, programs, benchmarks, scripts
    and the notebooks' code a learner copies."""
    pattern = re.compile(r"""\.(with_format|set_format)\(\s*(type\s*=\s*)?["'](torch|numpy|np)["']""")
    sources = [p for folder in ("helpers", "benchmarks", "scripts", "notebooks/programs")
               for p in (ROOT / folder).rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}" for p in sources if pattern.search(p.read_text())]
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        found += [path.name for c in code if pattern.search(c)]
    assert found == [], found


def test_reports_readme_names_every_committed_report():
    """reports/README.md's table says for each file in reports/ what wrote it and what it holds: a row's first cell
    names its files (`ladder.json`, `.md`: the same stem with another suffix)."""
    table = (ROOT / "reports" / "README.md").read_text()
    named = set()
    for first in re.findall(r"^\| ([^|]+) \|", table, flags=re.M):
        stem = None
        for name in re.findall(r"`([^`]+)`", first):
            if name.startswith(".") and stem:
                named.add(stem + name)
            else:
                named.add(name)
                stem = name.rsplit(".", 1)[0]
    files = {p.name for p in (ROOT / "reports").iterdir() if p.is_file() and p.name != "README.md"}
    assert files - named == set(), f"reports/README.md has no row for {sorted(files - named)}"
