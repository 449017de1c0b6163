"""What this runtime has: GPU, VRAM, RAM, disk, Colab or not, and the precision to train in.

Used from notebook 00 onwards. RAM and CPUs are the ones this process may really use: a cgroup memory limit
or CPU quota (Kaggle, Docker, `scripts/colab_emulation.py`) counts, not only what the machine has.

Two ways to stand in for a free Colab T4 on a bigger GPU:
- *T4 budget mode* (``DS_COURSE_T4_BUDGET=1`` or ``detect_runtime(t4_budget=True)``): PyTorch's allocator capped at
  what a T4 leaves it (``T4_VRAM_GIB``: `t4_budget_account` says why), fp16 forced (a T4 has no native bf16),
  attention on the SDPA kernel a T4 has (no flash, no cuDNN), CPU RAM judged against Colab's budget but not enforced.
- *the Colab profile* (``DS_COURSE_COLAB=1``, set by ``scripts/colab_emulation.py``): T4 budget mode, and the
  notebooks take their Colab branches (Colab sizes, big runs in child processes, nothing over budget). The runner
  also enforces the RAM and the CPUs with a cgroup, which this module reads back. Without a GPU the profile keeps
  Colab's RAM budget, its NVMe disk budget (COLAB_NVME_BUDGET_BYTES, which `plan` uses too) and the Colab branches;
  there is no T4 VRAM budget (no GPU to cap) and training runs in fp32 on the CPU, as the runtime's notes say.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

__all__ = ["T4_VRAM_GIB", "apply_t4_budget", "choose_precision", "colab_t4_profile", "default_nvme_path",
           "detect_runtime", "smoke_size", "t4_budget_account", "t4_budget_requested"]

GiB = 1024**3
GB = 1000**3
# What a T4 leaves PyTorch's caching allocator: the card's memory less what sits outside the allocator in a course
# process (issue 51). The emulation caps the allocator at T4_VRAM_GIB (`apply_t4_budget`); the estimator, `preflight`,
# the planner and every chart judge against the same number. The planner's own safety margin is not in it: it is
# planner.GPU_TIGHT_MARGIN, shown in each verdict and chart.
# - The card: 15,843,721,216 bytes = 14.76 GiB (CUDA samples' deviceQuery on a Tesla T4: "Total amount of global
#   memory: 15110 MBytes (15843721216 bytes)", 40 SMs, 1024 threads per SM). TensorFlow on Colab's T4 logs
#   "deviceMemorySize: 14.73GiB" (googlecolab/colabtools#1749); torch.cuda.get_device_properties(0) there prints
#   total_memory=15102MB.
T4_TOTAL_BYTES = 15_843_721_216
# - What PyTorch is given of it: cudaMemGetInfo's total, as PyTorch's out-of-memory message prints it on Colab and
#   Kaggle T4s: "GPU 0 has a total capacity of 14.74 GiB".
T4_TORCH_TOTAL_GIB = 14.74
# - The CUDA context (driver state, the per-SM local-memory reservation, cuBLAS's workspace, loaded kernels) sits
#   outside PyTorch's allocator, and set_per_process_memory_fraction caps only the allocator: on a bigger GPU the cap
#   alone would hand the context out for free. Measured on real T4s (torch 2.x), from four public out-of-memory
#   messages as "this process has X in use" less (allocated + reserved but unallocated by PyTorch): 14.74 - (14.31 +
#   0.31) = 0.12 GiB (Kaggle), 14.37 - (12.77 + 1.45) = 0.15, 13.49 - (12.27 + 1.09) = 0.13, 11.75 - (11.35 + 0.25)
#   = 0.15; the upper end is taken. An H100's context is larger (0.60 GiB outside the allocator after one small
#   tensor, 0.67 after a cuBLAS matmul, torch 2.11: reports/cuda_context.json): the local-memory reservation scales
#   with SMs x resident threads (T4 40 x 1024, H100 132 x 2048: 6.6x), so an H100's or H200's figure does not transfer
#   to a T4. A T4's may differ with the CUDA and driver versions (lazy module loading, CUDA_MODULE_LOADING) and with libraries that keep caches outside the
#   allocator (a cuFFT plan cache showed 1.67 GiB in one such message: not the context, and the course uses none).
T4_CUDA_CONTEXT_GIB = 0.15
# - A course process also runs DeepSpeed: an NCCL communicator even on one GPU, its ops' kernels, more CUDA modules
#   loaded lazily. Measured (H200, 2026-12-06, benchmarks/cuda_context.py --nccl-variants, reports/cuda_context.md):
#   one ZeRO-2 fp16 step through deepspeed.initialize adds 0.990 GiB outside the allocator with NCCL's default
#   channel count, 0.252 GiB with NCCL_MAX_NCHANNELS=1 (NCCL_BUFFSIZE changed nothing; NCCL_CUMEM_ENABLE=0 added
#   0.24). helpers.runtime.setup_single_process sets NCCL_MAX_NCHANNELS=1 for a world of one, so ~0.25 GiB transfers:
#   the code share plus one channel (an upper bound for NCCL's part: a T4 has fewer SMs than an H200).
T4_DEEPSPEED_ALLOWANCE_GIB = 0.25
T4_VRAM_GIB = round(T4_TORCH_TOTAL_GIB - T4_CUDA_CONTEXT_GIB - T4_DEEPSPEED_ALLOWANCE_GIB, 2)  # 14.34
# Colab's RAM meter says "12.7 GB" and means GiB: psutil reports 13.6e9 bytes on a free VM (googlecolab/colabtools#2290).
COLAB_VM_RAM_BYTES = int(12.7 * GiB)
# Colab's own processes: a fresh VM shows 0.9-1.4 of those GB in use before a cell runs
# (linux-blog.anracom.com, "Google Colab, RAM, VRAM and GPU usage limits"); the upper end is reserved.
COLAB_RESERVED_BYTES = int(1.4 * GiB)
COLAB_RAM_BUDGET_BYTES = COLAB_VM_RAM_BYTES - COLAB_RESERVED_BYTES  # what a notebook and its children may use
COLAB_RAM_GB = round(COLAB_RAM_BUDGET_BYTES / GB, 2)  # 12.13
COLAB_CPUS = 2  # free Colab's vCPUs
COLAB_NVME_BUDGET_BYTES = 60 * GB  # what the course lets an NVMe folder take on Colab's disk (~78 GB free on a fresh VM)
NVME_DIR_ENV = "DS_COURSE_NVME_DIR"  # where the notebooks put their NVMe folders (scripts/colab_emulation.py sets it)
T4_BUDGET_ENV = "DS_COURSE_T4_BUDGET"
COLAB_PROFILE_ENV = "DS_COURSE_COLAB"
EMULATION_ENV = "DS_COURSE_EMULATION"  # set by scripts/colab_emulation.py: how the limits are enforced
BF16_MIN_CAPABILITY = (8, 0)  # Ampere and newer have native bf16
T4_MISSING_ATTENTION_KERNELS_FROM = (8, 0)  # SDPA's flash and cuDNN kernels: what a T4 (7.5) lacks

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
    vram_budget_bytes: int  # what this course lets itself use (T4_VRAM_GIB in T4 budget mode)
    ram_total_bytes: int  # what this process may use: the machine's RAM, or its cgroup limit if smaller
    ram_budget_bytes: int  # what the course lets itself use (Colab's 12.1 GB on Colab and in T4 budget mode)
    disk_free_bytes: int
    cpu_cores: int  # CPUs this process may use (affinity and cgroup quota)
    gpu_count: int
    is_colab: bool  # on Colab, or in the Colab profile: the notebooks take their Colab branches
    t4_budget: bool
    precision: str  # "fp16", "bf16" or "fp32"
    notes: tuple[str, ...] = field(default_factory=tuple)
    ram_limit: str = "physical"  # where ram_total_bytes comes from: "physical", "cgroup v2", "cgroup v1"
    emulation: str = ""  # Colab profile on a bigger machine: how it is enforced ("cgroup v2", "watchdog", "none")

    @property
    def has_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def native_bf16(self) -> bool:
        return self.compute_capability is not None and self.compute_capability >= BF16_MIN_CAPABILITY

    @property
    def label(self) -> str:
        """Label written next to every measured number, e.g. 'H200 capped to T4 budget (14.34 GiB)' (reports
        measured before issue 51 say 'H200 capped to T4 budget': the earlier 15 GiB cap)."""
        if not self.has_gpu:
            return f"CPU only ({self.cpu_cores} cores)"
        short = (self.gpu_name or "GPU").replace("NVIDIA ", "").replace("Tesla ", "")
        if self.emulation:
            if self.emulation == "none":
                return f"{short} in Colab T4 profile (RAM and CPUs not enforced)"
            how = "enforced" if self.emulation.startswith("cgroup") else f"held by a {self.emulation}"
            return (f"{short} in Colab T4 emulation ({self.vram_budget_bytes / GiB:g} GiB VRAM, "
                    f"{self.ram_total_bytes / GB:.1f} GB RAM {how}, {self.cpu_cores} CPUs)")
        if self.t4_budget:
            return f"{short} capped to T4 budget ({self.vram_budget_bytes / GiB:g} GiB)"
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
            ("VRAM budget", f"{self.vram_budget_bytes / GiB:.2f} GiB" + (
                f" of {self.gpu_total_bytes / GiB:.2f} GiB physical" if self.has_gpu else "")),
            ("CPU RAM budget", f"{self.ram_budget_bytes / GB:.1f} GB of {self.ram_total_bytes / GB:.1f} GB"
             + ("" if self.ram_limit == "physical" else f" ({self.ram_limit} limit)")),
            ("CPUs", str(self.cpu_cores)),
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
    """The explicit parameter (True or False) wins; otherwise DS_COURSE_T4_BUDGET=1/true/yes switches it on
    (notebook 03). Anything else as the parameter is refused (issue 41: T4_BUDGET = 'no' was taken as True)."""
    if t4_budget is not None:
        if not isinstance(t4_budget, bool):
            raise ValueError(f"T4_BUDGET = {t4_budget!r}: it takes True (keep a Colab T4's memory budget on a bigger "
                             "GPU), False (use the whole GPU) or None (follow DS_COURSE_T4_BUDGET). Fix: T4_BUDGET = "
                             f"{'True' if str(t4_budget).strip().lower() in {'1', 'true', 'yes', 'on'} else 'False'}")
        return t4_budget
    return os.environ.get(T4_BUDGET_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def in_colab() -> bool:
    """True inside a real Google Colab kernel (the Hub and pip are there); the Colab profile does not count."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def colab_profile_requested() -> bool:
    """DS_COURSE_COLAB=1: behave as on a free Colab T4 (scripts/colab_emulation.py sets it)."""
    return os.environ.get(COLAB_PROFILE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


# ------------------------------------------------------------------ limits this process really has

def _cgroup_mounts() -> dict[str, str]:
    """{"v2": mount point} and/or {controller: mount point} for cgroup v1 hierarchies, from /proc/self/mountinfo."""
    mounts: dict[str, str] = {}
    try:
        lines = open("/proc/self/mountinfo").read().splitlines()
    except OSError:
        return mounts
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, point = rest[0], fields[4]
        if fstype == "cgroup2":
            mounts.setdefault("v2", point)
        elif fstype == "cgroup":
            for opt in rest[2].split(","):
                mounts.setdefault(opt, point)
    return mounts


def _own_cgroups() -> dict[str, str]:
    """{"v2": path} and {controller: path} of this process, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out["v2"] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _read_up(mount: str, path: str, filename: str) -> list[str]:
    """The contents of `filename` in the cgroup `path` and each of its ancestors (tightest limit wins)."""
    values = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        f = os.path.join(mount, *parts[:depth], filename)
        try:
            values.append(open(f).read().strip())
        except OSError:
            continue
    return values


def cgroup_memory_limit() -> tuple[int | None, str]:
    """(bytes, "cgroup v2" / "cgroup v1") of the tightest memory limit on this process; (None, "") without one."""
    mounts, own = _cgroup_mounts(), _own_cgroups()
    limits: list[tuple[int, str]] = []
    if "v2" in mounts and "v2" in own:
        for v in _read_up(mounts["v2"], own["v2"], "memory.max"):
            if v.isdigit():
                limits.append((int(v), "cgroup v2"))
    if "memory" in mounts and "memory" in own:
        for v in _read_up(mounts["memory"], own["memory"], "memory.limit_in_bytes"):
            if v.isdigit() and int(v) < 1 << 60:  # "no limit" is a huge page-aligned number
                limits.append((int(v), "cgroup v1"))
    if not limits:
        return None, ""
    return min(limits)


def cgroup_cpu_limit() -> float | None:
    """CPUs' worth of time this process's cgroup may use (quota / period), or None without a quota."""
    mounts, own = _cgroup_mounts(), _own_cgroups()
    quotas: list[float] = []
    if "v2" in mounts and "v2" in own:
        for v in _read_up(mounts["v2"], own["v2"], "cpu.max"):
            quota, _, period = v.partition(" ")
            if quota.isdigit() and period.isdigit() and int(period):
                quotas.append(int(quota) / int(period))
    if "cpu" in mounts and "cpu" in own:
        q = _read_up(mounts["cpu"], own["cpu"], "cpu.cfs_quota_us")
        p = _read_up(mounts["cpu"], own["cpu"], "cpu.cfs_period_us")
        for quota, period in zip(q, p):
            if quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit() and int(period):
                quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, cut to its cgroup's CPU quota."""
    import math

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return max(1, cpus)


def ram_limit() -> tuple[int, str]:
    """(bytes, source) of the RAM this process may use: the machine's, or its cgroup limit if smaller."""
    physical = _ram_total_bytes()
    limit, source = cgroup_memory_limit()
    if limit is not None and limit < physical:
        return limit, source
    return physical, "physical"


def emulation_mechanism() -> str:
    """How the Colab profile is enforced here ("cgroup v2", "cgroup v1", "watchdog"), "none", or "" off the profile."""
    if not colab_profile_requested():
        return ""
    return os.environ.get(EMULATION_ENV, "").strip() or "none"


def choose_precision(compute_capability: tuple[int, int] | None, t4_budget: bool = False) -> str:
    """fp32 on CPU; fp16 below compute capability 8.0 (e.g. T4) or in T4 budget mode; bf16 otherwise (notebook 03)."""
    if compute_capability is None:
        return "fp32"
    if t4_budget or tuple(compute_capability) < BF16_MIN_CAPABILITY:
        return "fp16"
    return "bf16"


def apply_t4_budget(device_index: int = 0) -> int:
    """Cap this process's CUDA caching allocator at what a T4 leaves PyTorch (T4_VRAM_GIB: the T4's memory less the
    CUDA context and DeepSpeed's share, `t4_budget_account`) and give attention the kernels a T4 has; returns the cap
    in bytes (0 on CPU) (notebook 03). The cap is on the allocator only: this GPU's own context sits outside it, as a
    T4's does.

    A T4 (compute capability 7.5) has neither PyTorch's FlashAttention nor its cuDNN attention (both need 8.0+):
    `scaled_dot_product_attention` runs the memory-efficient kernel there, whose backward needs other temporaries.
    On a newer GPU standing in for a T4 those two are switched off for this process, so attention's memory and time
    are the T4's kernel's (notebook 06 measures long sequences, where attention's temporaries matter)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(device_index)
    cap = int(min(T4_VRAM_GIB * GiB, props.total_memory))
    torch.cuda.set_per_process_memory_fraction(cap / props.total_memory, device_index)
    if (props.major, props.minor) >= T4_MISSING_ATTENTION_KERNELS_FROM:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    return cap


def _ram_total_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is in requirements
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_nvme_path(course_root: str | os.PathLike[str] | None = None) -> str:
    """The NVMe offload folder a notebook uses: $DS_COURSE_NVME_DIR, else /content/nvme on Colab, else build/nvme
    (notebook 02)."""
    if os.environ.get(NVME_DIR_ENV):
        return os.environ[NVME_DIR_ENV]
    if in_colab():
        return "/content/nvme"
    root = course_root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(str(root), "build", "nvme")


def colab_ram_budget(ram_total: int, colab: bool, t4_budget: bool) -> int:
    """The RAM the course lets a notebook use: on Colab (or standing in for it) Colab's VM less what Colab itself
    uses (COLAB_RAM_BUDGET_BYTES), never more than this process may have; elsewhere all of it."""
    return min(ram_total, COLAB_RAM_BUDGET_BYTES) if (colab or t4_budget) else ram_total


def detect_runtime(t4_budget: bool | None = None, disk_path: str = ".") -> Runtime:
    """Look at this machine (notebook 00); in T4 budget mode (or the Colab profile) also cap PyTorch's allocator at
    what a T4 leaves it (T4_VRAM_GIB)."""
    import torch

    emulation = emulation_mechanism()
    budget = t4_budget_requested(t4_budget) or (bool(emulation) and t4_budget is None)
    notes: list[str] = []
    ram_total, ram_source = ram_limit()
    colab = in_colab() or bool(emulation)
    disk_free = shutil.disk_usage(disk_path).free
    cores = usable_cpus()
    if emulation:
        disk_free = min(disk_free, COLAB_NVME_BUDGET_BYTES)
        notes.append("Colab profile: the notebooks take their Colab branches"
                     + ("" if emulation == "none" else f"; RAM and CPUs held to Colab's by a {emulation}")
                     + f" (Colab's {COLAB_VM_RAM_BYTES / GiB:.1f} GiB VM less {COLAB_RESERVED_BYTES / GiB:.1f} GiB "
                       "for its own processes)")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        cc = (props.major, props.minor)
        total = int(props.total_memory)
        vram_budget = apply_t4_budget(0) if budget else total
        if not budget and cc == (7, 5) and "T4" in props.name:  # a real T4: its context is outside `total` too
            vram_budget = min(total, int(T4_VRAM_GIB * GiB))
            notes.append(f"T4: the budget is what it leaves PyTorch, {T4_VRAM_GIB:g} GiB of {total / GiB:.2f} "
                         "(helpers.t4_budget_account())")
        if budget:
            notes.append(f"T4 budget mode: PyTorch's allocator capped at {T4_VRAM_GIB:g} GiB (what a T4's "
                         f"{T4_TOTAL_BYTES / GiB:.2f} GiB leave it), fp16 forced"
                         + (", attention on the T4's SDPA kernel (memory-efficient; no flash, no cuDNN)"
                            if cc >= T4_MISSING_ATTENTION_KERNELS_FROM else "") + ", RAM budget "
                         f"{colab_ram_budget(ram_total, colab, budget) / GB:.1f} GB"
                         + ("" if ram_source != "physical" else " (judged against, not enforced)"))
        if cc < BF16_MIN_CAPABILITY:
            notes.append(f"compute capability {cc[0]}.{cc[1]} < 8.0: no native bf16, training uses fp16 "
                         "(torch.cuda.is_bf16_supported() may still say True through emulation)")
        return Runtime(
            device="cuda", gpu_name=props.name, compute_capability=cc, gpu_total_bytes=total,
            vram_budget_bytes=vram_budget, ram_total_bytes=ram_total,
            ram_budget_bytes=colab_ram_budget(ram_total, colab, budget),
            disk_free_bytes=disk_free, cpu_cores=cores, gpu_count=torch.cuda.device_count(),
            is_colab=colab, t4_budget=budget, precision=choose_precision(cc, budget), notes=tuple(notes),
            ram_limit=ram_source, emulation=emulation)
    if emulation:  # the Colab profile without a GPU: Colab's budgets and branches, no T4 to stand in for
        notes.append(f"Colab profile without a GPU: Colab's RAM budget "
                     f"({colab_ram_budget(ram_total, True, False) / GB:.1f} GB) and NVMe disk budget "
                     f"({COLAB_NVME_BUDGET_BYTES / GB:.0f} GB) and the Colab branches apply; no T4 VRAM budget "
                     "(there is no GPU to cap) and no fp16: training runs in fp32 on the CPU")
    elif budget:
        notes.append("T4 budget mode asked for, but there is no GPU: running CPU-sized instead")
    notes.append("no GPU: DeepSpeed runs on CPU over gloo in fp32 (smoke-sized); "
                 "in Colab pick Runtime > Change runtime type > T4 GPU")
    return Runtime(
        device="cpu", gpu_name=None, compute_capability=None, gpu_total_bytes=0, vram_budget_bytes=0,
        ram_total_bytes=ram_total, ram_budget_bytes=colab_ram_budget(ram_total, in_colab() or bool(emulation), False),
        disk_free_bytes=disk_free, cpu_cores=cores, gpu_count=0, is_colab=bool(emulation), t4_budget=False,
        precision="fp32", notes=tuple(notes), ram_limit=ram_source, emulation=emulation)


def colab_t4_profile(disk_free_gb: float = COLAB_NVME_BUDGET_BYTES / GB) -> Runtime:
    """The free Colab T4 runtime as numbers, for what-if checks on any machine (notebooks 00 and 02): the card's
    memory (T4_TOTAL_BYTES) and what it leaves PyTorch (T4_VRAM_GIB); its disk is the course's NVMe budget on Colab
    (60 GB of the ~78 GB a fresh VM has free), as the emulation enforces."""
    return Runtime(device="cuda", gpu_name="Tesla T4", compute_capability=(7, 5),
                   gpu_total_bytes=T4_TOTAL_BYTES, vram_budget_bytes=int(T4_VRAM_GIB * GiB),
                   ram_total_bytes=COLAB_VM_RAM_BYTES, ram_budget_bytes=COLAB_RAM_BUDGET_BYTES,
                   disk_free_bytes=int(disk_free_gb * GB), cpu_cores=COLAB_CPUS, gpu_count=1, is_colab=True,
                   t4_budget=False,
                   precision="fp16", notes=("what-if profile of a free Colab T4, not this machine",))


def t4_budget_account() -> str:
    """What a T4 gives PyTorch and why, in two lines (notebook 00's budget section prints it)."""
    return (f"A T4 has {T4_TOTAL_BYTES / GiB:.2f} GiB (PyTorch sees {T4_TORCH_TOTAL_GIB:.2f}); the process's CUDA "
            f"context (~{T4_CUDA_CONTEXT_GIB:.2f} GiB) and DeepSpeed's NCCL and kernels (~{T4_DEEPSPEED_ALLOWANCE_GIB:.2f} "
            "GiB) sit outside PyTorch's allocator,\n"
            f"so PyTorch may reserve {T4_VRAM_GIB:.2f} GiB: the course's T4 budget (the emulation caps the allocator "
            "there; every estimate, plan and chart is judged against it).")


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


def _kind_of(defaults: tuple[Any, ...]) -> str:
    """What a parameter's defaults (its Colab and CPU values) are: 'bool', 'int', 'float', 'str', 'sequence' or ''
    (anything else: not checked)."""
    if all(isinstance(d, bool) for d in defaults):
        return "bool"
    if all(isinstance(d, int) and not isinstance(d, bool) for d in defaults):
        return "int"
    if all(isinstance(d, (int, float)) and not isinstance(d, bool) for d in defaults):
        return "float"
    if all(isinstance(d, str) for d in defaults):
        return "str"
    if all(isinstance(d, (tuple, list)) and d for d in defaults):
        return "sequence"
    return ""


def _parameter_problem(value: Any, defaults: tuple[Any, ...]) -> str:
    """'' when `value` is of the kind its defaults are (and in their range), else what it must be."""
    kind = _kind_of(defaults)
    numbers = [d for d in defaults if isinstance(d, (int, float)) and not isinstance(d, bool)]
    zero_ok = any(d == 0 for d in numbers)  # a default of 0 (an aux-loss coefficient) makes 0 a valid value
    sign = "non-negative" if zero_ok else "positive"
    if kind == "bool":
        return "" if isinstance(value, bool) else "True or False"
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0)
        return "" if ok else f"a {sign} integer"
    if kind == "float":
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
              and abs(value) != float("inf") and (value >= 0 if zero_ok else value > 0))
        return "" if ok else f"a {sign} number"
    if kind == "str":
        return "" if isinstance(value, str) and value.strip() else "a non-empty string"
    if kind == "sequence":
        items = tuple(i for d in defaults for i in d)
        item_kind = _kind_of(items)
        item_sign = "non-negative" if any(i == 0 for i in items if not isinstance(i, (bool, str))) else "positive"
        what = {"int": f"{item_sign} integers", "float": f"{item_sign} numbers", "str": "non-empty strings",
                "bool": "True/False values"}.get(item_kind, "items")
        bad = [i for i in value if _parameter_problem(i, items)] if isinstance(value, (tuple, list)) else []
        if not isinstance(value, (tuple, list)) or not value or bad:
            return f"a non-empty tuple of {what}" + (f" ({bad[0]!r} is not one)" if bad else "")
    return ""


