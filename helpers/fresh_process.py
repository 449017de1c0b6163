"""One training run in a fresh child process, measured from outside: how notebook 02 runs its big models.

A notebook kernel keeps what earlier runs used (pinned buffers cached by torch, glibc's heap, imported libraries),
so on a 12.7 GB Colab VM the third offload config in one kernel can be killed although each fits on its own. A child
process starts clean, and its peak RAM belongs to that config alone, as `benchmarks/ladder.py` measures it. The child
asks the kernel's out-of-memory killer to pick it first (`oom_score_adj` 1000), so a config that does not fit kills
the child, not your notebook: the kernel reports it and goes on.

    r = train_in_fresh_process(FreshRunSpec("ZeRO-3, optimizer on NVMe", ds_config, "gpt2-large", tokenizer_dir=...))

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helpers.memory import GB, GiB

if TYPE_CHECKING:
    from helpers.train import RunResult

__all__ = [ "child_baseline_rss", "OffloadRuns"]

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


@dataclass
class FreshRunSpec:
    """One run for `train_in_fresh_process`: what the child trains, and how the kernel watches it (notebook 02 through
    `OffloadRuns.train`; benchmarks/ladder.py, offload_speed.py, host_memory.py, overflow_check.py).

        spec = FreshRunSpec("ZeRO-3, optimizer on NVMe", ds_config, "gpt2-large", tokenizer_dir=WORK / "tokenizer")
        r = train_in_fresh_process(spec)

    The run, as `helpers.train_run` takes it in the child:
      name: the run's name (RunResult.name, the progress bar's label).
      ds_config: the DeepSpeed config, the single source of truth for micro-batch, accumulation, learning rate and
        warm-up (also with `plain_pytorch`).
      model: a helpers.models.GPT2_LADDER name (built with GPT-2's own vocabulary of 50,257).
      tokenizer_dir: the tokenizer the child packs the text with (a `helpers.train_tokenizer` folder).
      plain_pytorch: train the same numbers without DeepSpeed (train_run's baseline).
      steps: optimizer steps. untimed_steps: the first steps, left out of tokens/s.
      seq_len, dataset, max_blocks: the training blocks (`helpers.pack_blocks` of `helpers.load_text_dataset(dataset)`).
      checkpointing: activation checkpointing. seed: the model's initial weights and the batch order.
      estimated_vram_bytes: the estimate the record carries beside the measurement (RunResult.estimated_vram_gib).
    How the kernel watches it:
      progress: a progress bar in the kernel (phase, step, loss, the child's peak RSS so far).
      timeout_s: kill the child after this many seconds (RunResult.error says so; None: no limit).
      gpu: CUDA_VISIBLE_DEVICES for the child (None: the kernel's).
    The benchmarks' switches (notebook 02 leaves them at their defaults):
      mmap_threshold_mib: the child calls `helpers.mmap_large_allocations` with it first (0: glibc's default).
      cpus: the CPU cores the child is pinned to (benchmarks/ladder.py runs rungs side by side).
      wrap, env: put before the child's command line, added to its environment (ladder.py and offload_speed.py
        --emulate start it inside a Colab enclosure that way).
      time_micro_batches: see `helpers.train_run` (benchmarks/offload_speed.py).
      trace_host_bytes: > 0 records every host storage of at least that many bytes the run allocates, by the
        DeepSpeed line that asked for it (`helpers.host_trace`, issue 25), in `extras["host_trace"]`; it slows the run
        (a Python call per operator), so never on a timed run (benchmarks/host_memory.py).
      chunked_overflow_check: the child calls `helpers.chunk_zero3_overflow_check()` first (fp16 ZeRO-3 with the
        optimizer offloaded: ~3 bytes per parameter less host RAM at each step; DeepSpeed 0.19.8 only).
    """

    name: str
    ds_config: dict[str, Any]
    model: str
    tokenizer_dir: str | Path
    plain_pytorch: bool = False
    steps: int = 4
    seq_len: int = 512
    dataset: str = "local"
    max_blocks: int = 256
    checkpointing: bool = True
    untimed_steps: int = 1
    seed: int = 0
    estimated_vram_bytes: int = 0
    progress: bool = True
    timeout_s: float | None = None
    gpu: str | None = None
    # the benchmarks' switches
    mmap_threshold_mib: float = 0.0
    cpus: set[int] | None = None
    wrap: list[str] | None = None
    env: dict[str, str] | None = None
    time_micro_batches: bool = False
    trace_host_bytes: int = 0
    chunked_overflow_check: bool = False

    def for_child(self, result_path: Path) -> dict[str, Any]:
        """What the child reads (its spec.json): the run, and where to write its RunResult."""
        return {"name": self.name, "ds_config": self.ds_config, "plain_pytorch": self.plain_pytorch,
                "model": self.model, "tokenizer_dir": str(self.tokenizer_dir), "steps": self.steps,
                "seq_len": self.seq_len, "dataset": self.dataset, "max_blocks": self.max_blocks,
                "checkpointing": self.checkpointing, "untimed_steps": self.untimed_steps, "seed": self.seed,
                "mmap_threshold_mib": self.mmap_threshold_mib,
                "result": str(result_path), "estimated_vram_bytes": int(self.estimated_vram_bytes),
                "time_micro_batches": self.time_micro_batches, "trace_host_bytes": int(self.trace_host_bytes),
                "chunked_overflow_check": self.chunked_overflow_check}


def train_in_fresh_process(spec: FreshRunSpec) -> "RunResult":
    """Train `spec.model` with `spec.ds_config` (`plain_pytorch`: without DeepSpeed) in a child process, through
    `helpers.train_run` (notebook 02, through `OffloadRuns.train`; the benchmarks).

    Returns the child's RunResult. If the child dies (out-of-memory killer, a crash inside DeepSpeed's C++ code,
    the time limit), `error` says how, and `peak_rss_gb` is the peak seen from outside. Interrupting the cell kills
    the child and its NVMe files stay for the caller to remove. An NVMe config is refused (ConfigError) before the
    child starts when its folder lacks what `spec.model` writes there. `FreshRunSpec` says what each field does.
    """
    from helpers.train import RunResult, _check_nvme_need, _check_nvme_space, _nvme_folders

    folders = [] if spec.plain_pytorch else _nvme_folders(spec.ds_config)
    if folders:  # the disk this model's NVMe files need, before a child starts (issue 41 item 1)
        from helpers.models import model_shape

        shape = model_shape(spec.model)
        _check_nvme_space(folders)
        _check_nvme_need(spec.ds_config, shape.n_params, shape.largest_layer_params, model=spec.model)

    with tempfile.TemporaryDirectory(prefix="ds-course-child-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec.for_child(result_path)))
        started = time.perf_counter()
        proc = _start_child(spec, spec_path)
        state, stderr_tail, timed_out = _watch_child(proc, spec, started)
        seconds = time.perf_counter() - started
        if result_path.exists() and proc.returncode == 0:
            result = RunResult.from_dict(json.loads(result_path.read_text()))
            result.peak_rss_gb = round(max(result.peak_rss_gb, state["peak_rss"] / GB), 3)
            if result.extras.get("compiled_ops"):
                print(f"  note: this child compiled DeepSpeed's {', '.join(result.extras['compiled_ops'])} op first (not "
                      "cached yet), so its RAM peak includes the compiler's. helpers.runtime.build_ops(...) before the first "
                      "measured run avoids that.", flush=True)
            return result
        cfg = spec.ds_config
        result = RunResult(name=spec.name, model=spec.model, params=0,
                           config="plain PyTorch" if spec.plain_pytorch else spec.name,
                           precision="", micro_batch=int(cfg["train_micro_batch_size_per_gpu"]),
                           grad_accum=int(cfg.get("gradient_accumulation_steps", 1)), seq_len=spec.seq_len,
                           steps=spec.steps, checkpointing=spec.checkpointing, runtime="", seconds=round(seconds, 1),
                           peak_rss_gb=round(state["peak_rss"] / GB, 3),
                           estimated_vram_gib=round(spec.estimated_vram_bytes / GiB, 3))
        result.error = _death(proc.returncode, timed_out, spec.timeout_s, state, stderr_tail)
        return result


def _start_child(spec: FreshRunSpec, spec_path: Path) -> subprocess.Popen:
    """`python -m helpers.fresh_process spec.json` (after `spec.wrap`), in `spec.env` and on `spec.gpu`/`spec.cpus`."""
    child_env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                     **(spec.env or {}))
    if spec.gpu is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = spec.gpu
    cpus = spec.cpus

    def prepare() -> None:  # in the child, before Python starts
        if cpus:
            os.sched_setaffinity(0, cpus)

    cmd = [*(spec.wrap or []), sys.executable, "-m", "helpers.fresh_process", str(spec_path)]
    return subprocess.Popen(cmd, cwd=str(ROOT), env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=prepare if cpus else None)


def _watch_child(proc: subprocess.Popen, spec: FreshRunSpec,
                 started: float) -> tuple[dict[str, Any], list[str], bool]:
    """Follow the child until it ends: its progress lines into a progress bar, the peak RSS of its process tree, the
    last 40 lines of its stderr; killed at `spec.timeout_s` or when the cell is interrupted (then re-raised).
    Returns (state: phase, step, loss, peak_rss), the stderr tail, and whether the time limit stopped it."""
    import psutil
    from helpers.progress import progress_bar

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
    bar = progress_bar(total=spec.steps, desc=spec.name, disable=not spec.progress)
    timed_out = False
    shown: dict[str, str] = {}
    try:
        while proc.poll() is None:
            state["peak_rss"] = max(state["peak_rss"], _tree_rss(watched))
            if bar.n != state["step"]:
                bar.update(state["step"] - bar.n)
            post = {"phase": state["phase"], "peak RSS": f"{state['peak_rss'] / GB:.1f} GB"}
            if state["loss"] is not None:
                post["loss"] = f"{state['loss']:.3f}"
            if post != shown:  # redraw only when something changed
                bar.set_postfix(post)
                shown = post
            if spec.timeout_s is not None and time.perf_counter() - started > spec.timeout_s:
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
    return state, stderr_tail, timed_out


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


def _stop_group(proc: subprocess.Popen, drain: bool = True) -> None:
    """SIGINT to the child's process group, SIGKILL after 5 s. `drain`: read its pipes while waiting (communicate);
    False where another thread reads them (helpers.capstone.run_script), which only waits."""
    for sig, wait in ((signal.SIGINT, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        try:
            if drain:
                proc.communicate(timeout=wait)
            else:
                proc.wait(timeout=wait)
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
    from helpers.train import MeasureSettings

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
        measure = MeasureSettings(untimed_steps=spec["untimed_steps"], progress=False, on_step=on_step,
                                  on_phase=on_phase, time_micro_batches=spec.get("time_micro_batches", False))
        r = helpers.train_run(spec["name"], build, blocks, runtime=runtime, ds_config=cfg,
                              plain_pytorch=spec["plain_pytorch"], steps=spec["steps"],
                              checkpointing=spec["checkpointing"], seed=spec["seed"], model_name=spec["model"],
                              estimated_bytes=spec["estimated_vram_bytes"], measure=measure)
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


# ---------------------------------------------------------------- notebook 02's runs: pre-flight, then a fresh child

# the RAM account's rows (helpers.planner's and helpers.memory's names) in the words notebook 02 uses
RAM_ROW_WORDS = {
    "params": "parameters", "grads": "gradients", "optimizer": "optimizer: fp32 weights + 2 moments",
    "activations": "activations", "buffers": "offload/swap buffers", "step on host": "fp16 overflow check, a moment",
    "runtime": "training process's growth", "staging": "zero.Init leftovers (CPU run)",
    "model copy": "fp32 model built in RAM first", "step temporaries": "optimizer step's temporaries",
    "pinned copy": "pinned gradient copy at initialize",
    "already in use": "this kernel + a fresh child",
}
# short column heads of the RAM account, per course config (helpers.config.OFFLOAD_KINDS)
RAM_COLUMN_HEADS = {
    "zero2_offload_cpu": ("ZeRO-2", "opt: CPU", "params: GPU"), "zero3_offload_cpu": ("ZeRO-3", "opt: CPU", "params: CPU"),
    "zero3_nvme_optimizer_gpu_params": ("ZeRO-3", "opt: NVMe", "params: GPU"),
    "zero3_nvme_optimizer": ("ZeRO-3", "opt: NVMe", "params: CPU"),
    "zero3_nvme_all": ("ZeRO-3", "opt: NVMe", "params: NVMe"),
}


class OffloadRuns:
    """Notebook 02's offload configs on one runtime: each config built, checked before anything is allocated
    (`helpers.preflight`), then trained in a fresh child process (`train_in_fresh_process`), its RAM measured with this
    kernel's share; what ran, what was refused and what failed are kept for the summary (notebook 02).

        runs = helpers.OffloadRuns(runtime, WORK, nvme_path=NVME_PATH, seq_len=512, micro_batch=2, steps=4, lr=3e-4)
        runs.prepare()                       # DeepSpeed's ops built, tokenizer and blocks, a fresh child's RSS
        print(runs.ram_account(helpers.colab_t4_profile(), "gpt2-large"))
        cfg = runs.config("ZeRO-3, optimizer on NVMe", "gpt2-large")   # the complete DeepSpeed config it runs
        r = runs.train("ZeRO-3, optimizer on NVMe", "gpt2-large", cfg)
    """

    def __init__(self, runtime: Any, work: str | Path, *, nvme_path: str | Path, seq_len: int, micro_batch: int,
                 steps: int, lr: float, seed: int = 0, run_over_ram_budget: bool = True, max_blocks: int = 512,
                 initial_scale_power: int = 12) -> None:
        from helpers.config import NAMED_CONFIGS, OFFLOAD_KINDS

        from helpers.config import _nvme_folder_to_make

        # '~/nvme' expanded (Path('~/nvme').mkdir made a folder named '~'), a file refused with a folder that is not
        self.runtime, self.work = runtime, Path(work)
        self.nvme_path = _nvme_folder_to_make(nvme_path, "NVME_PATH")
        self.seq_len, self.micro_batch, self.steps, self.lr, self.seed = seq_len, micro_batch, steps, lr, seed
        self.run_over_ram_budget, self.max_blocks = run_over_ram_budget, max_blocks
        self.initial_scale_power = initial_scale_power
        self.configs = {NAMED_CONFIGS[k].label: k for k in OFFLOAD_KINDS}  # label -> course config name
        self.results: dict[str, Any] = {}
        self.ram_used: dict[str, float] = {}  # GB: the child's peak + this kernel's share
        self.refused: dict[str, Any] = {}
        self.failed: dict[str, Any] = {}
        self.child_rss = 0
        self.blocks: Any = None
        self._fixes_said: set[str] = set()

    # -- setup
    def prepare(self) -> "OffloadRuns":
        """Build DeepSpeed's CPU Adam and async I/O ops now (no measured run compiles them), train the tokenizer, pack
        the blocks, and measure what a fresh child holds before its model exists (torch, DeepSpeed, the data)."""
        from helpers.data import load_text_dataset, pack_blocks, train_tokenizer
        from helpers.runtime import build_ops

        build_ops("cpu_adam", "async_io")
        ds = load_text_dataset("local")
        tokenizer = train_tokenizer(ds["train"]["text"], self.work / "tokenizer")
        self.blocks = pack_blocks(ds["train"], tokenizer, self.seq_len, max_blocks=self.max_blocks)
        self.child_rss = child_baseline_rss(self.work / "tokenizer", seq_len=self.seq_len, max_blocks=self.max_blocks)
        self.nvme_path.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def own_nvme(self) -> Path:
        """This kernel's NVMe folder, <nvme_path>/pid-<pid>: another kernel using the same NVMe path (a second tab
        of this notebook) swaps in its own and neither removes the other's files (issue 41 item 7)."""
        from helpers.runtime import _own_nvme_folder

        return _own_nvme_folder(self.nvme_path, make=False)

    def ram_beside(self) -> int:
        """RAM taken before a child's model exists: this kernel (after giving back what it can) + a fresh child."""
        from helpers.runtime import release_host_memory

        return release_host_memory() + self.child_rss

    # -- configs and estimates
    def kind(self, name: str) -> str:
        if name not in self.configs:
            raise ValueError(f"no offload config {name!r}. Fix: one of {list(self.configs)}")
        return self.configs[name]

    def config(self, name: str, model: str, runtime: Any = None, *, micro_batch: int | None = None) -> dict[str, Any]:
        """The complete DeepSpeed config of `name` for `model` (its NVMe buffers hold the largest tensor; NVMe files
        go to a folder of this config's own in this kernel's folder under the NVMe path, `own_nvme`).
        `initial_scale_power` 12, not DeepSpeed's 16: a higher start only adds steps skipped on fp16 overflow at the
        start, and these runs take 4 steps."""
        from helpers.config import offload_config
        from helpers.models import model_shape

        kind = self.kind(name)
        return offload_config(kind, runtime or self.runtime, largest_param=model_shape(model).largest_layer_params,
                              nvme_path=str(self.own_nvme / kind), micro_batch_size=micro_batch or self.micro_batch,
                              lr=self.lr, warmup_steps=max(1, self.steps // 10), check_paths=False,
                              initial_scale_power=self.initial_scale_power)

    def plain_estimate(self, model: str, runtime: Any = None, *, seq_len: int | None = None,
                       micro_batch: int | None = None) -> Any:
        """Plain PyTorch AMP + AdamW's estimate (activations, peak GPU bytes) for `model`."""
        from helpers.memory import estimate_run
        from helpers.models import model_shape

        rt = runtime or self.runtime
        return estimate_run(None, model_shape(model), seq_len=seq_len or self.seq_len, precision=rt.precision,
                            checkpointing=True, micro_batch=micro_batch or self.micro_batch)

    def preflight(self, name: str, model: str, runtime: Any = None, *, ram_in_use: int, seq_len: int | None = None,
                  micro_batch: int | None = None) -> Any:
        """`helpers.preflight` of config `name` for `model` beside `ram_in_use` bytes (nothing printed or raised)."""
        from helpers.models import model_shape
        from helpers.planner import preflight

        rt = runtime or self.runtime
        shape = model_shape(model)
        cfg = self.config(name, model, rt, micro_batch=micro_batch)
        act = self.plain_estimate(model, rt, seq_len=seq_len, micro_batch=micro_batch).activation_bytes
        return preflight(cfg, shape.n_params, rt, largest_layer_params=shape.largest_layer_params,
                         activation_bytes=act, zero_init=cfg["zero_optimization"]["stage"] == 3,
                         ram_in_use=ram_in_use, raise_on_failure=False)

    def reports(self, model: str, runtime: Any = None, *, ram_in_use: int, seq_len: int | None = None,
                micro_batch: int | None = None) -> dict[str, Any]:
        return {n: self.preflight(n, model, runtime, ram_in_use=ram_in_use, seq_len=seq_len, micro_batch=micro_batch)
                for n in self.configs}

    def ram_account(self, runtime: Any, model: str, *, seq_len: int | None = None, micro_batch: int | None = None,
                    ram_in_use: int | None = None, title: str = "") -> str:
        """ONE table: a column per offload config, a row per thing that lives in host RAM (GB), the total, the
        budget it must stay under, and the verdict computed from them; above it, plain PyTorch's GPU need."""
        from helpers.models import model_shape

        rt = runtime
        shape = model_shape(model)
        in_use = self.ram_beside() if ram_in_use is None else ram_in_use
        reps = self.reports(model, rt, ram_in_use=in_use, seq_len=seq_len, micro_batch=micro_batch)
        plain = self.plain_estimate(model, rt, seq_len=seq_len, micro_batch=micro_batch).peak_bytes
        lines = [title or f"{shape.name} ({shape.n_params / 1e6:,.0f}M parameters) on {rt.label}:"]
        if rt.has_gpu:
            budget = rt.vram_budget_bytes
            lines.append(f"plain PyTorch AMP + AdamW needs ~{plain / GiB:.2f} GiB of GPU memory, budget "
                         f"{budget / GiB:.2f} GiB: " + ("out of memory" if plain > budget else
                                                        "within 10% of it: out of memory likely (the allocator needs "
                                                        "room beyond the bytes counted)" if plain > 0.9 * budget
                                                        else "fits"))
        else:
            lines.append("no GPU here: what a GPU run keeps on the GPU sits in RAM too, and the rows count it")
        names = list(reps)
        rows = [r for r in RAM_ROW_WORDS if any(rep.ram_rows.get(r) for rep in reps.values())]
        rows += [r for rep in reps.values() for r in rep.ram_rows if r not in rows]
        width, col = 36, 13
        for i in range(3):
            lines.append(f"{'RAM, GB' if i == 2 else '':<{width}}"
                         + "".join(f"{RAM_COLUMN_HEADS.get(self.configs[n], (n, '', ''))[i]:>{col}}" for n in names))
        for r in rows:
            lines.append(f"{RAM_ROW_WORDS.get(r, r):<{width}}"
                         + "".join(f"{reps[n].ram_rows[r] / GB:>{col}.2f}" if reps[n].ram_rows.get(r) else f"{'-':>{col}}"
                                   for n in names))
        lines.append(f"{'total':<{width}}" + "".join(f"{reps[n].ram_needed / GB:>{col}.2f}" for n in names))
        limit = {n: reps[n].ram_budget * (1 - reps[n].ram_margin) for n in names}
        margin = next(iter(reps.values())).ram_margin
        lines.append(f"{f'must stay under ({1 - margin:.0%} of budget)':<{width}}"
                     + "".join(f"{limit[n] / GB:>{col}.2f}" for n in names))
        lines.append(f"{'verdict':<{width}}" + "".join(
            f"{('fits' if reps[n].fits else 'refused'):>{col}}"
            for n in names))
        if any(rep.disk_needed for rep in reps.values()):
            lines.append(f"{'on NVMe (GB)':<{width}}"
                         + "".join(f"{reps[n].disk_needed / GB:>{col}.2f}" if reps[n].disk_needed else f"{'-':>{col}}"
                                   for n in names))
        lines.append(f"budget {next(iter(reps.values())).ram_budget / GB:.2f} GB of RAM; the last row: "
                     f"{in_use / GB:.2f} GB measured here (this kernel + a fresh child process)")
        self._last_account = "\n".join(lines[1:])  # choose_model does not print the same table twice
        return "\n".join(lines)

    def teachable(self, model: str, ram_in_use: int) -> bool:
        """An offload config fits `model` here, and plain PyTorch does not take the kernel's RAM."""
        from helpers.config import course_config
        from helpers.models import model_shape
        from helpers.planner import preflight

        if not any(r.fits for r in self.reports(model, ram_in_use=ram_in_use).values()):
            return False
        shape = model_shape(model)
        cfg = course_config("plain", self.runtime, micro_batch_size=self.micro_batch, lr=self.lr)
        rep = preflight(cfg, shape.n_params, self.runtime, largest_layer_params=shape.largest_layer_params,
                        activation_bytes=self.plain_estimate(model).activation_bytes, raise_on_failure=False)
        return not any(p.startswith("CPU RAM") for p in rep.problems)

    def choose_model(self, model: str) -> str:
        """This runtime's RAM account for `model`; where no offload config fits it here, the largest GPT-2 one of them
        trains (printed, with its own account). Returns the model the lesson trains."""
        from helpers.models import GPT2_LADDER, model_shape

        self._asked = model
        in_use = self.ram_beside()
        before = self._last_account
        title, account = self.ram_account(self.runtime, model, ram_in_use=in_use).split("\n", 1)
        # on Colab (or in its emulation) this runtime's account is the Colab what-if printed just before, row for row
        print(title + ("\nthe same account, row for row, as the one printed above" if account == before else
                       "\n" + account))
        if self.teachable(model, in_use):
            return model
        smaller = [m for m in reversed(GPT2_LADDER) if model_shape(m).n_params < model_shape(model).n_params]
        fallback = next((m for m in smaller if self.teachable(m, in_use)), None)
        print(f"\nNo offload config trains {model} within this runtime's RAM: "
              + (f"the lesson continues with {fallback}, the largest GPT-2 one of them trains here."
                 if fallback else "not even the smallest GPT-2 fits; the sections below print the refusals only."))
        if fallback:
            print(self.ram_account(self.runtime, fallback, ram_in_use=in_use).split("\n", 2)[2])
        return fallback or model

    # -- runs
    def plain(self, model: str) -> Any:
        """Plain PyTorch AMP + AdamW on `model` in this kernel (`helpers.train_run`: an out-of-memory error is caught,
        everything freed, the message kept); prints the verdict from the run."""
        from helpers.config import course_config
        from helpers.models import gpt2_config
        from helpers.runtime import gpu_allocated_bytes, release_host_memory
        from helpers.train import MeasureSettings, train_run

        rt = self.runtime
        config = gpt2_config(model)

        def build() -> Any:
            import torch
            from transformers import AutoModelForCausalLM

            torch.manual_seed(self.seed)
            return AutoModelForCausalLM.from_config(config)

        name = "plain PyTorch AMP" if rt.has_gpu else "plain PyTorch"
        cfg = course_config("plain", rt, micro_batch_size=self.micro_batch, lr=self.lr,
                            warmup_steps=max(1, self.steps // 10))
        estimate = self.plain_estimate(model).peak_bytes
        baseline = gpu_allocated_bytes()
        r = train_run(name, build, self.blocks, runtime=rt, ds_config=cfg, plain_pytorch=True, steps=self.steps,
                      checkpointing=True, estimated_bytes=estimate, model_name=model,
                      measure=MeasureSettings(untimed_steps=1))
        after = gpu_allocated_bytes()
        budget = f"{rt.vram_budget_bytes / GiB:.2f} GiB"
        if r.error:
            print(f"{model} with {name}: {r.error[:300]}")
            print(f"peak allocated by the run before the failure {r.peak_vram_gib:.2f} GiB (above the "
                  f"{baseline / GiB:.2f} GiB held before it), estimated {estimate / GiB:.2f} GiB, budget "
                  f"{budget}; after teardown {(after - baseline) / 2**20:.0f} MiB above the baseline")
            if after > baseline + 2**20:
                raise RuntimeError("GPU memory is not back at its baseline after the out-of-memory error")
        elif rt.has_gpu:
            print(f"{model} FITS with {name} here: {r.peak_vram_gib:.2f} GiB of {budget} (estimated "
                  f"{estimate / GiB:.2f} GiB)" + (": this GPU is not held to a T4's budget (DS_COURSE_T4_BUDGET=1 "
                                                  "shows the wall)" if not (rt.t4_budget or rt.is_colab) else ""))
        else:
            print(f"no GPU: there is no VRAM wall on CPU; {name} trained {model} in RAM on CPU (loss "
                  f"{r.losses[0]:.3f} -> {r.losses[-1]:.3f}). The Colab what-if above shows the T4's wall.")
        if not r.error:
            self.results[name] = r
            self.ram_used[name] = r.peak_rss_gb
        self.plain_result = r
        print(f"this kernel now holds {release_host_memory() / GB:.2f} GB of RAM")
        return r

    def train(self, name: str, model: str, cfg: dict[str, Any] | None = None) -> Any:
        """Pre-flight `cfg` (default `config(name, model)`) beside this kernel, then train it in a fresh child process;
        prints measured against estimated. Returns the RunResult, or None when refused or when the child failed."""
        import shutil

        from helpers.config import _nvme_folder_to_make, _nvme_folders_of
        from helpers.memory import estimate_run
        from helpers.models import model_shape
        from helpers.planner import preflight
        from helpers.records import record_figure
        from helpers.runtime import _own_nvme_folder, release_host_memory

        rt = self.runtime
        shape = model_shape(model)
        cfg = cfg if cfg is not None else self.config(name, model)
        est = estimate_run(cfg, shape, seq_len=self.seq_len, precision=rt.precision, checkpointing=True)
        kernel_rss = release_host_memory()
        report = preflight(cfg, shape.n_params, rt, largest_layer_params=shape.largest_layer_params,
                           activation_bytes=est.activation_bytes, zero_init=cfg["zero_optimization"]["stage"] == 3,
                           ram_in_use=kernel_rss + self.child_rss, raise_on_failure=False)
        print(f"{name}, {model}: pre-flight {report.needs()} with this kernel ({kernel_rss / GB:.2f} GB) and a fresh "
              f"child ({self.child_rss / GB:.2f} GB) -> " + ("fits" if report.fits else "; ".join(report.problems)))
        if not report.fits:
            ram_only = all(p.startswith("CPU RAM") for p in report.problems)
            if ram_only and self.run_over_ram_budget and not rt.is_colab \
                    and report.ram_needed < 0.8 * rt.ram_total_bytes:
                print(f"  on Colab it is refused; this machine has {rt.ram_total_bytes / GB:.0f} GB of RAM, so it runs "
                      "anyway, to measure how far past the budget it goes")
            else:
                fix = report.fix()
                print("  REFUSED before allocating anything. "
                      + ("The fix is the one printed above." if fix in self._fixes_said else fix + "."))
                self._fixes_said.add(fix)
                self.refused[name if model == self._model else f"{name}, {model}"] = report
                return None
        nvme_dirs = {_nvme_folder_to_make(folder) for folder in _nvme_folders_of(cfg)}  # the config's, its one home
        if nvme_dirs:
            _own_nvme_folder(self.nvme_path)  # made; folders of kernels that are gone removed; removed at exit
        for d in nvme_dirs:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        try:
            r = train_in_fresh_process(FreshRunSpec(name, cfg, model, tokenizer_dir=self.work / "tokenizer",
                                                    steps=self.steps, seq_len=self.seq_len,
                                                    max_blocks=self.max_blocks, seed=self.seed,
                                                    estimated_vram_bytes=est.peak_bytes))
        finally:  # an interrupted cell leaves no swap files behind
            for d in nvme_dirs:
                shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(OSError):  # this kernel's folder, once empty
                self.own_nvme.rmdir()
        if r.error:
            print(f"  the child process did not finish: {r.error[:400]}")
            print("  " + (f"pre-flight had predicted {report.ram_needed / GB:.2f} GB of RAM: too low for this runtime."
                          if "out-of-memory killer" in r.error else "DeepSpeed failed inside the child (not a memory "
                          "limit).") + " This kernel is unharmed.")
            self.failed[name] = r
            return None
        if r.params != shape.n_params:
            raise RuntimeError(f"the child trained {r.params:,} parameters, not {model}'s {shape.n_params:,}")
        total_gb = r.peak_rss_gb + kernel_rss / GB
        on = "" if rt.has_gpu else " on CPU"
        print(f"  loss {r.losses[0]:.3f} -> {r.losses[-1]:.3f}; {r.speed_text()}{on}")
        if rt.has_gpu:
            print(f"  GPU peak {r.peak_vram_gib:.2f} GiB (estimated {r.estimated_vram_gib:.2f}) of "
                  f"{rt.vram_budget_bytes / GiB:.2f} GiB")
        print(f"  peak RSS: child {r.peak_rss_gb:.2f} GB + this kernel {kernel_rss / GB:.2f} GB = {total_gb:.2f} GB "
              f"(estimated {report.ram_needed / GB:.2f}); budget {rt.ram_budget_bytes / GB:.2f} GB: "
              + ("within it" if total_gb <= rt.ram_budget_bytes / GB else
                 f"{total_gb / (rt.ram_budget_bytes / GB):.1f}x OVER it: on Colab it would be killed"))
        if nvme_dirs:
            print(f"  NVMe folder peak {r.disk_gb:.2f} GB (estimated {report.disk_needed / GB:.2f} GB)")
        if not r.losses[-1] < r.losses[0]:
            raise RuntimeError(f"{name}: the loss did not fall ({r.losses[0]:.3f} -> {r.losses[-1]:.3f})")
        self.results[name] = r
        self.ram_used[name] = total_gb
        record_figure(name, {"peak_vram_gib": r.peak_vram_gib, "estimated_vram_gib": r.estimated_vram_gib,
                             "peak_rss_gb": round(r.peak_rss_gb, 2), "kernel_rss_gb": round(kernel_rss / GB, 2),
                             "estimated_rss_gb": round(report.ram_needed / GB, 2), "disk_gb": round(r.disk_gb, 2),
                             "tokens_per_s": r.tokens_per_s,
                             "loss_first_last": [round(r.losses[0], 3), round(r.losses[-1], 3)]})
        return r

    plain_result: Any = None

    def compare(self) -> str:
        """What ran, side by side: the results table, speed ratios of median steps against the first offload config
        that ran (each ran once: no run-to-run noise measured, so none is judged), the config that needed least RAM,
        and the share of an NVMe-optimizer step the disk takes on this runtime (the step-time model, measured rates)."""
        from helpers.limits import measure_limits
        from helpers.models import model_shape
        from helpers.step_time import estimate_step_time
        from helpers.train import results_table, speed_ratios

        ran = list(self.results.values())
        if not ran:
            return "no config trained here (each refusal is printed above with its fix): nothing to compare."
        lines = [results_table(ran)]
        offload = [r.name for r in ran if r.name in self.configs]
        cpu = "" if self.runtime.has_gpu else "; CPU: fp32 on this machine's cores, which says little about a GPU"
        if len(offload) > 1:
            lines.append(speed_ratios(ran, reference=offload[0]).table(cpu))
        least = min(self.ram_used, key=self.ram_used.get)
        lines.append(f"least RAM: {least} ({self.ram_used[least]:.2f} GB with this kernel's share)")
        nvme = "ZeRO-3, params on GPU, optimizer on NVMe"
        if nvme in self.results:
            shape = model_shape(self.results[nvme].model or self._model)
            est = estimate_step_time(self.config(nvme, shape.name), shape, measure_limits(str(self.nvme_path)),
                                     seq_len=self.seq_len, micro_batch=self.micro_batch, name=nvme)
            disk = est.resource_seconds().get("disk", 0.0)
            self.disk_share = disk / est.seconds if est.seconds else 0.0
            lines.append(f"{nvme}: the disk takes {self.disk_share:.0%} of a step ({disk:.2f} of {est.seconds:.2f} s, "
                         "predicted from this runtime's measured disk speed), paid once per optimizer step")
        return "\n".join(lines)

    disk_share: float | None = None

    _asked: str = ""
    _last_account: str = ""  # the rows of the last table ram_account made

    def summary(self, *, zero3_init: tuple[float, float], resume_gap: float, logit_diff: float) -> str:
        """The notebook's summary, every line computed from the runs above."""
        rt, model, asked_model = self.runtime, self._model, self._asked
        budget = rt.ram_budget_bytes / GB
        lines = []
        if asked_model and asked_model != model:
            lines.append(f"- no offload config could train {asked_model} within this runtime's {budget:.2f} GB of RAM, "
                         f"so the lesson ran on {model}, the largest GPT-2 one of them trains here.")
        p = self.plain_result
        if p is not None and p.error:
            lines.append(f"- plain PyTorch AMP could not train {model} on {rt.label}: out of memory at "
                         f"{p.peak_vram_gib:.2f} GiB (estimated need {self.plain_estimate(model).peak_bytes / GiB:.2f} GiB).")
        for name, r in self.results.items():
            if name not in self.configs:
                continue
            rss = self.ram_used[name]
            lines.append(f"- {name}: trained it (loss {r.losses[0]:.2f} -> {r.losses[-1]:.2f}) with "
                         + (f"{r.peak_vram_gib:.2f} GiB on the GPU, " if rt.has_gpu else "")
                         + f"{rss:.2f} GB of RAM ({'within' if rss <= budget else 'OVER'} the {budget:.2f} GB budget)"
                         + (f", {r.disk_gb:.1f} GB on disk" if r.disk_gb else "")
                         + f", {r.speed_spread()[1]:,.0f} tokens/s (median step)" + ("" if rt.has_gpu else " on CPU") + ".")
        for name, rep in self.refused.items():
            lines.append(f"- {name}: refused by pre-flight ({'; '.join(rep.problems)}).")
        for name, r in self.failed.items():
            lines.append(f"- {name}: its child process did not finish ({r.error[:120]}); this kernel went on.")
        if self.disk_share is not None:
            lines.append(f"- with the optimizer on NVMe the disk takes {self.disk_share:.0%} of a step here (predicted): "
                         "more tokens per optimizer step share that cost (Going deeper).")
        plain_loss, zero3_loss = zero3_init
        lines.append(f"- ZeRO-3 built through HfDeepSpeedConfig starts at the same loss as a normal model ({zero3_loss:.3f} "
                     f"vs {plain_loss:.3f}); engine.load_checkpoint repeats the straight run (largest gap "
                     f"{resume_gap:.1e}); zero_to_fp32 gives a Hugging Face model with the engine's logits (max "
                     f"difference {logit_diff:.1e}).")
        return "\n".join(lines)

    _model: str = ""  # the lesson's model (set by the notebook through `use`): refusals of it are named by config only

    def use(self, model: str) -> str:
        self._model = model
        return model
