"""Run notebooks (or any command) as on a free Colab T4, with Colab's RAM, CPUs and disk enforced.

    python scripts/colab_emulation.py notebooks/02_zero3_offload_nvme.ipynb --out-dir build/emulated
    python scripts/colab_emulation.py --exec -- python benchmarks/ladder.py --configs plain --sizes gpt2
    python scripts/colab_emulation.py --probe          # which mechanism this machine allows

What a notebook's kernel, and every process it starts, gets:
- VRAM: PyTorch's allocator capped at what a T4 leaves it (helpers.T4_VRAM_GIB, 14.34 GiB of the card's 14.76: the
  CUDA context and DeepSpeed's share sit outside the allocator, helpers.t4_budget_account), fp16 and the T4's
  attention kernel (SDPA's memory-efficient one: no flash, no cuDNN): helpers' T4 budget mode inside each process
  (the Colab profile, DS_COURSE_COLAB=1, turns it on and makes the notebooks take their Colab branches).
- RAM: Colab's 12.7 GiB VM less 1.4 GiB that Colab's own processes use on a fresh VM = 12.1 GB, through a cgroup
  (v2 `memory.max`, or v1 `memory.limit_in_bytes`) with swap off: at the limit the kernel's out-of-memory killer acts,
  as on Colab. Where no cgroup can be written, a watchdog samples the RSS of the kernel's process tree every 0.1 s
  and kills at the limit: a weaker check (it misses short peaks and page cache), labelled "watchdog".
- CPUs: 2 (Colab's vCPUs): a cpuset of two cores plus a quota of two CPUs in the cgroup; the CPU affinity of the
  kernel in any case.
- Disk: the NVMe folder (DS_COURSE_NVME_DIR, which the notebooks use) held to 60 GB by a watchdog.
Not emulated: compute speed (an H200 does ~15x a T4's fp16 work), disk and PCIe speed, the CPU model.
Each run gets its own cgroup, removed afterwards. Used by scripts/gpu_check.py and tests/test_colab_emulation.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.hardware import (COLAB_CPUS, COLAB_PROFILE_ENV, COLAB_RAM_BUDGET_BYTES, COLAB_RESERVED_BYTES,
                              EMULATION_ENV, GB, GiB, NVME_DIR_ENV, T4_BUDGET_ENV, T4_VRAM_GIB, COLAB_NVME_BUDGET_BYTES,
                              _cgroup_mounts)
from helpers.memory import folder_bytes

ROOT = Path(__file__).resolve().parent.parent

KERNEL_NAME = "ds-course-colab"


@dataclass
class ColabLimits:
    """What a free Colab T4 gives a notebook (helpers.hardware's constants)."""

    ram_bytes: int = COLAB_RAM_BUDGET_BYTES  # for the kernel and its children
    reserved_bytes: int = COLAB_RESERVED_BYTES  # Colab's own processes, outside the limit
    cpus: int = COLAB_CPUS
    vram_gib: float = T4_VRAM_GIB
    disk_bytes: int = COLAB_NVME_BUDGET_BYTES

    def as_report(self, mechanism: str) -> dict[str, Any]:
        """The report's top-level "emulation" object."""
        return {"ram_limit_gb": round(self.ram_bytes / GB, 2), "ram_reserved_gb": round(self.reserved_bytes / GB, 2),
                "colab_vm_ram_gib": round((self.ram_bytes + self.reserved_bytes) / GiB, 2), "cpus": self.cpus,
                "vram_cap_gib": self.vram_gib, "disk_budget_gb": round(self.disk_bytes / GB, 1),
                "mechanism": mechanism, "disk_mechanism": "folder watchdog",
                "not_emulated": "compute speed (an H200 has ~15x a T4's fp16 throughput), disk and PCIe speed, "
                                "the CPU model"}


# ------------------------------------------------------------------------------------------ cgroups

def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _v2_root() -> Path | None:
    """The cgroup v2 mount if it offers the memory controller, else None."""
    point = _cgroup_mounts().get("v2")
    if not point:
        return None
    root = Path(point)
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError:
        return None
    return root if "memory" in controllers else None


def _try_group(parent: Path, limit_file: str) -> None:
    """Make a cgroup under `parent`, set a memory limit in it and remove it again; OSError if any step is refused."""
    test = parent / f"ds-course-probe-{os.getpid()}"
    try:
        test.mkdir()
        _write(test / limit_file, str(1 << 30))
    finally:
        try:
            test.rmdir()
        except OSError:
            pass


def probe() -> tuple[str, str]:
    """(mechanism, why) that an Enclosure would use here: "cgroup v2", "cgroup v1" or "watchdog"."""
    if os.geteuid() != 0:
        return "watchdog", "not root: cgroups cannot be written"
    reasons = []
    root = _v2_root()
    if root is not None:
        try:
            if "memory" not in (root / "cgroup.subtree_control").read_text().split():
                _write(root / "cgroup.subtree_control", "+memory")
            _try_group(root, "memory.max")
            return "cgroup v2", f"{root} is writable"
        except OSError as exc:
            reasons.append(f"cgroup v2 at {root}: {exc}")
    point = _cgroup_mounts().get("memory")
    if point:
        try:
            _try_group(Path(point), "memory.limit_in_bytes")
            return "cgroup v1", f"{point} is writable"
        except OSError as exc:
            reasons.append(f"cgroup v1 at {point}: {exc}")
    return "watchdog", "; ".join(reasons) or "no cgroup file system with a memory controller is mounted"


def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def _stat(path: Path, key: str) -> int:
    """One counter of a memory.stat / memory.events / memory.oom_control file (0 if absent)."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip().lstrip("-").isdigit():
                return int(v)
    except OSError:
        pass
    return 0


@dataclass
class EnclosureStats:
    """What an Enclosure saw (peaks in bytes)."""

    mechanism: str
    peak_ram_bytes: int = 0  # the whole group's memory (cgroup: anon + page cache + kernel; watchdog: summed RSS)
    peak_anon_bytes: int = 0  # anonymous memory only (sampled)
    oom_kills: int = 0
    disk_kills: int = 0
    peak_disk_bytes: int = 0
    gpu_busy_seconds: float | None = None  # integral of NVML's utilisation (a kernel running on the GPU)
    gpu_busy_source: str = ""  # "these processes" (NVML per-process samples) or "whole GPU" (shared with others)
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # the group's largest processes when its anonymous memory peaked: "pid rss_gb command" (names an OOM's culprit)
    peak_processes: list[str] = field(default_factory=list)

    def as_report(self) -> dict[str, Any]:
        d = {"peak_ram_gb": round(self.peak_ram_bytes / GB, 2), "peak_anon_gb": round(self.peak_anon_bytes / GB, 2),
             "oom_kills": self.oom_kills, "mechanism": self.mechanism,
             "peak_nvme_folder_gb": round(self.peak_disk_bytes / GB, 2)}
        if self.disk_kills:
            d["disk_kills"] = self.disk_kills
        if self.gpu_busy_seconds is not None:
            d["gpu_busy_seconds"] = round(self.gpu_busy_seconds, 1)
            d["gpu_busy_source"] = self.gpu_busy_source
        if self.notes:
            d["notes"] = self.notes
        if self.peak_processes and self.oom_kills:
            d["peak_processes"] = self.peak_processes
        return d


class Enclosure:
    """Holds the processes started through it to ColabLimits: a cgroup when possible, else a watchdog.

        with Enclosure("nb02", limits, cpus=[0, 1], nvme_dir="/tmp/nvme") as enc:
            subprocess.run(enc.join_argv() + ["python", "train.py"])
        print(enc.stats.as_report())
    """

    def __init__(self, name: str, limits: ColabLimits | None = None, *, cpus: list[int] | None = None,
                 nvme_dir: str | None = None, mechanism: str | None = None, gpu_index: int | None = None) -> None:
        self.name = f"ds-course-{name}-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.limits = limits or ColabLimits()
        available = sorted(os.sched_getaffinity(0))
        self.cpus = list(cpus) if cpus else available[:self.limits.cpus]
        self.nvme_dir = nvme_dir
        self.requested = mechanism
        self.gpu_index = gpu_index
        self.dirs: list[Path] = []  # cgroup folders made (v2: one; v1: memory, cpuset, cpu)
        self.memory_dir: Path | None = None
        self.roots: list[int] = []  # watchdog: processes whose trees are watched
        self.stats = EnclosureStats(mechanism="")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._listed_at = 0  # the anonymous memory at which the group's largest processes were last listed

    # -- setting up
    def __enter__(self) -> "Enclosure":
        mechanism, why = probe() if self.requested is None else (self.requested, "asked for")
        self.stats.mechanism = mechanism
        if mechanism.startswith("cgroup"):
            stale = remove_stale_groups()
            if stale:
                self.stats.notes.append(f"removed {len(stale)} empty cgroup(s) left by killed runs: {sorted(set(stale))}")
        if mechanism == "cgroup v2":
            self._make_v2()
        elif mechanism == "cgroup v1":
            self._make_v1()
        else:
            self.stats.notes.append(f"RSS watchdog, the weaker check ({why})")
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._watch, name=f"enclosure-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _make_v2(self) -> None:
        root = _v2_root()
        assert root is not None
        subtree = (root / "cgroup.subtree_control").read_text().split()
        controllers = (root / "cgroup.controllers").read_text().split()
        for c in ("memory", "cpu", "cpuset"):
            if c in controllers and c not in subtree:
                try:
                    _write(root / "cgroup.subtree_control", f"+{c}")
                except OSError as exc:
                    self.stats.notes.append(f"could not enable the {c} controller: {exc}")
        d = root / self.name
        d.mkdir()
        self.dirs.append(d)
        self.memory_dir = d
        _write(d / "memory.max", str(self.limits.ram_bytes))
        if (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
        if (d / "cpu.max").exists():
            _write(d / "cpu.max", f"{self.limits.cpus * 100000} 100000")
        if (d / "cpuset.cpus").exists():
            try:
                _write(d / "cpuset.cpus", ",".join(map(str, self.cpus)))
                mems = (root / "cpuset.mems.effective").read_text().strip() if (root / "cpuset.mems.effective").exists() else "0"
                _write(d / "cpuset.mems", mems)
            except OSError as exc:
                self.stats.notes.append(f"cpuset not set ({exc}); CPU affinity and cpu.max hold the CPUs")
        got = (d / "memory.max").read_text().strip()
        if not got.isdigit() or abs(int(got) - self.limits.ram_bytes) > 1 << 16:  # rounded down to a page
            raise RuntimeError(f"memory.max reads {got}, not {self.limits.ram_bytes}")

    def _make_v1(self) -> None:
        mounts = _cgroup_mounts()
        mem = Path(mounts["memory"]) / self.name
        mem.mkdir()
        self.dirs.append(mem)
        self.memory_dir = mem
        _write(mem / "memory.limit_in_bytes", str(self.limits.ram_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():  # swap off: RAM + swap = RAM
            try:
                _write(mem / "memory.memsw.limit_in_bytes", str(self.limits.ram_bytes))
            except OSError as exc:
                self.stats.notes.append(f"memsw limit not set: {exc}")
        def cpuset(cs: Path) -> None:
            _write(cs / "cpuset.cpus", ",".join(map(str, self.cpus)))
            _write(cs / "cpuset.mems", (cs.parent / "cpuset.mems").read_text().strip())

        def cpu_quota(cpu: Path) -> None:
            period = int((cpu / "cpu.cfs_period_us").read_text())
            _write(cpu / "cpu.cfs_quota_us", str(self.limits.cpus * period))

        for controller, fill, what in (("cpuset", cpuset, "cpuset"), ("cpu", cpu_quota, "CPU quota")):
            if controller not in mounts:
                continue
            folder = Path(mounts[controller]) / self.name
            try:
                folder.mkdir()
                self.dirs.append(folder)
                fill(folder)
            except OSError as exc:
                self.stats.notes.append(f"{what} not set: {exc}")

    def join_argv(self) -> list[str]:
        """Prefix for a command line: the process joins this enclosure (cgroup, CPUs), then execs the command."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        return [sys.executable, str(Path(__file__).resolve()), "--join", *procs, "--cpus",
                ",".join(map(str, self.cpus)), "--"]

    def adopt(self, pid: int) -> None:
        """Watch `pid`'s process tree (the watchdog's roots; harmless with a cgroup)."""
        self.roots.append(pid)

    def environment(self) -> dict[str, str]:
        """Variables for processes in the enclosure: the Colab profile and where the NVMe folder is."""
        env = {COLAB_PROFILE_ENV: "1", T4_BUDGET_ENV: "1", EMULATION_ENV: self.stats.mechanism}
        if self.nvme_dir:
            env[NVME_DIR_ENV] = self.nvme_dir
        return env

    # -- watching
    def _members(self) -> list[int]:
        if self.dirs:
            try:
                return [int(x) for x in (self.dirs[0] / "cgroup.procs").read_text().split()]
            except OSError:
                return []
        return [p.pid for r in self.roots for p in _tree(r)]

    def _kill_all(self) -> None:
        for pid in self._members():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _watch(self) -> None:
        nvml = _nvml_handle(self.gpu_index)
        last_disk = last_gpu = time.perf_counter()
        busy = 0.0
        while not self._stop.wait(0.1):
            now = time.perf_counter()
            self._sample_memory()
            if self.nvme_dir and now - last_disk >= 1.0:
                last_disk = now
                used = folder_bytes(self.nvme_dir)
                self.stats.peak_disk_bytes = max(self.stats.peak_disk_bytes, used)
                if used > self.limits.disk_bytes:
                    self.stats.disk_kills += 1
                    self.stats.notes.append(f"NVMe folder reached {used / GB:.1f} GB > {self.limits.disk_bytes / GB:.0f}"
                                            " GB disk budget: processes killed")
                    self._kill_all()
            if nvml is not None and now - last_gpu >= 0.5:
                busy += _gpu_utilisation(nvml, set(self._members()), self.stats) * (now - last_gpu)
                self.stats.gpu_busy_seconds = busy
                last_gpu = now

    def _sample_memory(self) -> None:
        s = self.stats
        d = self.memory_dir
        if d is not None:
            current = d / ("memory.current" if s.mechanism == "cgroup v2" else "memory.usage_in_bytes")
            try:
                s.peak_ram_bytes = max(s.peak_ram_bytes, int(current.read_text()))
            except (OSError, ValueError):
                pass
            anon = _stat(d / "memory.stat", "anon") if s.mechanism == "cgroup v2" else \
                _stat(d / "memory.stat", "total_rss")
            if anon > s.peak_anon_bytes:
                s.peak_anon_bytes = anon
                if anon > 1.1 * self._listed_at:  # re-list only on a real rise: a listing costs a few ms
                    self._listed_at = anon
                    s.peak_processes = _largest_processes(self._members())
            return
        procs = [p for r in self.roots for p in _tree(r)]
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except Exception:  # noqa: BLE001 - the process ended between listing and reading
                pass
        s.peak_ram_bytes = max(s.peak_ram_bytes, total)
        s.peak_anon_bytes = s.peak_ram_bytes
        if total > self.limits.ram_bytes and procs:
            biggest = max(procs, key=lambda p: _safe_rss(p))
            s.oom_kills += 1
            s.notes.append(f"watchdog: {total / GB:.2f} GB > {self.limits.ram_bytes / GB:.2f} GB, killed pid "
                           f"{biggest.pid} ({_safe_rss(biggest) / GB:.2f} GB)")
            try:
                biggest.kill()
            except Exception:  # noqa: BLE001
                pass

    # -- tearing down
    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample_memory()
        self.stats.wall_seconds = round(time.perf_counter() - self._started, 1)
        d = self.memory_dir
        if d is not None:
            if self.stats.mechanism == "cgroup v2":
                peak = d / "memory.peak"
                if peak.exists():
                    self.stats.peak_ram_bytes = max(self.stats.peak_ram_bytes, int(peak.read_text()))
                self.stats.oom_kills = _stat(d / "memory.events", "oom_kill")
            else:
                try:
                    self.stats.peak_ram_bytes = max(self.stats.peak_ram_bytes,
                                                    int((d / "memory.max_usage_in_bytes").read_text()))
                except (OSError, ValueError):
                    pass
                self.stats.oom_kills = _stat(d / "memory.oom_control", "oom_kill")
        for _ in range(50):  # leftovers (a kernel that did not shut down) are killed, then the groups removed
            if not self._members():
                break
            self._kill_all()
            time.sleep(0.1)
        for g in reversed(self.dirs):
            for _ in range(50):
                try:
                    g.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                self.stats.notes.append(f"could not remove {g}")