def _check_parameter(name: str, value: Any, colab_value: Any, cpu_value: Any) -> None:
    """Refuse a notebook parameter whose value is not of its defaults' kind (issue 41: STEPS = 0, LOGITS_TILE = -1,
    TRY_LENGTHS = (), SEQ_LEN = '512', float lengths), before anything heavy runs; the fix passes this check."""
    problem = _parameter_problem(value, (colab_value, cpu_value))
    if not problem:
        return
    fix: Any = colab_value
    if isinstance(value, (str, float)) and _kind_of((colab_value, cpu_value)) in ("int", "float"):
        try:  # '512' or 512.0 where an int is meant: the same number, as the right kind
            number = float(value)
            candidate: Any = int(number) if isinstance(colab_value, int) and number.is_integer() else number
            if not _parameter_problem(candidate, (colab_value, cpu_value)):
                fix = candidate
        except (TypeError, ValueError, OverflowError):
            pass
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    same_kind = type(value) is type(colab_value) or (number and _kind_of((colab_value, cpu_value)) == "float")
    kind_name = type(value).__name__
    got = repr(value) + ("" if same_kind else f" ({'an' if kind_name[0] in 'aeiou' else 'a'} {kind_name})")
    raise ValueError(f"{name} = {got} in the parameters cell: it must be {problem}. Fix: {name} = {fix!r}"
                     + (" (its Colab value)" if fix == colab_value else "") + " in the parameters cell, then run it "
                     "and this cell again.")


