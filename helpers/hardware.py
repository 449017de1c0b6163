"""What this runtime has: GPU, VRAM, RAM, disk, Colab or not, and the precision to train in.

Used from notebook 00 onwards. A *T4 budget mode* emulates a free Colab T4 on a larger GPU:
VRAM capped at 15 GiB, fp16 forced (a T4 has no native bf16), CPU RAM reported against 12.7 GB.
Switch it on with ``detect_runtime(t4_budget=True)`` or the environment variable
``DS_COURSE_T4_BUDGET=1``.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

GiB = 1024**3
GB = 1000**3
T4_VRAM_GIB = 15.0  # what a Colab T4 lets PyTorch allocate
COLAB_RAM_GB = 12.7  # free Colab's system RAM
T4_BUDGET_ENV = "DS_COURSE_T4_BUDGET"
BF16_MIN_CAPABILITY = (8, 0)  # Ampere and newer have native bf16

T = TypeVar("T")


class NoGPUError(RuntimeError):
    """Raised by `require_gpu` when a step needs CUDA and there is none."""


@dataclass(frozen=True)
class Runtime:
    """The hardware budget a notebook works within (notebook 00)."""

    device: str  # "cuda" or "cpu"
    gpu_name: str | None
    compute_capability: tuple[int, int] | None
    gpu_total_bytes: int  # physical VRAM of GPU 0 (0 on CPU)
    vram_budget_bytes: int  # what this course lets itself use (15 GiB in T4 budget mode)
    ram_total_bytes: int
    ram_budget_bytes: int  # 12.7 GB in T4 budget mode or on Colab
    disk_free_bytes: int
    cpu_cores: int
    gpu_count: int
    is_colab: bool
    t4_budget: bool
    precision: str  # "fp16", "bf16" or "fp32"
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def has_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def native_bf16(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= BF16_MIN_CAPABILITY

    @property
    def label(self) -> str:
        """Label written next to every measured number, e.g. 'H200 capped to T4 budget'."""
        if not self.has_gpu:
            return f"CPU only ({self.cpu_cores} cores)"
        short = (self.gpu_name or "GPU").replace("NVIDIA ", "").replace("Tesla ", "")
        if self.t4_budget:
            return f"{short} capped to T4 budget"
        return f"Colab {short}" if self.is_colab else short

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        d["native_bf16"] = self.native_bf16
        return d

    def summary_rows(self) -> list[tuple[str, str]]:
        """(what, value) rows for a printed table."""
        cc = ".".join(map(str, self.compute_capability)) if self.compute_capability else "-"
        rows = [
            ("runtime", self.label),
            ("GPU", f"{self.gpu_name} x{self.gpu_count} (compute capability {cc})" if self.has_gpu else "none"),
            ("VRAM budget", f"{self.vram_budget_bytes / GiB:.1f} GiB" + (
                f" of {self.gpu_total_bytes / GiB:.1f} GiB physical" if self.has_gpu else "")),
            ("CPU RAM budget", f"{self.ram_budget_bytes / GB:.1f} GB of {self.ram_total_bytes / GB:.1f} GB"),
            ("free disk", f"{self.disk_free_bytes / GB:.1f} GB"),
            ("precision", self.precision + ("" if not self.has_gpu else
                                            f" (native bf16: {'yes' if self.native_bf16 else 'no'})")),
        ]
        return rows

    def __str__(self) -> str:
        width = max(len(k) for k, _ in self.summary_rows())
        lines = [f"{k:<{width}}  {v}" for k, v in self.summary_rows()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def t4_budget_requested(t4_budget: bool | None = None) -> bool:
    """The explicit parameter wins; otherwise DS_COURSE_T4_BUDGET=1/true/yes switches it on."""
    if t4_budget is not None:
        return bool(t4_budget)
    return os.environ.get(T4_BUDGET_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def in_colab() -> bool:
    """True inside a Google Colab kernel."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def choose_precision(compute_capability: tuple[int, int] | None, t4_budget: bool = False) -> str:
    """fp32 on CPU; fp16 below compute capability 8.0 (e.g. T4) or in T4 budget mode; bf16 otherwise."""
    if compute_capability is None:
        return "fp32"
    if t4_budget or tuple(compute_capability) < BF16_MIN_CAPABILITY:
        return "fp16"
    return "bf16"


