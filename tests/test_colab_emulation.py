"""The Colab emulation (scripts/colab_emulation.py): limits really enforced, read back by helpers, removed after.

The notebook test runs notebook 02 smoke-sized with its kernel inside a memory cgroup sized for the smoke run: the
mechanism works on this machine and the notebook's big runs (each in a child process) keep within it.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

import colab_emulation as emu  # scripts/ is on pytest's pythonpath (pyproject.toml)

MECHANISM, WHY = emu.probe()
needs_cgroup = pytest.mark.skipif(not MECHANISM.startswith("cgroup"), reason=f"cgroups not writable here: {WHY}")


def _leftover_groups() -> list[str]:
    found = []
    for point in {v for k, v in emu._cgroup_mounts().items() if k in ("v2", "memory", "cpuset", "cpu")}:
        found += [p.name for p in Path(point).glob("ds-course-*")]
    return found


def _run_inside(enc, code: str) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(enc.join_argv() + [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, **enc.environment(), "PYTHONPATH": str(ROOT)})
    enc.adopt(proc.pid)
    out, _ = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


GREEDY = "x = bytearray(100 * 2**20); print('100 MB', flush=True); y = bytearray(600 * 2**20); import time; " \
         "time.sleep(2); print('survived')"


@pytest.mark.parametrize("mechanism", [pytest.param(MECHANISM, marks=needs_cgroup), "watchdog"])
def test_a_process_over_the_limit_is_killed_and_counted(mechanism):
    limits = emu.ColabLimits(ram_bytes=300 * 10**6)
    with emu.Enclosure("test", limits, mechanism=mechanism) as enc:
        r = _run_inside(enc, GREEDY)
    assert "100 MB" in r.stdout and "survived" not in r.stdout
    assert r.returncode == -9 and enc.stats.oom_kills >= 1
    assert enc.stats.mechanism == mechanism and enc.stats.peak_ram_bytes >= 100 * 2**20
    assert not _leftover_groups()


@needs_cgroup
def test_helpers_read_the_limits_they_are_given():
    limits = emu.ColabLimits(ram_bytes=3 * 2**30, cpus=1)
    with emu.Enclosure("test", limits, cpus=[0]) as enc:
        r = _run_inside(enc, "import json; from helpers import hardware as h; "
                             "print(json.dumps([h.ram_limit(), h.usable_cpus(), h.emulation_mechanism()]))")
    (ram, source), cpus, mechanism = json.loads(r.stdout.strip().splitlines()[-1])
    assert ram == 3 * 2**30 and source == MECHANISM and cpus == 1 and mechanism == MECHANISM
    assert not _leftover_groups()


def test_limits_report_names_what_is_and_is_not_emulated():
    rep = emu.ColabLimits().as_report("cgroup v2")
    assert rep["ram_limit_gb"] == 12.13 and rep["ram_reserved_gb"] == 1.5 and rep["colab_vm_ram_gib"] == 12.7
    assert rep["cpus"] == 2 and rep["vram_cap_gib"] == 15.0 and rep["mechanism"] == "cgroup v2"
    assert "compute speed" in rep["not_emulated"]


SMOKE_RAM_BYTES = int(3e9)  # notebook 02 smoke-sized peaked at 2.0 GB (1.2 GB anonymous: kernel + its largest child)


def _build_ops_outside() -> None:
    """DeepSpeed's JIT op builds (g++ on 2 cores) need more RAM than the smoke run itself: inside a 3 GB group they
    were killed on a fresh machine. Build them first, outside (the notebooks then load them from the cache)."""
    code = ("from deepspeed.accelerator import get_accelerator as a\n"
            "for name in ('CPUAdamBuilder', 'AsyncIOBuilder', 'ShareMemCommBuilder'):\n"
            "    b = a().create_op_builder(name)\n"
            "    if b is not None and b.is_compatible(verbose=False):\n"
            "        b.load()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_cgroup
def test_notebook_02_smoke_runs_inside_a_memory_cgroup(tmp_path):
    _build_ops_outside()
    limits = emu.ColabLimits(ram_bytes=SMOKE_RAM_BYTES)
    r = emu.run_notebook(ROOT / "notebooks" / "02_zero3_offload_nvme.ipynb", out_dir=tmp_path, limits=limits)
    assert r["passed"], r["error"][-3000:]
    enc = r["enclosure"]
    assert enc["mechanism"] == MECHANISM and enc["oom_kills"] == 0
    assert 0.3 < enc["peak_ram_gb"] <= SMOKE_RAM_BYTES / 1e9
    assert not _leftover_groups()
