from pathlib import Path

import pytest

from helpers.health import FAIL, OK, WARN, health_checks, health_table, parse_ds_report, run_ds_report, verdict

CPU_REPORT = (Path(__file__).parent / "data" / "ds_report_cpu.txt").read_text()

GPU_REPORT = """\
--------------------------------------------------
JIT compiled ops requires ninja
ninja .................. \x1b[92m[OKAY]\x1b[0m
--------------------------------------------------
op name ................ installed .. compatible
--------------------------------------------------
async_io ............... [NO] ....... [OKAY]
cpu_adam ............... [YES] ...... [OKAY]
fused_adam ............. [NO] ....... [OKAY]
--------------------------------------------------
DeepSpeed general environment info:
torch install path ............... ['/usr/local/lib/python3.12/dist-packages/torch']
torch version .................... 2.5.1+cu124
deepspeed install path ........... ['/usr/local/lib/python3.12/dist-packages/deepspeed']
deepspeed info ................... 0.19.8, unknown, unknown
torch cuda version ............... {torch_cuda}
torch hip version ................ None
nvcc version ..................... {nvcc}
deepspeed wheel compiled w. ...... torch 2.5, cuda 12.4
shared memory (/dev/shm) size .... 5.68 GB
"""


def gpu_report(torch_cuda="12.4", nvcc="12.4", ninja="[OKAY]"):
    return GPU_REPORT.format(torch_cuda=torch_cuda, nvcc=nvcc).replace("\x1b[92m[OKAY]", "\x1b[92m" + ninja)


def by_item(checks):
    """Checks by the first word of their name ('torch CUDA' under its full name)."""
    return {(c.item if c.item == "torch CUDA" else c.item.split(" ")[0]): c for c in checks}


def test_parse_the_cpu_report():
    r = parse_ds_report(CPU_REPORT)
    assert r["ninja"] is True
    assert r["ops"]["async_io"] == {"installed": False, "compatible": False}
    assert r["ops"]["cpu_adam"] == {"installed": False, "compatible": True}
    assert r["info"]["torch version"] == "2.13.0+cpu"
    assert r["info"]["deepspeed info"].startswith("0.19.8")
    assert "op name" not in r["info"]


def test_cpu_runtime_verdict_and_fixes(cpu):
    checks = by_item(health_checks(parse_ds_report(CPU_REPORT), cpu))
    assert checks["libaio"].status == WARN and "apt-get install libaio-dev" in checks["libaio"].fix
    assert checks["GPU"].status == WARN and "T4 GPU" in checks["GPU"].fix
    assert checks["precision"].found.startswith("fp32")
    assert verdict(list(checks.values())).startswith("ready, with warnings")


def test_healthy_gpu(t4):
    checks = health_checks(parse_ds_report(gpu_report()), t4)
    d = by_item(checks)
    assert d["nvcc"].status == OK and d["libaio"].status == OK and d["cpu_adam"].found == "prebuilt"
    assert d["precision"].found.startswith("fp16: no native bf16")
    assert verdict(checks) == "ready"


def test_cuda_mismatch_is_a_failure_with_the_fix(t4):
    checks = health_checks(parse_ds_report(gpu_report(torch_cuda="12.4", nvcc="11.8")), t4)
    nvcc = by_item(checks)["nvcc"]
    assert nvcc.status == FAIL
    assert "CUDA mismatch: nvcc 11.8 vs torch built with CUDA 12.4" in nvcc.fix
    assert "install CUDA toolkit 12.x" in nvcc.fix and "CUDA_HOME" in nvcc.fix
    assert verdict(checks) == "NOT READY: fix nvcc"
    assert "fix nvcc: CUDA mismatch" in health_table(checks)


def test_same_major_different_minor_is_fine(t4):
    assert by_item(health_checks(parse_ds_report(gpu_report("12.4", "12.1")), t4))["nvcc"].status == OK


def test_no_nvcc(t4):
    text = gpu_report(nvcc="\x1b[91m [FAIL] nvcc missing \x1b[0m")
    nvcc = by_item(health_checks(parse_ds_report(text), t4))["nvcc"]
    assert nvcc.status == WARN and "no nvcc" in nvcc.fix and "CUDA toolkit 12.4" in nvcc.fix


def test_no_ninja(t4):
    ninja = by_item(health_checks(parse_ds_report(gpu_report(ninja="[FAIL]")), t4))["ninja"]
    assert ninja.status == FAIL and ninja.fix.endswith("pip install ninja")


def test_cpu_torch_on_a_gpu_machine(t4):
    text = gpu_report().replace("torch cuda version ............... 12.4", "torch cuda version ............... None")
    checks = by_item(health_checks(parse_ds_report(text), t4))
    assert checks["torch CUDA"].status == FAIL and "CPU build of torch" in checks["torch CUDA"].found
    assert "install the CUDA build of torch" in checks["torch CUDA"].fix
    assert checks["torch"].status != FAIL


@pytest.mark.slow
def test_run_the_real_ds_report():
    text = run_ds_report()
    r = parse_ds_report(text)
    assert r["info"]["deepspeed info"].startswith("0.19.8")
    assert "cpu_adam" in r["ops"] and r["ninja"] is not None
    assert "\x1b[" not in text  # colours are stripped


@pytest.mark.slow
def test_async_io_check_in_a_fresh_python_agrees_with_deepspeeds_own():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from helpers.health import async_io_available

    assert async_io_available() == AsyncIOBuilder().is_compatible()


@pytest.mark.slow
def test_a_cuda_mismatch_is_reproduced_with_deepspeeds_own_error_and_the_fix(tmp_path):
    """Notebook 00 (issue 40 item 7): a stand-in nvcc one CUDA major below torch's, in a child process; its ds_report
    lines, DeepSpeed's CUDAMismatchException before any op build, and the health row's FAIL with the fix. On this CPU
    build of torch, torch's CUDA version is stood in too (the notebook passes nothing and gets None here)."""
    from helpers.health import reproduce_cuda_mismatch

    assert reproduce_cuda_mismatch(tmp_path) is None  # a CPU torch: nothing to mismatch
    got = reproduce_cuda_mismatch(tmp_path, torch_cuda="12.8")
    assert got.nvcc == "11.8" and got.torch_cuda == "12.8"
    assert any(line.startswith("nvcc version") and line.endswith("11.8") for line in got.report_lines), got.report_lines
    assert got.deepspeed_error.startswith("CUDAMismatchException") and "11.8 does not match" in got.deepspeed_error
    assert got.check.status == FAIL and "install CUDA toolkit 12.x" in got.check.fix
    assert "CUDA_HOME" in str(got) and str(got).count("\n") < 8


def test_health_checks_read_ds_reports_text_as_its_parsed_dict():
    assert health_checks(gpu_report(nvcc="11.8")) == health_checks(parse_ds_report(gpu_report(nvcc="11.8")))
