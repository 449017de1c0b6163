"""One training run in a fresh child process, measured from outside: how notebook 02 runs its big models.

A notebook kernel keeps what earlier runs used (pinned buffers cached by torch, glibc's heap, imported libraries),
so on a 12.7 GB Colab VM the third offload config in one kernel can be killed although each fits on its own. A child
process starts clean, and its peak RAM belongs to that config alone, as `benchmarks/ladder.py` measures it. The child
asks the kernel's out-of-memory killer to pick it first (`oom_score_adj` 1000), so a config that does not fit kills
the child, not your notebook: the kernel reports it and goes on.

    r = train_in_fresh_process("ZeRO-3, optimizer on NVMe", ds_config, "gpt2-large", tokenizer_dir=...)

The config is the single source of truth, as for `helpers.train_run`: micro-batch, accumulation, learning rate
and warm-up come from `ds_config` (`plain_pytorch=True` trains the same numbers without DeepSpeed).

The child runs `helpers.train_run` (the same loop as in the kernel) and sends its progress back line by line;
the kernel shows it in a progress bar from the first second (building the model, `deepspeed.initialize`, steps).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helpers.memory import GB, GiB

if TYPE_CHECKING:
    from helpers.train import RunResult

__all__ = ["train_in_fresh_process", "child_baseline_rss", "run_process_group"]

ROOT = Path(__file__).resolve().parent.parent
_PROGRESS = "DS_COURSE_PROGRESS "  # prefix of the child's progress lines on stdout


def child_baseline_rss(tokenizer_dir: str | Path, *, seq_len: int = 512, max_blocks: int = 256,
                       dataset: str = "local", timeout_s: float = 600.0) -> int:
    """RSS in bytes of a child run just before it builds its model: Python with torch, deepspeed and transformers
    imported, the runtime detected (CUDA up), the tokenizer and the data loaded, cuBLAS warmed up (notebook 02).

    Measured by running the child itself up to that point; pre-flight adds it to the kernel's own RSS.
    """
    with tempfile.TemporaryDirectory(prefix="ds-course-child-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({"baseline_only": True, "tokenizer_dir": str(tokenizer_dir),
                                         "seq_len": seq_len, "max_blocks": max_blocks, "dataset": dataset,
                                         "mmap_threshold_mib": 0, "result": str(result_path)}))
        env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        out = subprocess.run([sys.executable, "-m", "helpers.fresh_process", str(spec_path)], capture_output=True,
                             text=True, env=env, timeout=timeout_s, cwd=str(ROOT))
        if out.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"a fresh child process could not start: {out.stderr[-800:]}")
        return int(json.loads(result_path.read_text())["rss"])


def _tree_rss(proc: Any) -> int:
    """RSS of a psutil process and its children (0 once it is gone)."""
    import psutil

    total = 0
    try:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
    except psutil.Error:
        return 0
    return total


def train_in_fresh_process(name: str, ds_config: dict[str, Any], model: str, *, tokenizer_dir: str | Path,
                           plain_pytorch: bool = False, steps: int = 4, seq_len: int = 512,
                           nvme_path: str | Path | None = None, dataset: str = "local", max_blocks: int = 256,
                           checkpointing: bool = True, untimed_steps: int = 1, seed: int = 0,
                           mmap_threshold_mib: float = 0.0, cpus: set[int] | None = None,
                           timeout_s: float | None = None, gpu: str | None = None, progress: bool = True,
                           estimated_vram_bytes: int = 0, wrap: list[str] | None = None,
                           env: dict[str, str] | None = None, time_micro_batches: bool = False,
                           trace_host_bytes: int = 0, chunked_overflow_check: bool = False) -> "RunResult":
    """Train `model` (a helpers.GPT2_LADDER name) with `ds_config` (`plain_pytorch`: without DeepSpeed) in a child
    process, through `helpers.train_run`.

    Returns the child's RunResult. If the child dies (out-of-memory killer, a crash inside DeepSpeed's C++ code,
    the time limit), `error` says how, and `peak_rss_gb` is the peak seen from outside. Interrupting the cell kills
    the child and its NVMe files stay for the caller to remove. `wrap` is put before the child's command line and
    `env` added to its environment (benchmarks/ladder.py --emulate starts it inside a Colab enclosure that way).
    `time_micro_batches`: see `helpers.train_run`. `trace_host_bytes` > 0 records every host storage of at least that
    many bytes the run allocates, by the DeepSpeed line that asked for it (`helpers.host_trace`, issue 25), in
    `extras["host_trace"]`; it slows the run (a Python call per operator), so never on a timed run.
    `chunked_overflow_check`: the child calls `helpers.chunk_zero3_overflow_check()` first (fp16 ZeRO-3 with the
    optimizer offloaded: ~3 bytes per parameter less host RAM at each step; DeepSpeed 0.19.8 only).
    """
    import psutil
    from helpers.progress import progress_bar

    from helpers.train import RunResult

    with tempfile.TemporaryDirectory(prefix="ds-course-child-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = {"name": name, "ds_config": ds_config, "plain_pytorch": plain_pytorch, "model": model,
                "tokenizer_dir": str(tokenizer_dir), "steps": steps, "seq_len": seq_len,
                "nvme_path": str(nvme_path) if nvme_path else None, "dataset": dataset, "max_blocks": max_blocks,
                "checkpointing": checkpointing, "untimed_steps": untimed_steps, "seed": seed,
                "mmap_threshold_mib": mmap_threshold_mib, "result": str(result_path),
                "estimated_vram_bytes": int(estimated_vram_bytes), "time_micro_batches": time_micro_batches,
                "trace_host_bytes": int(trace_host_bytes), "chunked_overflow_check": chunked_overflow_check}
        spec_path.write_text(json.dumps(spec))
        child_env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                         **(env or {}))
        if gpu is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = gpu

        def prepare() -> None:  # in the child, before Python starts
            if cpus:
                os.sched_setaffinity(0, cpus)

        cmd = [*(wrap or []), sys.executable, "-m", "helpers.fresh_process", str(spec_path)]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=str(ROOT), env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=prepare if cpus else None)
        watched = psutil.Process(proc.pid)
        state: dict[str, Any] = {"phase": "starting Python", "step": 0, "loss": None, "peak_rss": 0}
        stderr_tail: list[str] = []

        def read_stdout() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith(_PROGRESS):
                    with_msg = json.loads(line[len(_PROGRESS):])
                    state.update(with_msg)

        def read_stderr() -> None:
            for line in proc.stderr:  # type: ignore[union-attr]
                stderr_tail.append(line.rstrip())
                del stderr_tail[:-40]

        readers = [threading.Thread(target=read_stdout, daemon=True), threading.Thread(target=read_stderr, daemon=True)]
        for t in readers:
            t.start()
        bar = progress_bar(total=steps, desc=name, disable=not progress)
        timed_out = False
        shown: dict[str, str] = {}
        try:
            while proc.poll() is None:
                state["peak_rss"] = max(state["peak_rss"], _tree_rss(watched))
                if bar.n != state["step"]:
                    bar.update(state["step"] - bar.n)
                post = {"phase": state["phase"], "peak RAM": f"{state['peak_rss'] / GB:.1f} GB"}
                if state["loss"] is not None:
                    post["loss"] = f"{state['loss']:.3f}"
                if post != shown:  # redraw only when something changed
                    bar.set_postfix(post)
                    shown = post
                if timeout_s is not None and time.perf_counter() - started > timeout_s:
                    timed_out = True
                    _kill(proc)
                    break
                time.sleep(0.1)
        except BaseException:  # KeyboardInterrupt included: never leave the child running
            _kill(proc, grace_s=5.0)
            raise
        finally:
            proc.wait()
            for t in readers:
                t.join(timeout=5)
            if bar.n != state["step"]:
                bar.update(state["step"] - bar.n)
            bar.close()
        seconds = time.perf_counter() - started
        if result_path.exists() and proc.returncode == 0:
            result = RunResult.from_dict(json.loads(result_path.read_text()))
            result.peak_rss_gb = round(max(result.peak_rss_gb, state["peak_rss"] / GB), 3)
            if result.extras.get("compiled_ops"):
                print(f"  note: this child compiled DeepSpeed's {', '.join(result.extras['compiled_ops'])} op first (not "
                      "cached yet), so its RAM peak includes the compiler's. helpers.build_ops(...) before the first "
                      "measured run avoids that.", flush=True)
            return result
        result = RunResult(name=name, model=model, params=0, config="plain PyTorch" if plain_pytorch else name,
                           precision="", micro_batch=int(ds_config["train_micro_batch_size_per_gpu"]),
                           grad_accum=int(ds_config.get("gradient_accumulation_steps", 1)), seq_len=seq_len,
                           steps=steps, checkpointing=checkpointing, runtime="", seconds=round(seconds, 1),
                           peak_rss_gb=round(state["peak_rss"] / GB, 3),
                           estimated_vram_gib=round(estimated_vram_bytes / GiB, 3))
        result.error = _death(proc.returncode, timed_out, timeout_s, state, stderr_tail)
        return result


def _kill(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Stop the child and whatever it started: SIGINT first when `grace_s` (a child compiling one of DeepSpeed's
    ops then releases the build lock, or the next run would wait on it forever), SIGKILL after."""
    import psutil

    if grace_s:
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
    except psutil.Error:
        pass
    proc.kill()