def _largest_processes(pids: list[int], n: int = 4) -> list[str]:
    """'pid rss_gb command' of the n largest of `pids` by resident memory (for a report of what filled a group)."""
    import psutil

    rows = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            rows.append((p.memory_info().rss, pid, " ".join(p.cmdline())[:160] or p.name()))
        except psutil.Error:
            pass
    return [f"{pid} {rss / GB:.2f} GB {cmd}" for rss, pid, cmd in sorted(rows, reverse=True)[:n]]


def _safe_rss(p: Any) -> int:
    try:
        return p.memory_info().rss
    except Exception:  # noqa: BLE001
        return 0


def _gpu_utilisation(handle: Any, pids: set[int], stats: EnclosureStats) -> float:
    """Share of the last moments in which these processes ran a kernel (0..1): NVML's per-process samples; where
    the driver gives none, the whole GPU's utilisation, and `stats.gpu_busy_source` says so."""
    import pynvml

    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, int((time.time() - 1.0) * 1e6))
        stats.gpu_busy_source = "these processes (NVML per-process samples)"
        return max((s.smUtil for s in samples if s.pid in pids), default=0) / 100
    except pynvml.NVMLError_NotFound:  # no samples in that window: idle
        stats.gpu_busy_source = stats.gpu_busy_source or "these processes (NVML per-process samples)"
        return 0.0
    except Exception:  # noqa: BLE001 - not supported here: the whole GPU, shared with whatever else runs
        try:
            stats.gpu_busy_source = "whole GPU (shared with other processes on it)"
            return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
        except Exception:  # noqa: BLE001
            return 0.0