def apply_t4_budget(device_index: int = 0) -> int:
    """Cap this process's CUDA caching allocator at 15 GiB; returns the cap in bytes (0 on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    total = torch.cuda.get_device_properties(device_index).total_memory
    cap = int(min(T4_VRAM_GIB * GiB, total))
    torch.cuda.set_per_process_memory_fraction(cap / total, device_index)
    return cap


def _ram_total_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is in requirements
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def detect_runtime(t4_budget: bool | None = None, disk_path: str = ".") -> Runtime:
    """Look at this machine (notebook 00); in T4 budget mode also cap VRAM at 15 GiB."""
    import torch

    budget = t4_budget_requested(t4_budget)
    notes: list[str] = []
    ram_total = _ram_total_bytes()
    colab = in_colab()
    disk_free = shutil.disk_usage(disk_path).free
    cores = os.cpu_count() or 1
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cc = (props.major, props.minor)
        total = int(props.total_memory)
        vram_budget = apply_t4_budget(0) if budget else total
        if budget:
            notes.append(f"T4 budget mode: VRAM capped at {T4_VRAM_GIB:g} GiB, fp16 forced, "
                         f"RAM reported against {COLAB_RAM_GB} GB")
        if cc < BF16_MIN_CAPABILITY:
            notes.append(f"compute capability {cc[0]}.{cc[1]} < 8.0: no native bf16, training uses fp16 "
                         "(torch.cuda.is_bf16_supported() may still say True through emulation)")
        return Runtime(
            device="cuda", gpu_name=props.name, compute_capability=cc, gpu_total_bytes=total,
            vram_budget_bytes=vram_budget, ram_total_bytes=ram_total,
            ram_budget_bytes=int(COLAB_RAM_GB * GB) if (budget or colab) else ram_total,
            disk_free_bytes=disk_free, cpu_cores=cores, gpu_count=torch.cuda.device_count(),
            is_colab=colab, t4_budget=budget, precision=choose_precision(cc, budget), notes=tuple(notes))
    if budget:
        notes.append("T4 budget mode asked for, but there is no GPU: running CPU-sized instead")
    notes.append("no GPU: DeepSpeed runs on CPU over gloo in fp32 (smoke-sized); "
                 "in Colab pick Runtime > Change runtime type > T4 GPU")
    return Runtime(
        device="cpu", gpu_name=None, compute_capability=None, gpu_total_bytes=0, vram_budget_bytes=0,
        ram_total_bytes=ram_total, ram_budget_bytes=int(COLAB_RAM_GB * GB) if colab else ram_total,
        disk_free_bytes=disk_free, cpu_cores=cores, gpu_count=0, is_colab=colab, t4_budget=False,
        precision="fp32", notes=tuple(notes))


def colab_t4_profile(disk_free_gb: float = 70.0) -> Runtime:
    """The free Colab T4 runtime as numbers, for what-if checks on any machine (notebook 02)."""
    return Runtime(device="cuda", gpu_name="Tesla T4", compute_capability=(7, 5),
                   gpu_total_bytes=int(T4_VRAM_GIB * GiB), vram_budget_bytes=int(T4_VRAM_GIB * GiB),
                   ram_total_bytes=int(COLAB_RAM_GB * GB), ram_budget_bytes=int(COLAB_RAM_GB * GB),
                   disk_free_bytes=int(disk_free_gb * GB), cpu_cores=2, gpu_count=1, is_colab=True, t4_budget=False,
                   precision="fp16", notes=("what-if profile of a free Colab T4, not this machine",))


def require_gpu(runtime: Runtime, what: str = "this step") -> None:
    """Raise NoGPUError with the fix when `runtime` has no CUDA GPU."""
    if not runtime.has_gpu:
        raise NoGPUError(
            f"{what} needs a CUDA GPU and this runtime has none. Fix: in Colab choose "
            "Runtime > Change runtime type > T4 GPU and run the notebook again; locally, install a CUDA "
            "build of torch (python -c 'import torch; print(torch.cuda.is_available())' must print True).")


def sized(gpu: T, cpu: T, runtime: Runtime | None = None) -> T:
    """Pick the full-size value on a GPU and the smoke-size value on CPU (every notebook's parameters)."""
    if runtime is None:
        import torch

        has_gpu = torch.cuda.is_available()
    else:
        has_gpu = runtime.has_gpu
    return gpu if has_gpu else cpu