def _death(code: int | None, timed_out: bool, timeout_s: float | None, state: dict[str, Any],
           stderr_tail: list[str]) -> str:
    """One sentence on how the child ended, for RunResult.error."""
    where = f"while {state['phase']}" + (f" (step {state['step']})" if state["step"] else "")
    if timed_out:
        return f"stopped after the time limit of {timeout_s:.0f} s {where}"
    if code == -signal.SIGKILL:
        return (f"killed (SIGKILL) {where} at {state['peak_rss'] / GB:.1f} GB of RAM: the out-of-memory killer "
                "(on Colab the same happens to the whole kernel)")
    if code is not None and code < 0:
        return f"died of signal {-code} ({signal.Signals(-code).name}) {where}: " + " | ".join(stderr_tail[-3:])
    errors = [line for line in stderr_tail if "Error" in line or "error" in line] or stderr_tail
    return f"the child process failed (exit code {code}) {where}: " + " | ".join(errors[-3:])


def run_process_group(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
                      timeout: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True)` in a process group of its own (notebooks 03, 05).

    A launcher (torchrun, deepspeed) starts one process per rank; interrupting the cell or the time limit stops
    all of them (SIGINT, then SIGKILL after 5 s), where killing the launcher alone would leave its ranks running.
    """
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # KeyboardInterrupt and TimeoutExpired included
        _stop_group(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        try:
            proc.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ------------------------------------------------------------------------------ the child

def _say(**fields: Any) -> None:
    print(_PROGRESS + json.dumps(fields), flush=True)


def _child(spec_path: str) -> int:
    """Train one config as the spec says and write the RunResult (as JSON) where it says."""
    spec = json.loads(Path(spec_path).read_text())
    try:  # be the first to go if RAM runs out: the notebook kernel stays alive
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    _say(phase="importing torch and deepspeed")
    import helpers
    from helpers.checkpoints import build_zero3_model

    if spec["mmap_threshold_mib"]:
        helpers.mmap_large_allocations(int(spec["mmap_threshold_mib"] * 2**20))
    runtime = helpers.detect_runtime()
    if spec.get("chunked_overflow_check"):
        helpers.chunk_zero3_overflow_check()
    import helpers.runtime as rt

    rt.announce_op_builds()  # a compile in here is recorded: its RAM would be counted as the config's
    rt.ON_OP_BUILD = lambda op: _say(phase=f"compiling DeepSpeed's {op} op")
    _say(phase="loading data")
    tokenizer = helpers.load_tokenizer(spec["tokenizer_dir"])
    ds = helpers.load_text_dataset(spec["dataset"])
    blocks = helpers.pack_blocks(ds["train"], tokenizer, spec["seq_len"], max_blocks=spec["max_blocks"])
    if spec.get("baseline_only"):  # child_baseline_rss: what a run holds before its model exists
        import psutil

        helpers.reset_peak_stats()  # cuBLAS workspaces, as train_run makes them
        Path(spec["result"]).write_text(json.dumps({"rss": psutil.Process().memory_info().rss}))
        return 0
    cfg = spec["ds_config"]
    # GPT-2's own vocabulary (50,257), whatever the tokenizer's: the ladder's sizes are the published GPT-2 shapes,
    # and the local tokenizer's ids (< 8,192) are valid rows of the full embedding
    config = helpers.gpt2_config(spec["model"])

    def build() -> Any:
        _say(phase="building the model")
        if not spec["plain_pytorch"] and cfg.get("zero_optimization", {}).get("stage") == 3:
            return build_zero3_model(cfg, config=config, seed=spec["seed"])
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(spec["seed"])
        return AutoModelForCausalLM.from_config(config)

    trace = probe = None
    if spec.get("trace_host_bytes"):
        from helpers.host_trace import HostAllocationTrace, MemoryProbe

        trace = HostAllocationTrace(threshold_bytes=int(spec["trace_host_bytes"]), phase="building the model")
        probe = MemoryProbe(trace)

    def on_phase(phase: str) -> None:
        if trace is not None:
            probe.phase_ended(trace.phase)
            trace.set_phase(phase)
        _say(phase=phase)

    def on_step(step: int, loss: float) -> None:
        if trace is not None:
            probe.phase_ended(trace.phase)
            trace.set_phase(f"after step {step + 1}")
        _say(phase="training", step=step + 1, loss=loss)

    with trace if trace is not None else contextlib.nullcontext(), probe or contextlib.nullcontext():
        r = helpers.train_run(spec["name"], build, blocks, runtime=runtime, ds_config=cfg,
                              plain_pytorch=spec["plain_pytorch"], steps=spec["steps"],
                              checkpointing=spec["checkpointing"], untimed_steps=spec["untimed_steps"],
                              seed=spec["seed"], model_name=spec["model"], nvme_path=spec["nvme_path"], progress=False,
                              on_step=on_step, on_phase=on_phase, estimated_bytes=spec["estimated_vram_bytes"],
                              time_micro_batches=spec.get("time_micro_batches", False))
    if trace is not None:
        r.extras["host_trace"] = {**trace.as_dict(), "memory": probe.as_dict()}
    if rt.COMPILED_OPS:
        r.extras["compiled_ops"] = list(rt.COMPILED_OPS)
    tmp = Path(spec["result"]).with_suffix(".part")
    tmp.write_text(json.dumps(r.as_dict()))
    os.replace(tmp, spec["result"])
    _say(phase="done", step=spec["steps"])
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