def _nvml_handle(index: int | None) -> Any:
    """An NVML handle for the GPU that the enclosed processes use (None without NVML or a GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if index is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            index = int(visible) if visible.isdigit() else 0
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no NVML, no GPU: no GPU-busy figure
        return None


def _join(argv: list[str]) -> int:
    """`--join PROCS... --cpus L -- CMD...`: move this process into the cgroups, pin the CPUs, exec CMD."""
    split = argv.index("--")
    head, cmd = argv[:split], argv[split + 1:]
    cpus = head[head.index("--cpus") + 1] if "--cpus" in head else ""
    procs = [a for a in head[:head.index("--cpus")] if a != "--join"] if "--cpus" in head else head[1:]
    for f in procs:
        _write(Path(f), str(os.getpid()))
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    os.execvp(cmd[0], cmd)
    return 127  # pragma: no cover - execvp does not return


# ------------------------------------------------------------------------------------------ notebooks

def kernelspec_dir(enc: Enclosure, parent: Path) -> Path:
    """A Jupyter data folder holding the kernelspec KERNEL_NAME, whose kernel starts inside `enc`."""
    spec = parent / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    argv = enc.join_argv() + [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": argv, "display_name": "Python 3 (Colab T4 emulation)", "language": "python",
        "env": enc.environment()}))
    return parent


_GROUP_NAME = re.compile(r"^ds-course-.+-(\d+)-\d+$")  # Enclosure.name: ds-course-<name>-<pid>-<ms>


def _our_group_dirs() -> list[Path]:
    """Every ds-course-* cgroup folder on this machine (any process's), across the mounts an Enclosure uses."""
    found: list[Path] = []
    for point in {v for k, v in _cgroup_mounts().items() if k in ("v2", "memory", "cpuset", "cpu")}:
        found += sorted(Path(point).glob("ds-course-*"))
    return found


def leftover_groups(owner_pid: int | None = None) -> list[str]:
    """Names of the cgroups that Enclosures of process `owner_pid` (default: this one) made and did not remove.

    An Enclosure removes its own groups when it exits; another process's live run is not this one's leftover.
    `owner_pid=-1` lists every ds-course-* group on the machine.
    """
    pid = os.getpid() if owner_pid is None else owner_pid
    names = [d.name for d in _our_group_dirs()]
    if pid == -1:
        return names
    return [n for n in names if (m := _GROUP_NAME.match(n)) and int(m.group(1)) == pid]


def remove_stale_groups(min_age_s: float = 120.0) -> list[str]:
    """Remove ds-course-* cgroups left by runs that were killed before they could clean up; returns their names.

    A group is stale when it holds no process, is older than `min_age_s` and was not made by a live process of this
    PID namespace (a run killed by SIGKILL, e.g. a session ending mid-test, leaves its empty groups behind; the next
    Enclosure sweeps them so that they neither pile up nor look like this run's leftovers).
    """
    import psutil

    removed = []
    for d in _our_group_dirs():
        m = _GROUP_NAME.match(d.name) or re.match(r"^ds-course-probe-(\d+)$", d.name)
        try:
            busy = bool((d / "cgroup.procs").read_text().split())
            age = time.time() - d.stat().st_mtime
        except OSError:
            continue
        owner = int(m.group(1)) if m else -1
        if busy or age < min_age_s or owner == os.getpid() or (owner > 0 and psutil.pid_exists(owner)):
            continue
        try:
            d.rmdir()
            removed.append(d.name)
        except OSError:
            pass
    return removed


def nbmake_version() -> str:
    """'nbmake 1.5.5' (the runner named in reports/gpu_check.json)."""
    from importlib.metadata import version

    return f"nbmake {version('nbmake')}"


def _run_nbmake(path: Path, enc: Enclosure, *, out_dir: Path | None, figures_file: Path | None,
                timeout_s: int) -> dict[str, Any]:
    """`pytest --nbmake` on a copy of `path`, started inside `enc` (pytest and the kernel it starts, with the saved-run
    environment the other runners set); nbmake's --overwrite leaves the executed copy, which goes to `out_dir`.

    The copy runs inside the checkout (build/nbmake/), where the notebook's bootstrap cell finds helpers/."""
    import shutil

    work = ROOT / "build" / "nbmake" / f"{path.stem}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    copy = work / path.name
    shutil.copy(path, copy)
    env = {**os.environ, **enc.environment(), "DS_COURSE_SAVED_RUN": "1"}
    if figures_file is not None:
        figures_file.unlink(missing_ok=True)
        env["DS_COURSE_FIGURES"] = str(figures_file)
    argv = enc.join_argv() + [sys.executable, "-m", "pytest", "--nbmake", f"--nbmake-timeout={timeout_s}",
                              "--overwrite", "-p", "no:cacheprovider", "-q", str(copy)]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=str(work), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    enc.adopt(proc.pid)
    try:
        out, _ = proc.communicate(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        out += f"\nnbmake did not finish within {timeout_s + 60} s"
    seconds = round(time.perf_counter() - start, 1)
    if out_dir is not None:
        from run_notebooks import tidy_executed  # scripts/ is on sys.path (script folder or pytest)

        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            tidy_executed(copy, out_dir / path.name)
        except ImportError as exc:  # no nbconvert here: the copy is kept as nbmake saved it
            shutil.copy(copy, out_dir / path.name)
            print(f"{path.name}: saved untidied ({exc}); fix: python scripts/run_notebooks.py --tidy {out_dir / path.name}",
                  file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    passed = proc.returncode == 0
    return {"passed": passed, "seconds": seconds, "error": "" if passed else out[-4000:], "runner": nbmake_version(),
            "log": out.strip().splitlines()[-5:]}


def run_notebook(path: Path, *, out_dir: Path | None = None, figures_file: Path | None = None,
                 limits: ColabLimits | None = None, cpus: list[int] | None = None, nvme_dir: str | None = None,
                 mechanism: str | None = None, timeout_s: int = 1800, twice: bool = False,
                 habits: bool = False, runner: str = "nbclient") -> dict[str, Any]:
    """Execute one notebook with its kernel inside an Enclosure; returns run_notebooks.execute's dict + the stats.

    `habits=True` runs it as a learner does (run_notebooks.execute_with_habits: interrupts, re-runs, a second pass).
    `runner="nbmake"`: `pytest --nbmake` itself runs inside the enclosure (one pass; scripts/gpu_check.py's default).
    """
    from run_notebooks import execute, execute_with_habits  # scripts/ is on sys.path (script folder or pytest)

    if runner not in ("nbclient", "nbmake") or (runner == "nbmake" and (habits or twice)):
        raise ValueError(f"runner={runner!r}: 'nbclient' (any mode) or 'nbmake' (one plain pass)")
    limits = limits or ColabLimits()
    with tempfile.TemporaryDirectory(prefix="ds-course-kernel-") as tmp:
        nvme = nvme_dir or str(Path(tmp) / "nvme")
        os.makedirs(nvme, exist_ok=True)
        with Enclosure(path.stem[:2], limits, cpus=cpus, nvme_dir=nvme, mechanism=mechanism) as enc:
            data_dir = kernelspec_dir(enc, Path(tmp) / "jupyter")
            saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", *enc.environment())}
            os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(data_dir), saved["JUPYTER_PATH"]]))
            os.environ.update(enc.environment())  # for what the kernel's own environment does not carry
            try:
                if runner == "nbmake":
                    result = _run_nbmake(path, enc, out_dir=out_dir, figures_file=figures_file, timeout_s=timeout_s)
                elif habits:
                    result = execute_with_habits(path, timeout_s=timeout_s, out_dir=out_dir, kernel_name=KERNEL_NAME,
                                                 on_kernel_start=enc.adopt)
                else:
                    result = execute(path, twice=twice, timeout_s=timeout_s, out_dir=out_dir,
                                     figures_file=figures_file, kernel_name=KERNEL_NAME, on_kernel_start=enc.adopt)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
    result["enclosure"] = enc.stats.as_report()
    if enc.stats.oom_kills:
        result["passed"] = False
        result["error"] = (result["error"] + "\n" if result["error"] else "") + \
            f"{enc.stats.oom_kills} process(es) killed at the {limits.ram_bytes / GB:.2f} GB RAM limit"
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--join"]:
        return _join(argv)
    command: list[str] = []
    if "--exec" in argv:  # everything after it (and an optional "--") is the command
        i = argv.index("--exec")
        argv, command = argv[:i], argv[i + 1:]
        command = command[1:] if command[:1] == ["--"] else command
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=Path)
    p.add_argument("--out-dir", type=Path, default=ROOT / "build" / "emulated")
    p.add_argument("--probe", action="store_true", help="print which mechanism this machine allows, and why")
    p.add_argument("--exec", action="store_true", help="run the command that follows (after --) inside the limits")
    p.add_argument("--ram-gb", type=float, default=COLAB_RAM_BUDGET_BYTES / GB, help="RAM limit (GB)")
    p.add_argument("--cpus", default="", help="cores to use, e.g. 2,3 (default: the first two this process may use)")
    p.add_argument("--mechanism", choices=["cgroup v2", "cgroup v1", "watchdog"], help="default: the best available")
    args = p.parse_args(argv)
    if args.probe:
        print(json.dumps(dict(zip(("mechanism", "why"), probe()))))
        return 0
    limits = ColabLimits(ram_bytes=int(args.ram_gb * GB))
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    if command:
        cmd = command
        with tempfile.TemporaryDirectory(prefix="ds-course-nvme-") as nvme, \
                Enclosure("exec", limits, cpus=cpus, nvme_dir=nvme, mechanism=args.mechanism) as enc:
            proc = subprocess.Popen(enc.join_argv() + cmd, env={**os.environ, **enc.environment()})
            enc.adopt(proc.pid)
            code = proc.wait()
        print(json.dumps({"exit_code": code, **enc.stats.as_report(), "limits": limits.as_report(enc.stats.mechanism)}),
              file=sys.stderr)
        return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell says
    code = 0
    for path in args.notebooks:
        r = run_notebook(path, out_dir=args.out_dir, limits=limits, cpus=cpus, mechanism=args.mechanism)
        print(json.dumps({"notebook": path.name, "passed": r["passed"], "seconds": r["seconds"], **r["enclosure"]}))
        if r["error"]:
            print(r["error"][-3000:], file=sys.stderr)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
