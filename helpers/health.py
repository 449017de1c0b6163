"""DeepSpeed's environment report (`ds_report`) parsed into checks with verdicts and fixes (notebook 00).

Most install failures are version mismatches: nvcc's CUDA major differs from the CUDA torch was
built with, no nvcc or ninja for the just-in-time op builds, or no libaio for NVMe offload.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helpers.hardware import Runtime

__all__ = ["async_io_available", "health_checks", "health_table", "reproduce_cuda_mismatch", "run_ds_report", "verdict"]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
OP_LINE = re.compile(r"^(?P<op>[A-Za-z0-9_]+) \.+ \[(?P<installed>YES|NO)\] \.+ \[(?P<compatible>OKAY|NO)\]")
NINJA_LINE = re.compile(r"^ninja \.+ \[(?P<status>OKAY|FAIL)\]")
INFO_LINE = re.compile(r"^(?P<key>[a-zA-Z][\w ./()-]*?) \.{3,} (?P<value>.*)$")
VERSION = re.compile(r"(\d+)\.(\d+)")

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"


@dataclass(frozen=True)
class HealthCheck:
    """One row of the health table: what, what was found, verdict, and the fix when not ok."""

    item: str
    found: str
    status: str
    fix: str = ""


def run_ds_report(timeout_s: float = 300.0) -> str:
    """Run `ds_report` (as `python -m deepspeed.env_report`) and return its text, colours removed (notebook 00)."""
    proc = subprocess.run([sys.executable, "-m", "deepspeed.env_report"], capture_output=True, text=True,
                          timeout=timeout_s)
    text = ANSI.sub("", proc.stdout + ("\n" + proc.stderr if proc.stderr else ""))
    if proc.returncode != 0:
        raise RuntimeError(f"ds_report failed with exit code {proc.returncode}:\n{text[-2000:]}\n"
                           "Fix: reinstall deepspeed (pip install -r requirements.txt) in this environment.")
    return text


def async_io_available(timeout_s: float = 120.0) -> bool:
    """Whether DeepSpeed's async_io op (NVMe offload) can build here: its own check, run in a fresh Python (notebook 02).

    `AsyncIOBuilder().is_compatible()` compiles and links a test program against libaio with stderr's file
    descriptor redirected, and answers False on ANY exception; inside a notebook kernel that was interrupted while
    it ran, it went on answering False where libaio is installed (a learner-habits run of notebook 02 skipped NVMe
    with the libaio fix message). A child process has clean stdio, and an interrupt stops it cleanly.
    """
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder; print('OK' if AsyncIOBuilder().is_compatible() else 'NO')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode == 0 and proc.stdout.strip().endswith("OK")


def parse_ds_report(text: str) -> dict[str, Any]:
    """Turn ds_report's text into {'ninja': bool, 'ops': {name: {...}}, 'info': {...}, 'warnings': [...]}."""
    text = ANSI.sub("", text)
    report: dict[str, Any] = {"ninja": None, "ops": {}, "info": {}, "warnings": []}
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if "[WARNING]" in line or ("[FAIL]" in line and "..." not in line):
            report["warnings"].append(line.replace("[WARNING]", "").strip())
        if m := NINJA_LINE.match(line):
            report["ninja"] = m["status"] == "OKAY"
        elif m := OP_LINE.match(line):
            report["ops"][m["op"]] = {"installed": m["installed"] == "YES",
                                      "compatible": m["compatible"] == "OKAY"}
        elif (m := INFO_LINE.match(line)) and m["key"] != "op name":
            report["info"][m["key"].strip()] = m["value"].strip()
    return report


def _major(version: str | None) -> int | None:
    if not version:
        return None
    m = VERSION.search(version)
    return int(m.group(1)) if m else None


