"""What this runtime can move and compute per second: the inputs of the step-time model (notebook 02).

    limits = helpers.measure_limits(nvme_path="/content/nvme")   # a few seconds each, cached per runtime
    print(limits.table())

Measured, never assumed:
- disk: read and write bandwidth of the NVMe folder through DeepSpeed's own async I/O handle (the `aio` op that
  ZeRO-Infinity swaps with; O_DIRECT, so the page cache does not flatter it), with the config's `aio` settings;
- PCIe: host-to-GPU and GPU-to-host copies, from pinned and from pageable (ordinary) memory;
- CPU Adam: parameters per second that DeepSpeedCPUAdam updates on the cores this process may use;
- GPU matmul: fp16 (bf16/fp32 as the runtime trains) TFLOP/s of a large square matmul; on a CPU runtime the CPU's.
Units: GB/s = 1e9 bytes per second (disks and links are sold in them); TFLOP/s = 1e12 per second.
Results are cached as JSON under ~/.cache/ds-course/ (one file per runtime label and disk); `refresh=True` measures again.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["RuntimeLimits", "measure_cpu_adam", "measure_disk", "measure_limits", "measure_matmul", "measure_pcie"]

GB = 1e9
CACHE_DIR = Path(os.environ.get("DS_COURSE_CACHE", Path.home() / ".cache" / "ds-course"))
# DeepSpeed 0.19.8's aio keys and defaults (runtime/swap_tensor/constants.py); "thread_count" of older releases is
# not read any more: the thread count is "intra_op_parallelism"
AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True}


@dataclass
class RuntimeLimits:
    """Measured bandwidths and throughputs of one runtime (GB/s, TFLOP/s, parameters/s); None where not measurable."""

    runtime: str
    cpus: int
    has_gpu: bool = True
    disk_path: str | None = None
    disk_read_gbps: float | None = None
    disk_write_gbps: float | None = None
    aio: dict[str, Any] = field(default_factory=dict)
    h2d_pinned_gbps: float | None = None
    h2d_pageable_gbps: float | None = None
    d2h_pinned_gbps: float | None = None
    d2h_pageable_gbps: float | None = None
    cpu_adam_params_per_s: float | None = None
    matmul_tflops: float | None = None
    matmul_dtype: str = ""
    seconds: dict[str, float] = field(default_factory=dict)  # what each measurement took
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RuntimeLimits":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def table(self) -> str:
        """The limits as aligned text lines (notebook 02)."""
        def f(v: float | None, unit: str, scale: float = 1.0) -> str:
            return "not measured" if v is None else f"{v / scale:,.2f} {unit}"

        rows = [("disk read (DeepSpeed aio)", f(self.disk_read_gbps, "GB/s")),
                ("disk write (DeepSpeed aio)", f(self.disk_write_gbps, "GB/s")),
                ("host -> GPU, pinned", f(self.h2d_pinned_gbps, "GB/s")),
                ("host -> GPU, pageable", f(self.h2d_pageable_gbps, "GB/s")),
                ("GPU -> host, pinned", f(self.d2h_pinned_gbps, "GB/s")),
                ("GPU -> host, pageable", f(self.d2h_pageable_gbps, "GB/s")),
                (f"CPU Adam ({self.cpus} CPU{'s' if self.cpus != 1 else ''})",
                 f(self.cpu_adam_params_per_s, "M params/s", 1e6)),
                (f"matmul ({self.matmul_dtype or '-'})", f(self.matmul_tflops, "TFLOP/s"))]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines + [f"({n})" for n in self.notes])


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_disk(path: str | os.PathLike[str], *, size_bytes: int = 1 << 30, buffer_bytes: int = 256 << 20,
                 aio: dict[str, Any] | None = None) -> tuple[float, float]:
    """(read GB/s, write GB/s) of folder `path` through DeepSpeed's async I/O handle (notebook 02's NVMe folder).

    Writes a `size_bytes` file in `buffer_bytes` pieces from one pinned buffer (the way ZeRO-Infinity swaps:
    O_DIRECT, `aio` = the config's "aio" section), reads it back, and removes it. Needs the async_io op
    (libaio: `apt-get install libaio-dev`); raises RuntimeError with that fix when it cannot load.
    """
    import torch

    settings = {**AIO_DEFAULTS, **{k: v for k, v in (aio or {}).items() if k in AIO_DEFAULTS}}
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        op = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - the op builder raises several kinds
        raise RuntimeError(f"DeepSpeed's async_io op could not load ({exc}). Fix: apt-get install libaio-dev, "
                           "then run `ds_report` to check that async_io is [OKAY].") from exc
    handle = op.aio_handle(settings["block_size"], settings["queue_depth"], settings["single_submit"],
                           settings["overlap_events"], settings["intra_op_parallelism"])
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f".ds-course-disk-probe-{os.getpid()}"
    pieces = max(1, size_bytes // buffer_bytes)
    buffer = torch.empty(buffer_bytes, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() else \
        handle.new_cpu_locked_tensor(buffer_bytes, torch.empty(0, dtype=torch.uint8))
    buffer.fill_(7)
    try:
        t = time.perf_counter()
        for i in range(pieces):
            handle.sync_pwrite(buffer, str(target), i * buffer_bytes)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(pieces):
            handle.sync_pread(buffer, str(target), i * buffer_bytes)
        read_s = time.perf_counter() - t
    finally:
        target.unlink(missing_ok=True)
        if not torch.cuda.is_available():
            handle.free_cpu_locked_tensor(buffer)
    moved = pieces * buffer_bytes
    return moved / read_s / GB, moved / write_s / GB


def _copy_seconds(dst: Any, src: Any, repeats: int, non_blocking: bool) -> float:
    import torch

    def copy() -> None:
        dst.copy_(src, non_blocking=non_blocking)
        torch.cuda.synchronize()

    return _timed(copy, repeats)


def measure_pcie(size_bytes: int = 256 << 20, repeats: int = 3) -> dict[str, float]:
    """GB/s of host-to-GPU and GPU-to-host copies from pinned and pageable memory (needs a GPU)."""
    import torch

    n = size_bytes // 2
    gpu = torch.empty(n, dtype=torch.float16, device="cuda")
    out: dict[str, float] = {}
    for kind in ("pinned", "pageable"):
        host = torch.ones(n, dtype=torch.float16)
        if kind == "pinned":
            host = host.pin_memory()
        out[f"h2d_{kind}_gbps"] = size_bytes / _copy_seconds(gpu, host, repeats, kind == "pinned") / GB
        out[f"d2h_{kind}_gbps"] = size_bytes / _copy_seconds(host, gpu, repeats, kind == "pinned") / GB
    del gpu
    torch.cuda.empty_cache()
    return out


def measure_cpu_adam(n_params: int = 16_000_000, repeats: int = 5) -> float:
    """Parameters per second that DeepSpeedCPUAdam updates (fp32 states, AdamW) on this process's cores.

    Builds DeepSpeed's cpu_adam op on first use (the same build CPU offload needs; minutes on 2 cores, then cached).
    """
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from helpers.runtime import announce_op_builds

    announce_op_builds()
    p = torch.nn.Parameter(torch.zeros(n_params))
    p.grad = torch.full_like(p, 1e-3)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    seconds = _timed(opt.step, repeats)
    del opt, p
    return n_params / seconds


def measure_matmul(dtype: str = "fp16", size: int = 8192, repeats: int = 5) -> float:
    """TFLOP/s of a `size` x `size` matmul in `dtype` on the GPU (on the CPU, fp32 at size 1024, without a GPU)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        dtype, size = "fp32", min(size, 1024)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a = torch.randn(size, size, dtype=torch_dtype, device=device)
    b = torch.randn(size, size, dtype=torch_dtype, device=device)

    def mm() -> None:
        for _ in range(4):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()

    seconds = _timed(mm, repeats) / 4
    return 2 * size**3 / seconds / 1e12


def _measure_disk_in_child(path: str, aio: dict[str, Any] | None) -> tuple[float, float]:
    """`measure_disk` in a fresh Python. Inside a notebook kernel DeepSpeed's async_io op can refuse to load:
    its compatibility check (`AsyncIOBuilder.is_compatible`) redirects stderr's file descriptor while it compiles a
    test program and answers False on any exception; a child process has clean stdio (see
    `helpers.async_io_available`)."""
    import subprocess
    import sys

    code = ("import json, sys; from helpers.limits import measure_disk; "
            f"print('DISK ' + json.dumps(measure_disk({path!r}, aio={aio or {}!r})))")
    root = str(Path(__file__).resolve().parent.parent)  # the course: the child imports helpers from it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DISK ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(tail)
    read, write = json.loads(lines[-1][5:])
    return read, write


def _cache_file(label: str, disk_path: str | None) -> Path:
    device = ""
    if disk_path:
        try:
            device = f"-dev{os.stat(Path(disk_path) if Path(disk_path).exists() else Path(disk_path).parent).st_dev}"
        except OSError:
            device = ""
    safe = "".join(c if c.isalnum() else "_" for c in label)[:80]
    return CACHE_DIR / f"limits-{safe}{device}.json"


def measure_limits(nvme_path: str | os.PathLike[str] | None = None, *, runtime: Any = None,
                   aio: dict[str, Any] | None = None, refresh: bool = False, cache: bool = True,
                   cpu_adam: bool = True) -> RuntimeLimits:
    """Measure (or read from the cache) this runtime's limits; the disk only when `nvme_path` is given (notebook 02).

    Each measurement takes a few seconds (the first CPU Adam measurement also builds DeepSpeed's cpu_adam op).
    A measurement that cannot run here is left None with a note saying why.
    """
    from helpers.hardware import detect_runtime, usable_cpus

    runtime = runtime or detect_runtime()
    disk = str(nvme_path) if nvme_path else None
    path = _cache_file(runtime.label, disk)
    if cache and not refresh and path.exists():
        try:
            got = RuntimeLimits.from_dict(json.loads(path.read_text()))
            if got.runtime == runtime.label and got.disk_path == disk and (got.aio == {**AIO_DEFAULTS, **(aio or {})}
                                                                            or not disk):
                return got
        except (OSError, ValueError, TypeError):
            pass
    limits = RuntimeLimits(runtime=runtime.label, cpus=usable_cpus(), has_gpu=runtime.has_gpu, disk_path=disk,
                           aio={**AIO_DEFAULTS, **(aio or {})} if disk else {})

    def run(name: str, fn: Callable[[], None]) -> None:
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a limit that cannot be measured here is a note, not a failure
            limits.notes.append(f"{name} not measured: {str(exc).splitlines()[0][:200]}")
        limits.seconds[name] = round(time.perf_counter() - t, 2)

    if disk:
        def disk_fn() -> None:
            limits.disk_read_gbps, limits.disk_write_gbps = (round(v, 3) for v in _measure_disk_in_child(disk, aio))
        run("disk", disk_fn)
    if runtime.has_gpu:
        def pcie_fn() -> None:
            for k, v in measure_pcie().items():
                setattr(limits, k, round(v, 2))
        run("pcie", pcie_fn)
    else:
        limits.notes.append("no GPU: no PCIe copies to measure")
    if cpu_adam:
        def adam_fn() -> None:
            limits.cpu_adam_params_per_s = round(measure_cpu_adam(), -3)
        run("cpu_adam", adam_fn)

    def matmul_fn() -> None:
        dtype = runtime.precision if runtime.has_gpu else "fp32"
        limits.matmul_dtype = dtype if runtime.has_gpu else "fp32 (CPU)"
        limits.matmul_tflops = round(measure_matmul(dtype), 3)
    run("matmul", matmul_fn)
    if cache:
        from helpers.atomic import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(limits.as_dict(), indent=1)
        write_atomically(path, lambda tmp: tmp.write_text(text))
    return limits


def _main(argv: list[str] | None = None) -> int:
    """`python -c "from helpers.limits import _main; _main()" [--nvme PATH] [--out FILE] [--refresh]`: measure and
    print (benchmarks/offload_speed.py runs it inside a Colab enclosure, so that CPU Adam gets the enclosure's CPUs)."""
    import argparse

    p = argparse.ArgumentParser(description="Measure this runtime's disk, PCIe, CPU Adam and matmul rates.")
    p.add_argument("--nvme", default=None, help="the NVMe folder to measure (none: no disk measurement)")
    p.add_argument("--aio", default="{}", help="the config's aio section, as JSON")
    p.add_argument("--out", default=None, help="also write the limits to this JSON file")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    args = p.parse_args(argv)
    limits = measure_limits(args.nvme, aio=json.loads(args.aio), refresh=args.refresh)
    print(limits.table())
    if args.out:
        Path(args.out).write_text(json.dumps(limits.as_dict(), indent=1))
    return 0

