"""Shared fixtures: runtimes that stand for a Colab T4, an A100 and this CPU machine."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from helpers.hardware import COLAB_RAM_BUDGET_BYTES, COLAB_VM_RAM_BYTES, GiB, Runtime

ROOT = Path(__file__).resolve().parent.parent


def last_line_of_fresh_process(code: str, timeout_s: int = 300) -> str:
    """Run `code` in a new Python (cwd: the repo) and return the last line it printed; fail with its stderr. For
    checks of RSS and the allocator, which what earlier tests left in pytest's own process must not decide."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def fake_runtime(**overrides) -> Runtime:
    base = Runtime(device="cuda", gpu_name="Tesla T4", compute_capability=(7, 5), gpu_total_bytes=int(15 * GiB),
                   vram_budget_bytes=int(15 * GiB), ram_total_bytes=COLAB_VM_RAM_BYTES,
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked slow first (stable: module order kept within each group): with pytest-xdist's work stealing
    (scripts/test.sh) the long ones start early and the short ones fill the cores at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