def smoke_size(namespace: dict[str, Any], runtime: Runtime, **values: tuple[Any, Any]) -> dict[str, Any]:
    """Shrink a notebook's parameters for a CPU smoke run, saying so; keep any value the learner changed (notebook 00).

    ``helpers.smoke_size(globals(), runtime, MICRO_BATCH=(4, 2))``: on a CPU runtime, MICRO_BATCH becomes 2 if it
    still holds the parameters cell's Colab value 4, and a value you set yourself is kept. Prints one line of what
    changed and returns {name: value now}. On a GPU nothing changes. First, on any runtime, every named parameter's
    value must be of its defaults' kind: an int a positive int (not a bool, str or float), a float a positive
    number, a string non-empty, a tuple non-empty with items of its defaults' items' kind (0 is allowed where a
    default is 0); anything else is refused with ValueError naming the parameter and a value that passes.
    """
    now: dict[str, Any] = {}
    shrunk, kept = [], []
    for name, (colab_value, cpu_value) in values.items():  # every value checked before any is changed
        if name not in namespace:
            raise NameError(f"{name} is not defined. Fix: run the parameters cell first.")
        _check_parameter(name, namespace[name], colab_value, cpu_value)
    for name, (colab_value, cpu_value) in values.items():
        current = namespace[name]
        if not runtime.has_gpu and current == colab_value and cpu_value != colab_value:
            namespace[name] = cpu_value
            shrunk.append(f"{name} {cpu_value!r} (Colab value {colab_value!r})")
        elif not runtime.has_gpu and current != colab_value:
            kept.append(f"{name} {current!r} (yours; the smoke size would be {cpu_value!r})")
        now[name] = namespace[name]
    if shrunk:
        print("CPU smoke size: " + ", ".join(shrunk))
    if kept:
        print("kept as you set them: " + ", ".join(kept))
    return now
