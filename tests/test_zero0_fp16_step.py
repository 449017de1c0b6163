"""benchmarks/zero0_fp16_step.py (docs/decisions.md: ZeRO-0 in fp16 is slow): its --help, its refusal on CPU, and
its Markdown report. The measurement itself runs on the GPU machine only (scripts/gpu_pending.sh zero0)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, load_script

SCRIPT = ROOT / "benchmarks" / "zero0_fp16_step.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_help_names_the_runs_and_the_profile():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert "--profile" in r.stdout and "torch_adam" in r.stdout


def test_refuses_on_cpu_with_exit_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would measure")
    r = _run("--out", str(tmp_path / "z.json"))
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr and "Fix:" in r.stderr
    assert not (tmp_path / "z.json").exists()


def test_markdown_lists_each_run_and_the_profiled_tops():
    mod = load_script(SCRIPT, "zero0_fp16_step")
    top = [{"op": "aten::item", "calls": 296, "device_ms": 1.0, "cpu_ms": 9.0, "self_cpu_ms": 2.0}]
    report = {"device": "GPU", "date": "2026-12-07", "torch": "2", "deepspeed": "0.19.8",
              "settings": {"micro_batch": 4, "seq_len": 512, "warmup": 3, "steps": 10, "checkpointing": True},
              "runs": [{"name": "plain PyTorch AMP", "optimizer": "AdamW", "tokens_per_s": 20000, "ratio": 1.0,
                        "median_step_ms": 100.0, "build_s": 1.0},
                       {"name": mod.PROFILED, "optimizer": "FP16_UnfusedOptimizer", "basic_optimizer": "AdamW",
                        "tokens_per_s": 4000, "ratio": 0.2, "median_step_ms": 500.0, "build_s": 2.0,
                        "profile": {"steps": 2, "syncs_per_step": {"cudaStreamSynchronize": 151.0},
                                    "memcpy_dtoh_per_step": 151.0, "kernel_launches_per_step": 3000.0,
                                    "top_by_device_time": top, "top_by_cpu_time": top}},
                       {"name": "ZeRO-0, torch_adam=false (FusedAdam)", "error": "RuntimeError: no nvcc"}]}
    text = mod.markdown(report)
    assert "| ZeRO-0, torch_adam=true | FP16_UnfusedOptimizer (AdamW) | 4,000 | x0.20 |" in text
    assert "failed: RuntimeError: no nvcc" in text
    assert "top 15 ops by device time" in text and "`aten::item`" in text
