"""Which code holds host RAM during a run, storage by storage: the measured side of the host byte account
(issue 25: what keeps a 2.7B model from fitting Colab's 12.7 GB; notebook 02's ladder).

`HostAllocationTrace` is a torch dispatch mode: every tensor an operator returns whose storage is at least
`threshold_bytes` and was not seen before is recorded with the innermost DeepSpeed frame that asked for it (file,
line, function), its dtype and bytes, and the phase of the run. Storages that C++ allocates (DeepSpeed's aio
`new_cpu_locked_tensor`) show up at the first operator that touches them (the `.zero_()` right after). Frees are
followed through weak references to the storages (DeepSpeed often frees by `tensor.data = ...`, which the tensor
object's own lifetime would miss), so the trace knows what each site held at once, and at the trace's peak.
`census()` lists every large storage that live tensors hold now (`gc`), to check the running count.
`MemoryProbe` samples the process's memory from a thread and keeps its breakdown at the RSS peak and at each phase
end: anonymous / file / shared RSS, locked and pinned pages (/proc/self/status), torch's page-locked host allocator
(allocated vs reserved: it rounds a request up to a power of two and caches freed blocks) and what the trace holds, so
the part of a peak that no storage explains can be split up.
"""

from __future__ import annotations

import gc
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = []

_SKIP = ("/torch/", "/helpers/host_trace.py", "/contextlib.py", "/functools.py")


def site_of_caller(depth: int = 2) -> str:
    """'deepspeed/<path>:<line> <function>' of the innermost DeepSpeed frame above this call, else the innermost frame
    outside torch (transformers', the course's)."""
    frame = sys._getframe(depth)
    fallback = ""
    while frame is not None:
        path = frame.f_code.co_filename
        if "/deepspeed/" in path:
            return f"deepspeed/{path.rsplit('/deepspeed/', 1)[1]}:{frame.f_lineno} {frame.f_code.co_name}"
        if not fallback and not any(s in path for s in _SKIP):
            short = path.rsplit("/site-packages/", 1)[-1]
            short = "helpers/" + short.rsplit("/helpers/", 1)[-1] if "/helpers/" in short else short
            fallback = f"{short}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback or "?"


@dataclass
class TracedAllocation:
    """One large storage, first seen as an operator's output."""

    site: str
    op: str
    dtype: str
    nbytes: int
    phase: str
    pinned: bool
    freed_in: str = ""  # the phase in which its storage was freed ("" while alive)


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


@dataclass
class HostAllocationTrace:
    """Record every new storage of >= `threshold_bytes` on the host ("cpu" tensors; `devices` widens it).

    Use as a context manager around the run; call `set_phase` as the run moves on (train_run's on_phase/on_step)."""

    threshold_bytes: int = 1_000_000
    devices: tuple[str, ...] = ("cpu",)
    phase: str = "start"
    allocations: list[TracedAllocation] = field(default_factory=list)
    live_bytes: int = 0
    peak_live_bytes: int = 0
    peak_phase: str = ""
    peak_live: dict[str, int] = field(default_factory=dict)  # site -> bytes alive at the peak
    site_max: dict[str, int] = field(default_factory=dict)  # site -> the most bytes it held alive at once
    at_phase_end: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> {site: bytes alive as it ended}
    _seen: dict[int, TracedAllocation] = field(default_factory=dict)  # data_ptr -> its allocation, while alive
    _refs: dict[int, Any] = field(default_factory=dict)  # data_ptr -> a weak reference to its storage
    _site_live: dict[str, int] = field(default_factory=dict)
    _mode: Any = None

    def __enter__(self) -> "HostAllocationTrace":
        from torch.utils._python_dispatch import TorchDispatchMode

        trace = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                try:
                    for t in _tensors(out):
                        trace._saw(t, func)
                except Exception:  # noqa: BLE001 - a probe must never break the run it measures
                    pass
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._purge()
        self._mode.__exit__(*exc)
        self._mode = None

    def set_phase(self, phase: str) -> None:
        """The run moved on (train_run's on_phase / on_step): what is alive now is kept as the ending phase's state."""
        self._purge()
        self.at_phase_end[self.phase] = self._live_by_site()
        self.phase = phase

    def _saw(self, t: Any, func: Any) -> None:
        if t.device.type not in self.devices:
            return
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self.threshold_bytes:
            return
        self._purge()
        ptr = storage.data_ptr()
        if ptr in self._seen:
            return
        from torch.multiprocessing.reductions import StorageWeakRef

        a = TracedAllocation(site=site_of_caller(3), op=str(func.overloadpacket.__name__), dtype=str(t.dtype)[6:],
                             nbytes=nbytes, phase=self.phase, pinned=bool(t.is_pinned()))
        self.allocations.append(a)
        self._seen[ptr] = a
        self._refs[ptr] = StorageWeakRef(storage)
        self.live_bytes += nbytes
        self._site_live[a.site] = self._site_live.get(a.site, 0) + nbytes
        self.site_max[a.site] = max(self.site_max.get(a.site, 0), self._site_live[a.site])
        if self.live_bytes > self.peak_live_bytes:
            self.peak_live_bytes = self.live_bytes
            self.peak_phase = self.phase
            self.peak_live = self._live_by_site()

    def _purge(self) -> None:
        """Book the storages that no tensor holds any more as freed, in the current phase."""
        for ptr in [p for p, ref in self._refs.items() if ref.expired()]:
            a = self._seen.pop(ptr)
            del self._refs[ptr]
            a.freed_in = self.phase
            self.live_bytes -= a.nbytes
            self._site_live[a.site] -= a.nbytes

    def _live_by_site(self) -> dict[str, int]:
        return {site: n for site, n in self._site_live.items() if n > 0}

    def by_site(self) -> list[dict[str, Any]]:
        """One row per allocation site, largest first: dtype(s), how many storages, bytes allocated in all, the most
        alive at once, alive at the trace's peak, and the phase it first allocated in."""
        rows: dict[str, dict[str, Any]] = {}
        for a in self.allocations:
            r = rows.setdefault(a.site, {"site": a.site, "dtypes": [], "count": 0, "allocated_bytes": 0,
                                         "first_phase": a.phase, "pinned": False})
            if a.dtype not in r["dtypes"]:
                r["dtypes"].append(a.dtype)
            r["count"] += 1
            r["allocated_bytes"] += a.nbytes
            r["pinned"] = r["pinned"] or a.pinned
        for site, r in rows.items():
            r["max_alive_bytes"] = self.site_max.get(site, 0)
            r["alive_at_peak_bytes"] = self.peak_live.get(site, 0)
        return sorted(rows.values(), key=lambda r: -r["max_alive_bytes"])

    def as_dict(self) -> dict[str, Any]:
        return {"threshold_bytes": self.threshold_bytes, "peak_live_bytes": self.peak_live_bytes,
                "peak_phase": self.peak_phase, "sites": self.by_site(), "at_phase_end": self.at_phase_end}


