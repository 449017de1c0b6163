"""`import helpers` is light and gives every public name of its modules as helpers.<name>."""
import ast
import re
import subprocess
import sys

import pytest

from conftest import ROOT

HEAVY = ("torch", "deepspeed", "transformers", "matplotlib", "ipywidgets", "datasets")
# modules imported on their own, not by helpers/__init__.py: the course GPT imports torch at import, as nanoGPT does
STANDALONE = {"gpt"}


def test_import_helpers_is_light_and_exports_resolve():
    code = (f"import sys, helpers; heavy = [m for m in {HEAVY!r} if m in sys.modules]; assert not heavy, heavy; "
            "[getattr(helpers, n) for n in helpers.__all__]; print(len(helpers.__all__))")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr  # from "/": the installed package, not the checkout in the cwd
    assert int(out.stdout.strip().splitlines()[-1]) >= 30


def test_unknown_name_raises_attribute_error():
    import helpers

    with pytest.raises(AttributeError):
        helpers.no_such_helper  # noqa: B018


def test_every_module_is_imported_whole_and_names_each_public_name_once():
    import helpers

    files = {p.stem for p in (ROOT / "helpers").glob("*.py")} - {"__init__"} - STANDALONE
    assert set(helpers.MODULES) == files, "helpers/__init__.py must import every module (or list it STANDALONE)"
    init = (ROOT / "helpers" / "__init__.py").read_text()
    assert re.findall(r"^from helpers\.(\w+) import \*", init, flags=re.M) == list(helpers.MODULES)
    owner: dict[str, str] = {}
    for name in helpers.MODULES:
        module = sys.modules[f"helpers.{name}"]
        assert isinstance(getattr(module, "__all__", None), list), f"helpers/{name}.py has no __all__ list"
        for public in module.__all__:
            assert hasattr(module, public), f"helpers.{name}.__all__ names {public!r}, which it does not define"
            assert public not in owner, f"{public!r} is in the __all__ of both {owner[public]} and {name}"
            assert public not in helpers.MODULES, f"{name}.{public} would hide the module helpers.{public}"
            owner[public] = name
    assert sorted(owner) == helpers.__all__


def _attributes_used(path):
    """Names the file reads as helpers.<name> (not helpers.<module>.<name>)."""
    text = path.read_text()
    if path.suffix == ".ipynb":
        import nbformat

        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return set(re.findall(r"(?<![\w.])helpers\.([A-Za-z_]\w*)\b(?!\.)", text))


def test_every_name_the_course_uses_as_helpers_dot_name_is_exported():
    import helpers

    files = [*(ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"), *(ROOT / "notebooks" / "drafts").glob("*.ipynb"),
             *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "scripts").glob("*.py"), *(ROOT / "notebooks" / "programs").glob("*.py")]
    modules = {p.stem for p in (ROOT / "helpers").glob("*.py")}
    missing = {f"{path.relative_to(ROOT)}: helpers.{name}" for path in files for name in _attributes_used(path)
               if name not in helpers.__all__ and name not in modules}
    assert not missing, sorted(missing)


def test_modules_import_nothing_heavy_at_their_top():
    """The rule behind a light `import helpers`: heavy imports live inside the functions that need them."""
    for name in (p.stem for p in (ROOT / "helpers").glob("*.py")):
        if name in STANDALONE:
            continue
        tree = ast.parse((ROOT / "helpers" / f"{name}.py").read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        roots = {(a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0]
                 for n in top for a in n.names}
        assert not roots & set(HEAVY), f"helpers/{name}.py imports {sorted(roots & set(HEAVY))} at its top"


def _helpers_imports(name):
    """The helpers modules `helpers/<name>.py` imports, at its top or inside its functions (not for type checks)."""
    tree = ast.parse((ROOT / "helpers" / f"{name}.py").read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("helpers."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("helpers.")}
    return out - {name}


def test_no_import_cycle_among_helpers_modules_counting_imports_inside_functions():
    """planner -> plots -> planner was the one circle (the widget drew with plots); the widget is planner_ui."""
    graph = {p.stem: _helpers_imports(p.stem) for p in (ROOT / "helpers").glob("*.py") if p.stem != "__init__"}
    assert "plots" not in graph["planner"] and "planner" in graph["planner_ui"]
    done, path = set(), []

    def visit(node):
        assert node not in path, "import cycle: " + " -> ".join(path[path.index(node):] + [node])
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        path.pop()
        done.add(node)

    for module in sorted(graph):
        visit(module)


def _documented_floors() -> dict[str, int]:
    """module -> floor, from docs/architecture.md's table ('| 3 | `models` | ...')."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", text, flags=re.M)
    names = [name for _, name in rows]
    assert len(names) == len(set(names)), f"docs/architecture.md lists a module twice: {names}"
    return {name: int(floor) for floor, name in rows}


def test_the_architecture_docs_floor_table_is_the_import_graph():
    """Issue 43: the table cannot drift. Every helpers module is listed once, at the floor one above the highest floor
    it imports from (floor 0: imports no helpers module), so every import points down."""
    graph = {p.stem: _helpers_imports(p.stem) for p in (ROOT / "helpers").glob("*.py") if p.stem != "__init__"}
    floors: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in floors:
            floors[module] = 1 + max((floor(m) for m in graph[module]), default=-1)
        return floors[module]

    documented = _documented_floors()
    assert set(documented) == set(graph), (f"docs/architecture.md's table: add {sorted(set(graph) - set(documented))}, "
                                           f"remove {sorted(set(documented) - set(graph))}")
    wrong = {m: f"documented {documented[m]}, imports make it {floor(m)}" for m in graph if documented[m] != floor(m)}
    assert not wrong, f"docs/architecture.md's floors: {wrong}"