def health_checks(report: dict[str, Any] | str, runtime: "Runtime | None" = None) -> list[HealthCheck]:
    """Verdicts for torch, CUDA, nvcc, deepspeed, ninja, ops, libaio, GPU and precision; `report` is ds_report's text
    or `parse_ds_report`'s dict of it (notebook 00)."""
    if isinstance(report, str):
        report = parse_ds_report(report)
    info, ops = report["info"], report["ops"]
    has_gpu = runtime.has_gpu if runtime is not None else "torch cuda version" in info
    checks: list[HealthCheck] = []
    add = checks.append

    add(HealthCheck("torch", info.get("torch version", "?"), INFO if info.get("torch version") else FAIL,
                    "" if info.get("torch version") else "torch is missing: on Colab restart the runtime; "
                    "locally bash scripts/setup.sh"))
    torch_cuda = info.get("torch cuda version")
    if has_gpu:
        if not torch_cuda or torch_cuda == "None":
            add(HealthCheck("torch CUDA", "none (CPU build of torch)", FAIL,
                            "a GPU is present but torch is a CPU build: install the CUDA build of torch "
                            "(on Colab never reinstall torch: restart the runtime instead)"))
        else:
            add(HealthCheck("torch CUDA", torch_cuda, OK))
        nvcc = info.get("nvcc version", "")
        if not nvcc or "FAIL" in nvcc or _major(nvcc) is None:
            add(HealthCheck("nvcc", nvcc or "missing", WARN,
                            "no nvcc: DeepSpeed cannot JIT-build CUDA ops (fused_adam, cpu_adam...). Install the "
                            f"CUDA toolkit {torch_cuda} (same major as torch) and set CUDA_HOME, or keep "
                            "'torch_adam': true and avoid ops that need building"))
        elif _major(nvcc) != _major(torch_cuda):
            add(HealthCheck("nvcc", nvcc, FAIL,
                            f"CUDA mismatch: nvcc {nvcc} vs torch built with CUDA {torch_cuda}; op builds fail. "
                            f"Fix: install CUDA toolkit {_major(torch_cuda)}.x and point CUDA_HOME at it (or "
                            "install the torch build for your nvcc); DS_SKIP_CUDA_CHECK=1 hides the check "
                            "at your own risk"))
        else:
            add(HealthCheck("nvcc", nvcc, OK))
    else:
        add(HealthCheck("torch CUDA", torch_cuda or "none (CPU)", INFO,
                        "" if torch_cuda else "CPU runtime: CUDA is not needed here"))
    ds = info.get("deepspeed info", "")
    add(HealthCheck("deepspeed", ds.split(",")[0] if ds else "missing", INFO if ds else FAIL,
                    "" if ds else "pip install -r requirements.txt"))
    if report["ninja"] is False:
        add(HealthCheck("ninja", "missing", FAIL, "ops are JIT-built with ninja: pip install ninja"))
    else:
        add(HealthCheck("ninja", "ok" if report["ninja"] else "not reported", OK if report["ninja"] else WARN))

    aio = ops.get("async_io")
    if aio is not None:
        if aio["compatible"]:
            add(HealthCheck("libaio (NVMe offload)", "found", OK))
        else:
            add(HealthCheck("libaio (NVMe offload)", "missing", WARN,
                            "NVMe offload (ZeRO-Infinity) unavailable: apt-get install libaio-dev "
                            "(on Colab: !apt-get install -y libaio-dev), then run ds_report again"))
    for name, what in (("cpu_adam", "CPU optimizer offload"), ("fused_adam", "fused Adam on GPU")):
        op = ops.get(name)
        if op is not None:
            add(HealthCheck(f"{name} ({what})", "prebuilt" if op["installed"] else
                            ("JIT-buildable" if op["compatible"] else "cannot build"),
                            OK if op["compatible"] or op["installed"] else FAIL,
                            "" if op["compatible"] or op["installed"] else
                            f"{name} cannot be built: check nvcc/CUDA_HOME and headers above, clear "
                            "~/.cache/torch_extensions, then retry"))
    if runtime is not None:
        if runtime.has_gpu:
            cc = ".".join(map(str, runtime.compute_capability or ()))
            add(HealthCheck("GPU", f"{runtime.gpu_name} (cc {cc}), {runtime.vram_budget_bytes / 1024**3:.2f} GiB "
                            "budget", OK))
        else:
            add(HealthCheck("GPU", "none", WARN,
                            "no GPU: notebooks run smoke-sized on CPU. In Colab: Runtime > Change runtime "
                            "type > T4 GPU"))
        if runtime.precision == "fp16":
            why = ("T4 budget mode (a T4 has no native bf16)" if runtime.t4_budget else
                   "no native bf16 (compute capability < 8.0)")
        else:
            why = "native bf16 (compute capability >= 8.0)" if runtime.precision == "bf16" else \
                "CPU: DeepSpeed refuses fp16"
        add(HealthCheck("precision", f"{runtime.precision}: {why}", OK))
    for warning in report["warnings"]:
        if "shm" in warning.lower():
            add(HealthCheck("/dev/shm", warning, WARN, "increase shared memory (docker --shm-size=1gb)"))
    return checks


def verdict(checks: list[HealthCheck]) -> str:
    """One line: ready, ready with warnings, or not ready (notebook 00)."""
    fails = [c.item for c in checks if c.status == FAIL]
    warns = [c.item for c in checks if c.status == WARN]
    if fails:
        return "NOT READY: fix " + ", ".join(fails)
    if warns:
        return "ready, with warnings about: " + ", ".join(warns)
    return "ready"