def census(threshold_bytes: int = 1_000_000, devices: tuple[str, ...] = ("cpu",)) -> dict[int, int]:
    """{storage data_ptr: bytes} of every storage of >= `threshold_bytes` that a live tensor holds now."""
    import torch

    out: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type in devices:
                s = obj.untyped_storage()
                if s.nbytes() >= threshold_bytes:
                    out[s.data_ptr()] = s.nbytes()
        except Exception:  # noqa: BLE001 - fake or freed tensors
            continue
    return out


_STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin")


def _status_bytes() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in _STATUS_FIELDS:
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _pinned_allocator_bytes() -> dict[str, int]:
    """torch's CUDA host (page-locked) allocator: bytes handed out now and bytes it holds (blocks, rounded, cached)."""
    try:
        import torch

        if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
            return {}
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - a probe must never break the run it measures
        return {}
    return {"pinned_allocated": int(stats.get("allocated_bytes.current", 0)),
            "pinned_reserved": int(stats.get("reserved_bytes.current", 0))}


def memory_snapshot(trace: HostAllocationTrace | None = None) -> dict[str, Any]:
    """This process's memory now: /proc/self/status's RSS parts, torch's pinned allocator, the trace's live bytes."""
    snap: dict[str, Any] = {**_status_bytes(), **_pinned_allocator_bytes()}
    if trace is not None:
        snap["traced_live"] = trace.live_bytes
        snap["phase"] = trace.phase
    return snap


@dataclass
class MemoryProbe:
    """Sample RSS every `interval_s` from a thread; keep `memory_snapshot` at the RSS peak and at each phase end.

    The trace's live count is read as the sampler sees it (its frees are booked at the trace's next large allocation
    or phase change), so at a peak it may still count a storage freed a moment before."""

    trace: HostAllocationTrace | None = None
    interval_s: float = 0.02
    at_peak: dict[str, Any] = field(default_factory=dict)
    at_phase_end: dict[str, dict[str, Any]] = field(default_factory=dict)
    _peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "MemoryProbe":
        self._thread = threading.Thread(target=self._run, name="memory-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()

    def sample(self) -> None:
        rss = _status_bytes().get("VmRSS", 0)
        if rss > self._peak_rss:
            self._peak_rss = rss
            self.at_peak = memory_snapshot(self.trace)

    def phase_ended(self, phase: str) -> None:
        self.sample()
        self.at_phase_end[phase] = memory_snapshot(self.trace)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001
                pass

    def as_dict(self) -> dict[str, Any]:
        return {"at_rss_peak": self.at_peak, "at_phase_end": self.at_phase_end}
