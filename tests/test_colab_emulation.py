"""The Colab emulation (scripts/colab_emulation.py): limits really enforced, read back by helpers, removed after.

Notebook 02 itself runs inside a memory cgroup in the test command's nbmake pass (tests/learner_habits.py: that run
is CI's one run of it).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

import colab_emulation as emu  # scripts/ is on pytest's pythonpath (pyproject.toml)

MECHANISM, WHY = emu.probe()
needs_cgroup = pytest.mark.skipif(not MECHANISM.startswith("cgroup"), reason=f"cgroups not writable here: {WHY}")


def _run_inside(enc, code: str) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(enc.join_argv() + [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **enc.environment(), "PYTHONPATH": str(ROOT)})
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
    assert not emu.leftover_groups()


@needs_cgroup
def test_helpers_read_the_limits_they_are_given():
    limits = emu.ColabLimits(ram_bytes=3 * 2**30, cpus=1)
    with emu.Enclosure("test", limits, cpus=[0]) as enc:
        r = _run_inside(enc, "import json; from helpers import hardware as h; "
                             "print(json.dumps([h.ram_limit(), h.usable_cpus(), h.emulation_mechanism()]))")
    (ram, source), cpus, mechanism = json.loads(r.stdout.strip().splitlines()[-1])
    assert ram == 3 * 2**30 and source == MECHANISM and cpus == 1 and mechanism == MECHANISM
    assert not emu.leftover_groups()


@needs_cgroup
def test_groups_of_a_killed_run_are_swept_and_not_counted_as_this_runs_leftovers():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parent = Path(emu._cgroup_mounts()["v2" if MECHANISM == "cgroup v2" else "memory"])
    stale, mine = parent / f"ds-course-02-{dead.pid}-12345", parent / f"ds-course-02-{os.getpid()}-12345"
    stale.mkdir()
    mine.mkdir()
    try:
        assert emu.leftover_groups() == [mine.name]  # another process's group is not this run's leftover
        assert stale.name in emu.leftover_groups(owner_pid=-1)
        assert stale.name not in emu.remove_stale_groups(min_age_s=3600)  # too young to be called stale
        removed = emu.remove_stale_groups(min_age_s=0)
        assert stale.name in removed and mine.name not in removed  # ours stays: this process is alive
        assert not stale.exists() and mine.exists()
    finally:
        for d in (stale, mine):
            if d.exists():
                d.rmdir()
    assert not emu.leftover_groups()


def test_limits_report_names_what_is_and_is_not_emulated():
    rep = emu.ColabLimits().as_report("cgroup v2")
    assert rep["ram_limit_gb"] == 12.13 and rep["ram_reserved_gb"] == 1.5 and rep["colab_vm_ram_gib"] == 12.7
    assert rep["cpus"] == 2 and rep["vram_cap_gib"] == 14.34 and rep["mechanism"] == "cgroup v2"
    assert "compute speed" in rep["not_emulated"]
