"""Shared fixtures: runtimes that stand for a Colab T4, an A100 and this CPU machine."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from helpers.hardware import COLAB_RAM_BUDGET_BYTES, COLAB_VM_RAM_BYTES, T4_TOTAL_BYTES, T4_VRAM_GIB, GiB, Runtime

ROOT = Path(__file__).resolve().parent.parent


def last_line_of_fresh_process(code: str, timeout_s: int = 300) -> str:
    """Run `code` in a new Python (cwd: the repo) and return the last line it printed; fail with its stderr. For
    checks of RSS and the allocator, which what earlier tests left in pytest's own process must not decide."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def load_script(path: Path, name: str):
    """Import a file of benchmarks/ or notebooks/programs/ by its path, as module `name` (they are scripts, not a
    package); the module is not put in sys.modules, so each call runs the file's top level afresh."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_runtime(**overrides) -> Runtime:
    base = Runtime(device="cuda", gpu_name="Tesla T4", compute_capability=(7, 5), gpu_total_bytes=T4_TOTAL_BYTES,
                   vram_budget_bytes=int(T4_VRAM_GIB * GiB), ram_total_bytes=COLAB_VM_RAM_BYTES,
                   ram_budget_bytes=COLAB_RAM_BUDGET_BYTES,
                   disk_free_bytes=int(100e9), cpu_cores=2, gpu_count=1, is_colab=True, t4_budget=False,
                   precision="fp16")
    return dataclasses.replace(base, **overrides)


@pytest.fixture
def t4() -> Runtime:
    return fake_runtime()


@pytest.fixture
def a100() -> Runtime:
    return fake_runtime(gpu_name="NVIDIA A100-SXM4-40GB", compute_capability=(8, 0), gpu_total_bytes=int(40 * GiB),
                        vram_budget_bytes=int(40 * GiB), ram_total_bytes=int(80e9), ram_budget_bytes=int(80e9),
                        is_colab=False, precision="bf16")


@pytest.fixture
def cpu() -> Runtime:
    return fake_runtime(device="cpu", gpu_name=None, compute_capability=None, gpu_total_bytes=0,
                        vram_budget_bytes=0, ram_total_bytes=int(24e9), ram_budget_bytes=int(24e9),
                        gpu_count=0, is_colab=False, precision="fp32")


@pytest.fixture
def clean_dist_env(monkeypatch):
    """No MASTER_PORT & co. during a test, restored after it: notebooks run later must get no stale port."""
    from helpers.runtime import DIST_ENV_VARS

    for k in DIST_ENV_VARS:
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)


def interrupt_save_after_config(monkeypatch):
    """Make save_pretrained write config.json, then raise KeyboardInterrupt before the weights (an interrupted cell);
    returns the real save_pretrained (tests/test_atomic.py, tests/test_checkpoints.py)."""
    import os

    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def half(self, save_directory, *args, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        self.config.save_pretrained(save_directory)
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", half)
    return real


# the longest tests, measured (scripts/test.sh's log): started first so that no core waits on one at the end
LONGEST = ("test_a_first_colab_session_in_colabs_versions", "test_02_teaches_on_what_fits_when_the_ram_is_too_small")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest first, then notebooks (nbmake), then tests marked slow, then the rest (stable: collection order
    within each group), so that the long ones start early and the short ones fill the cores at the end. pytest-xdist's
    work stealing (scripts/test.sh) hands each worker a contiguous share of this order first: with two workers, the
    long ones alternate between the two halves, so each starts with its share of them."""
    def rank(item: pytest.Item) -> int:
        if item.name.startswith(LONGEST):
            return 0
        if getattr(item, "nbmake", False):
            return 1
        return 2 if item.get_closest_marker("slow") else 3

    items.sort(key=rank)
    long, rest = [i for i in items if rank(i) <= 1], [i for i in items if rank(i) > 1]
    first = long[0::2]
    fill = max(0, len(items) // 2 - len(first))
    items[:] = first + rest[:fill] + long[1::2] + rest[fill:]


def pytest_terminal_summary(terminalreporter) -> None:
    """Where the time went: seconds of notebooks (nbmake) and of tests, summed over the workers."""
    spent = {"notebooks (nbmake, as a learner runs them)": 0.0, "tests": 0.0}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if getattr(rep, "when", None) in ("setup", "call", "teardown") and hasattr(rep, "duration"):
                notebook = rep.nodeid.split("::")[0].endswith(".ipynb")
                spent["notebooks (nbmake, as a learner runs them)" if notebook else "tests"] += rep.duration
    terminalreporter.write_sep("=", "time spent, summed over the workers")
    for what, seconds in spent.items():
        terminalreporter.write_line(f"{what}: {seconds:.0f} s")