def health_table(checks: list[HealthCheck]) -> str:
    """The checks as a fixed-width text table, the fixes underneath (notebook 00)."""
    w_item = max(len(c.item) for c in checks)
    w_found = min(max(len(c.found) for c in checks), 60)
    lines = [f"{'check':<{w_item}}  {'found':<{w_found}}  verdict", "-" * (w_item + w_found + 12)]
    for c in checks:
        lines.append(f"{c.item:<{w_item}}  {c.found[:w_found]:<{w_found}}  {c.status}")
    fixes = [c for c in checks if c.fix and c.status in (WARN, FAIL)]
    if fixes:
        lines.append("")
        lines += [f"fix {c.item}: {c.fix}" for c in fixes]
    lines.append("")
    lines.append("verdict: " + verdict(checks))
    return "\n".join(lines)


# ------------------------------------------------------------------ the classic install failure, reproduced (notebook 00)

# what runs in the child: ds_report's two version lines (its own nvcc_version()), then the check DeepSpeed makes before
# it compiles any CUDA op. argv[1], when given, stands in for torch's CUDA version (tests on a CPU build of torch only).
_MISMATCH_CHILD = """
import os, sys, torch, torch.utils.cpp_extension
if len(sys.argv) > 1:
    torch.version.cuda = sys.argv[1]
    torch.utils.cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]  # a CPU build of torch looks for no CUDA_HOME
from deepspeed.env_report import nvcc_version
print("torch cuda version ...............", torch.version.cuda)
print("nvcc version .....................", nvcc_version())
from deepspeed.ops.op_builder.builder import assert_no_cuda_mismatch
try:
    assert_no_cuda_mismatch("fused_adam")
    print("RESULT: DeepSpeed's op builder accepted it")
except Exception as exc:
    print(f"RESULT: {type(exc).__name__}: {exc}")
"""


@dataclass(frozen=True)
class CudaMismatch:
    """What `reproduce_cuda_mismatch` saw: both versions, ds_report's two lines, DeepSpeed's error, the course's row."""

    torch_cuda: str
    nvcc: str
    report_lines: list[str]
    deepspeed_error: str
    check: HealthCheck

    def __str__(self) -> str:
        return "\n".join([f"CUDA_HOME -> a stand-in nvcc that reports CUDA {self.nvcc}; torch was built with CUDA "
                          f"{self.torch_cuda}. In a child process with that CUDA_HOME:",
                          "  ds_report:  " + "  |  ".join(self.report_lines),
                          "  DeepSpeed, before compiling an op:  " + self.deepspeed_error,
                          f"  the health table's row:  {self.check.item} {self.check.found}  {self.check.status}",
                          f"  its fix:  {self.check.fix}"])


def reproduce_cuda_mismatch(work_dir: str | os.PathLike[str], *, torch_cuda: str | None = None,
                            timeout_s: float = 300.0) -> CudaMismatch | None:
    """The most common DeepSpeed install failure, made on purpose and safely (notebook 00): in a child process whose
    CUDA_HOME points at a stand-in `nvcc` reporting a CUDA major one below torch's, print ds_report's version lines
    and run DeepSpeed's own pre-build check (`assert_no_cuda_mismatch`, what every JIT op build calls first), then read
    those lines with `health_checks`. Nothing is installed or changed in this process. Returns None on a torch without CUDA (there is
    nothing to mismatch); `torch_cuda` stands in for torch's CUDA version (tests on a CPU build)."""
    import torch

    cuda = torch_cuda or torch.version.cuda
    if not cuda:
        return None
    fake = f"{int(cuda.split('.')[0]) - 1}.8"
    home = Path(work_dir) / "cuda-stand-in"
    (home / "bin").mkdir(parents=True, exist_ok=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver (a stand-in, notebook 00)'\n"
                    f"echo 'Cuda compilation tools, release {fake}, V{fake}.89'\n")
    nvcc.chmod(0o755)
    env = {**os.environ, "CUDA_HOME": str(home), "DS_SKIP_CUDA_CHECK": "0"}
    argv = [sys.executable, "-c", _MISMATCH_CHILD] + ([torch_cuda] if torch_cuda else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    text = ANSI.sub("", proc.stdout + proc.stderr)
    lines = [ln.strip() for ln in text.splitlines()]
    report_lines = [" ".join(ln.split()) for ln in lines if ln.startswith(("torch cuda version", "nvcc version"))]
    error = next((ln.removeprefix("RESULT: ") for ln in lines if ln.startswith("RESULT: ")), text.strip()[-300:])
    report = parse_ds_report(text)
    report["info"].setdefault("torch cuda version", cuda)
    check = next(c for c in health_checks(report) if c.item == "nvcc")
    return CudaMismatch(torch_cuda=cuda, nvcc=fake, report_lines=report_lines, deepspeed_error=error, check=check)
