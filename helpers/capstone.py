"""Notebook 07, the capstone: your model on a T4. The notebook writes a standalone `train.py` (a %%writefile cell
holding notebooks/programs/train_your_model.py word for word; it imports no helpers) and its DeepSpeed JSON; this
module checks what the learner typed, picks the config with the planner, and runs the script in a fresh process
while watching it.

- `check_capstone_inputs`: the parameters cell's values, refused with the fix before anything runs (issue 41's style);
- `capstone_model`: where train.py's from_pretrained gets a model id from (the Hub, the local cache, or offline a
  GPT-2-shaped stand-in built from its config once the plan passes, saying so) and the words for its weights;
- `pick_plan`: the first course config (`helpers.planner.FALLBACK_LADDER`: ZeRO-2, then the offload configs) that the
  planner predicts fits this runtime, or a refusal naming a smaller model that one does fit;
- `capstone_data`: the corpus train.py reads (a Hub name, or offline the shipped corpus, saying so);
- `run_script`: train.py in a fresh process (a process group of its own), with a progress bar from the first second,
  the peak RSS of its process tree, the peak GPU memory it logs, and the disk its output and offload folders take;
  an NVMe offload swaps in this kernel's own folder under the course's, removed after the run (issue 41 item 7).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helpers.checks import ConfigError, check_number
from helpers.memory import GB, GiB, folder_bytes

if TYPE_CHECKING:
    from helpers.hardware import Runtime
    from helpers.planner import Plan

__all__ = ["capstone_data", "capstone_model", "check_capstone_inputs", "pick_plan", "run_script"]

ROOT = Path(__file__).resolve().parent.parent
CAPSTONE_SCRIPT = ROOT / "notebooks" / "programs" / "train_your_model.py"
_EXAMPLE_MODEL = "gpt2-medium"


def check_capstone_inputs(model_id: Any, *, seq_len: Any, steps: Any, micro_batch: Any) -> None:
    """The parameters cell's values: a model id (a non-empty string), whole positive numbers (notebook 07)."""
    if not isinstance(model_id, str) or not model_id.strip() or model_id != model_id.strip():
        raise ConfigError(f"MODEL_ID must be a Hugging Face model id or a model folder (got {model_id!r}). "
                          f"Fix: MODEL_ID = {_EXAMPLE_MODEL!r}.")
    check_number("SEQ_LEN", seq_len, positive=True, integer=True, example=512, hint=" (tokens per block)")
    check_number("STEPS", steps, positive=True, integer=True, example=30)
    check_number("MICRO_BATCH", micro_batch, positive=True, integer=True, example=4)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where train.py's `from_pretrained` gets a model id from (`capstone_model`), decided before anything is built."""

    model_id: str
    weights: str  # the words for its weights: "pretrained", "stand-in (...)", "your folder's"
    stand_in: bool  # no Hub here: a GPT-2 of the id's size is built from its config (random weights) by `path`

    def path(self, work: str | Path) -> str:
        """What train.py's --model gets: the id (or folder) itself, or the stand-in folder, built now if it is not
        there yet (a GPT-2 of the id's size from its config, seeded, with the course's tokenizer)."""
        if not self.stand_in:
            return self.model_id
        from helpers.data import load_text_dataset, train_tokenizer
        from helpers.models import save_model_from_config

        folder = Path(save_model_from_config(Path(work) / f"stand-in-{self.model_id}", self.model_id))
        if not (folder / "tokenizer.json").is_file():
            tokenizer = train_tokenizer(load_text_dataset("local")["train"]["text"], Path(work) / "stand-in-tokenizer")
            tokenizer.save_pretrained(str(folder))
        return str(folder)


def capstone_model(model_id: str) -> ModelSource:
    """Where the id the learner typed loads from, checked without downloading or building anything (notebook 07).

    A folder loads as it is. A Hub id loads from the Hub (Colab) or the local cache (the course's stand-in cache: its
    weights are called "stand-in"). Where neither serves it, a GPT-2 size of the course (helpers.models.GPT2_LADDER:
    'gpt2-tiny' ... 'gpt2-xl') becomes a stand-in built from its config (`ModelSource.path`, after the plan has
    passed); any other id is refused with the fix."""
    from helpers.hub import HubUnreachableError, check_hub_name, hub_available, hub_stand_in
    from helpers.models import GPT2_LADDER, model_folder_problem

    if Path(model_id).is_dir():
        problem = model_folder_problem(model_id)
        if problem:
            raise ConfigError(f"MODEL_ID={model_id!r}: {problem}. Fix: a folder that save_pretrained wrote, or "
                              f"MODEL_ID = {_EXAMPLE_MODEL!r}.")
        return ModelSource(model_id, "your folder's", False)
    stand_in = ModelSource(model_id, "stand-in (built from its config, random)", True)
    if model_id == "gpt2-tiny":  # the course's CPU size, not a Hub id
        return stand_in
    if hub_available(model_id=model_id):
        return ModelSource(model_id, "stand-in (course-initialised, not the real model's)" if hub_stand_in()
                           else "pretrained", False)
    try:
        where = check_hub_name(model_id, "model", variable="MODEL_ID")
    except HubUnreachableError as exc:
        if model_id in GPT2_LADDER:
            return stand_in
        reason = str(exc).split(". Fix:")[0]
        raise ConfigError(f"MODEL_ID={model_id!r} cannot load here: {reason}. Fix: MODEL_ID = {_EXAMPLE_MODEL!r} "
                          "(built from its config where the Hub is out of reach; with internet, the real one), or a "
                          "folder that save_pretrained wrote.") from None
    if where == "local" and model_id not in GPT2_LADDER:  # not a Hub id at all: from_pretrained would fail
        raise ConfigError(f"MODEL_ID={model_id!r} is neither a folder nor a Hugging Face model id. Fix: MODEL_ID = "
                          f"{_EXAMPLE_MODEL!r}, or a folder that save_pretrained wrote.")
    return ModelSource(model_id, "pretrained", False) if where != "local" else stand_in


def pick_plan(model: str, runtime: "Runtime", *, seq_len: int, micro_batch: int,
              nvme_path: str | None = None, ram_in_use: int | None = None) -> tuple[str, "Plan"]:
    """(course config name, its plan) for the first config of helpers.planner.FALLBACK_LADDER predicted to fit `runtime`
    (notebook 07). `ram_in_use`: RAM other processes hold beside the run (default: this kernel's RSS now, as
    helpers.plan counts it); 0 plans for a fresh runtime, where nothing but the script holds RAM, so the answer does not
    depend on what this kernel did before.

    A model no course config fits, NVMe included, is refused with a smaller model that fits (checked by the same
    planner); a `seq_len` longer than the model takes, with the longest it takes."""
    from helpers.config import NAMED_CONFIGS
    from helpers.models import GPT2_LADDER, model_shape
    from helpers.planner import FALLBACK_LADDER, PlanHost, plan

    shape = model_shape(model)
    if shape.n_positions and seq_len > shape.n_positions:
        raise ConfigError(f"SEQ_LEN={seq_len} is longer than {shape.name} takes ({shape.n_positions} positions: a "
                          f"longer block fails in its position embedding). Fix: SEQ_LEN = {shape.n_positions}.")
    def plan_with(kind: str, what: Any, seq: int) -> Any:
        """plan() of `what` (a model or its shape) with the course config `kind` (its stage and offload devices)."""
        args = NAMED_CONFIGS[kind].placement
        return plan(what, micro_batch_size=micro_batch, seq_len=seq, runtime=runtime, zero_init=args.get("stage") == 3,
                    host=PlanHost(nvme_path=nvme_path, ram_in_use=ram_in_use), **args)

    last = None
    for kind in FALLBACK_LADDER:
        p = plan_with(kind, shape, seq_len)
        if p.report is not None and p.report.fits:
            return kind, p
        last = p if p.report is not None else last
    smaller = None
    for name in reversed([n for n in GPT2_LADDER if model_shape(n).n_params < shape.n_params]):
        if any((q := plan_with(k, name, min(seq_len, 1024))).report is not None and q.report.fits
               for k in FALLBACK_LADDER):
            smaller = name
            break
    why = "; ".join(last.report.problems) if last is not None and last.report is not None else "no config builds"
    fix = (f"MODEL_ID = {smaller!r} ({model_shape(smaller).n_params / 1e6:,.0f}M parameters: the planner predicts a "
           "course config fits it)" if smaller else "a smaller model, or a runtime with more memory")
    raise ConfigError(f"{shape.name} ({shape.n_params / 1e9:.2f}B parameters) is predicted not to fit {runtime.label} "
                      f"with any course config, NVMe offload included (the last, {FALLBACK_LADDER[-1]}: {why}). "
                      f"Fix: {fix}.")


def capstone_data(dataset: Any) -> tuple[str, str]:
    """(what train.py's --data gets, the words for it): a folder of .txt files as it is; a Hub corpus ("name:config")
    where the Hub or the local cache serves it; otherwise, for the course's default corpus, the shipped one
    (data/shakespeare), saying so (notebook 07). Another name the Hub cannot serve is refused with the fix."""
    from helpers.data import LOCAL_CORPUS
    from helpers.hub import HUB_DEFAULTS, check_hub_name, hub_available, hub_stand_in

    if not isinstance(dataset, str) or not dataset.strip():
        raise ConfigError(f"DATASET must be a Hub corpus 'name:config' or a folder of .txt files (got {dataset!r}). "
                          f"Fix: DATASET = {HUB_DEFAULTS['dataset']!r}.")
    if Path(dataset).is_dir():
        return dataset, "your folder of .txt files"
    if hub_available(dataset=dataset):
        return dataset, ("the course's stand-in cache: the shipped corpus under WikiText's name" if hub_stand_in()
                         else "from the Hugging Face Hub")
    if dataset != HUB_DEFAULTS["dataset"] and check_hub_name(dataset, "dataset", variable="DATASET") != "local":
        return dataset, "from the Hugging Face Hub"
    return str(LOCAL_CORPUS), "the shipped corpus, as no Hugging Face Hub answers here"


@dataclasses.dataclass
class ScriptRun:
    """What one run of train.py did, measured from outside (RAM, disk) and read from its loss.jsonl (losses, GPU)."""

    returncode: int
    seconds: float
    losses: list[float]
    step_seconds: list[float]
    peak_rss_bytes: int  # the child's process tree (RSS), sampled every 0.2 s
    peak_gpu_bytes: int  # torch.cuda.max_memory_allocated() as train.py logged it (0 on CPU)
    peak_disk_bytes: int  # the output folder and the NVMe folder together
    checkpoint_bytes: int
    tail: list[str]  # the last lines the script printed (stdout and stderr)
    peak_main_rss_bytes: int = 0  # train.py's own process alone
    children: tuple[str, ...] = ()  # the processes train.py started (a compiler building an op, workers), by name
    peak_with_kernel_bytes: int = 0  # this kernel's RSS + the script's process tree, sampled together (0: not sampled)
    # the same sum's peak in each phase train.py announced (SCRIPT_PHASES), in the order they came
    peak_ram_by_phase: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def trained(self) -> bool:
        return self.returncode == 0 and bool(self.losses)

    def loss_drop(self, k: int = 3) -> tuple[float, float]:
        """Means of the first and the last `k` steps' losses."""
        k = max(1, min(k, len(self.losses) // 2 or 1))
        return sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k

    @property
    def peak_ram_bytes(self) -> int:
        """What the runtime's RAM held at the run's peak: this kernel and the script's process tree, sampled together
        (the quantity the planner's RAM estimate and the budget are about); the tree alone where it was not sampled."""
        return self.peak_with_kernel_bytes or self.peak_rss_bytes

    @property
    def _ram_text(self) -> str:
        """The peak RSS of this kernel and the script together, then train.py's own peak, and its process tree's where
        the processes it started (a compiler checking or building an op) added more than 5 %."""
        main = self.peak_main_rss_bytes or self.peak_rss_bytes
        text = f"train.py {main / GB:.2f} GB"
        if self.children and self.peak_rss_bytes > 1.05 * main:
            text += f" ({self.peak_rss_bytes / GB:.2f} GB with {', '.join(self.children)}, which it started)"
        if self.peak_with_kernel_bytes:
            return f"peak RAM (RSS) of this kernel and the script together: {self.peak_ram_bytes / GB:.2f} GB ({text})"
        return f"peak RAM (RSS): {text}"

    @property
    def phase_text(self) -> str:
        """When the RAM reached its peak, and each phase's peak (this kernel and the script together); '' where not
        sampled."""
        if not self.peak_ram_by_phase:
            return ""
        # RSS seldom falls within a run, so later phases repeat the peak: the phase that first came within 1 % of it
        peak = max(self.peak_ram_by_phase.values())
        top = next(k for k, v in self.peak_ram_by_phase.items() if v >= 0.99 * peak)
        return (f"the RAM reached its peak in {top}; by phase (GB): "
                + ", ".join(f"{k} {v / GB:.2f}" for k, v in self.peak_ram_by_phase.items()))

    def report(self, plan: "Plan", runtime: "Runtime") -> str:
        """The measured peaks beside the plan's estimate and the budgets, and a verdict from this run only."""
        if not self.trained:
            return f"did not train (exit code {self.returncode}):\n" + "\n".join(self.tail[-8:])
        first, last = self.loss_drop()
        k = max(1, min(3, len(self.losses) // 2 or 1))
        report = plan.report
        assert report is not None
        lines = [f"trained {len(self.losses)} steps in {self.seconds:.0f} s; loss {first:.3f} -> {last:.3f} (means of "
                 f"the first and last {k})",
                 f"{self._ram_text}; planner's estimate {report.ram_needed / GB:.2f} GB (this kernel's RSS and the "
                 f"model copy: the script's own Python, torch and CUDA libraries are not in it); budget "
                 f"{runtime.ram_budget_bytes / GB:.2f} GB",
                 *filter(None, [self.phase_text]),
                 f"disk (the output folder, and an NVMe offload folder if the config has one): peak "
                 f"{self.peak_disk_bytes / GB:.2f} GB, of it the checkpoint {self.checkpoint_bytes / GB:.2f} GB"]
        if runtime.has_gpu:
            lines.insert(1, f"peak GPU memory (allocated): {self.peak_gpu_bytes / GiB:.2f} GiB; estimate "
                            f"{report.gpu_needed / GiB:.2f} GiB; budget {runtime.vram_budget_bytes / GiB:.2f} GiB")
            fits = (self.peak_gpu_bytes <= runtime.vram_budget_bytes
                    and self.peak_ram_bytes <= runtime.ram_budget_bytes)
            lines.append(f"verdict ({runtime.label}): trained; its measured peaks (GPU allocated; RAM of this kernel "
                         "and the script) " + ("are within the budgets" if fits else "went over a budget"))
        else:
            lines.append(f"verdict (CPU numbers, {runtime.label}): trained at smoke size; this says nothing about a "
                         "T4, where the same cells run the Colab sizes")
        return "\n".join(lines)


# what train.py prints as it moves on (notebooks/programs/train_your_model.py's `say`), as the phases of its RAM
SCRIPT_PHASES: tuple[tuple[str, str], ...] = (
    ("loading the tokenizer", "loading the data"), ("loading the model", "loading the model"),
    ("deepspeed.initialize", "deepspeed.initialize"), ("step ", "training"),
    ("engine.save_checkpoint", "save_checkpoint"), ("zero_to_fp32", "zero_to_fp32"))


def script_phase(line: str) -> str | None:
    """The phase train.py announces with this printed line (SCRIPT_PHASES), None for any other line."""
    return next((phase for prefix, phase in SCRIPT_PHASES if line.startswith(prefix)), None)


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


# In T4 budget mode on a bigger GPU, the script runs under this wrapper: it calls helpers.hardware.apply_t4_budget,
# which caps the notebook's allocator in detect_runtime (this checkout's helpers, on the path for that import only: the
# script imports no helpers), then runs the script as __main__ with its own argv.
_CAPPED_RUN = """import runpy, sys
sys.path.insert(0, sys.argv[1])
from helpers.hardware import apply_t4_budget
del sys.path[0]
apply_t4_budget(0)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _script_command(script: str | Path, args: list[str], runtime: "Runtime | None" = None) -> list[str]:
    """The command run_script starts: `python script *args`; on a GPU bigger than the T4 it stands in for (T4 budget
    mode), the same run under _CAPPED_RUN, so the script gets the notebook's VRAM budget and attention kernels."""
    command = [sys.executable, str(script), *args]
    if runtime is not None and runtime.has_gpu and runtime.t4_budget and \
            runtime.vram_budget_bytes < runtime.gpu_total_bytes:
        command[1:2] = ["-c", _CAPPED_RUN, str(ROOT), str(script)]
    return command


_OWN_RUN_FOLDER = "capstone"  # the run's folder inside this kernel's own NVMe folder


def _own_nvme_run(args: list[str], nvme_path: str | os.PathLike[str] | None) -> tuple[list[str], Path | None]:
    """(the script's args, the run's NVMe folder): where the DeepSpeed config after --deepspeed swaps into `nvme_path`
    (the course's NVMe folder, shared by every kernel of the checkout), a copy of it that swaps into
    <nvme_path>/pid-<this kernel's pid>/capstone instead, and the args naming the copy (written in that folder);
    otherwise `args` as they are and None. Two kernels of notebook 07 would otherwise swap under the same names, and
    DeepSpeed empties its rank folder when it starts (issue 41 item 7); notebook 02's runs swap under the same
    per-process folder (helpers.runtime._own_nvme_folder)."""
    from helpers.config import _nvme_sections, _real_folder
    from helpers.runtime import _own_nvme_folder

    flag = next((i for i, a in enumerate(args) if a == "--deepspeed" or a.startswith("--deepspeed=")), None)
    if nvme_path is None or flag is None:
        return args, None
    given = args[flag].partition("=")[2] or (args[flag + 1] if flag + 1 < len(args) else "")
    try:
        config = json.loads(Path(given).read_text())
    except (OSError, ValueError):  # the script says what is wrong with its config
        return args, None
    moved = []  # (an offload section that swaps into nvme_path, its folder relative to nvme_path)
    for _, section in _nvme_sections(config):
        rel = os.path.relpath(_real_folder(str(section["nvme_path"])), _real_folder(nvme_path))
        if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
            moved.append((section, rel))
    if not moved:  # no NVMe offload, or a folder of the learner's own elsewhere
        return args, None
    run = _own_nvme_folder(nvme_path) / _OWN_RUN_FOLDER
    shutil.rmtree(run, ignore_errors=True)  # what a run of this kernel left (removed after each run, even so)
    run.mkdir(parents=True)
    for section, rel in moved:
        section["nvme_path"] = os.path.normpath(run / rel)
    copy = run / Path(given).name
    copy.write_text(json.dumps(config, indent=2) + "\n")
    new = list(args)
    if args[flag] == "--deepspeed":
        new[flag + 1] = str(copy)
    else:
        new[flag] = f"--deepspeed={copy}"
    return new, run


def run_script(script: str | Path, args: list[str], *, out: str | Path, steps: int, nvme_path: str | None = None,
               env: dict[str, str] | None = None, timeout_s: float | None = None, desc: str = "train.py",
               runtime: "Runtime | None" = None) -> ScriptRun:
    """`python script *args` in a fresh process group, watched: a progress bar from the first second (the script's
    last printed line, the step from its loss.jsonl), peak RSS of its process tree, disk of `out` and `nvme_path`
    (notebook 07). Interrupting the cell stops the whole group. With `runtime` in T4 budget mode on a bigger GPU, the
    script's CUDA allocator is capped at the notebook's budget (`_script_command`). A config that swaps into
    `nvme_path` is run from a copy that swaps into this kernel's own folder under it, removed after the run
    (`_own_nvme_run`: another kernel's run keeps its files)."""
    from helpers.fresh_process import _stop_group, _tree_rss
    from helpers.progress import progress_bar
    from helpers.runtime import child_env

    import psutil

    out = Path(out)
    log = out / "loss.jsonl"
    if log.exists():
        log.unlink()  # a rerun's bar must not count the last run's steps
    # the kernel's environment less its world-of-one variables (its port is in use) and the course's one-rank NCCL
    # setting (train.py sets it again for a world of one)
    script_env = child_env()
    script_env.update(PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", **(env or {}))
    args, own_nvme = _own_nvme_run(args, nvme_path)
    swap_folder = own_nvme or nvme_path
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(_script_command(script, args, runtime), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=script_env, start_new_session=True)
    except BaseException:
        _remove_own_nvme(own_nvme)
        raise
    watched = psutil.Process(proc.pid)
    tail: list[str] = ["starting Python"]
    phase = ["starting"]  # the last phase train.py announced, however many lines DeepSpeed printed since

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail.append(line.rstrip())
            del tail[:-40]
            phase[0] = script_phase(line) or phase[0]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak_rss = peak_disk = peak_main = peak_together = 0
    kernel = psutil.Process()
    children: dict[int, str] = {}
    by_phase: dict[str, int] = {}
    bar = progress_bar(total=steps, desc=desc)
    shown: dict[str, str] = {}
    try:
        while proc.poll() is None:
            tree = _tree_rss(watched)
            peak_rss = max(peak_rss, tree)
            together = tree + kernel.memory_info().rss
            peak_together = max(peak_together, together)
            by_phase[phase[0]] = max(by_phase.get(phase[0], 0), together)
            try:
                peak_main = max(peak_main, watched.memory_info().rss)
                children.update({c.pid: c.name() for c in watched.children(recursive=True)})
            except psutil.Error:
                pass
            peak_disk = max(peak_disk, folder_bytes(out) + (folder_bytes(swap_folder) if swap_folder else 0))
            done = len(_read_log(log))
            if done > bar.n:
                bar.update(done - bar.n)
            last = next((t for t in reversed(tail) if t.strip() and not t.startswith("[") and "%|" not in t), "")
            post = {"now": last[:40], "RAM": f"{peak_rss / GB:.1f} GB"}
            if post != shown:
                bar.set_postfix(post)
                shown = post
            if timeout_s is not None and time.perf_counter() - started > timeout_s:
                _stop_group(proc, drain=False)
                tail.append(f"stopped after the time limit of {timeout_s:.0f} s")
                break
            time.sleep(0.2)
    except BaseException:  # KeyboardInterrupt included: never leave the script running
        _stop_group(proc, drain=False)
        raise
    finally:
        proc.wait()
        _remove_own_nvme(own_nvme)  # the swap files, an interrupted run's too
        reader.join(timeout=5)
        rows = _read_log(log)
        if len(rows) > bar.n:
            bar.update(len(rows) - bar.n)
        bar.close()
    return ScriptRun(returncode=proc.returncode, seconds=round(time.perf_counter() - started, 1),
                     losses=[r["loss"] for r in rows], step_seconds=[r["seconds"] for r in rows],
                     peak_rss_bytes=peak_rss, peak_gpu_bytes=max((r["peak_gpu_bytes"] for r in rows), default=0),
                     peak_disk_bytes=max(peak_disk, folder_bytes(out)), checkpoint_bytes=folder_bytes(out / "checkpoint"),
                     tail=list(tail), peak_main_rss_bytes=peak_main, children=tuple(sorted(set(children.values()))),
                     peak_with_kernel_bytes=peak_together, peak_ram_by_phase=by_phase)


def _remove_own_nvme(run: Path | None) -> None:
    """The run's NVMe folder (`_own_nvme_run`), and this kernel's folder above it once empty."""
    if run is None:
        return
    shutil.rmtree(run, ignore_errors=True)
    with contextlib.suppress(OSError):
        run.parent.rmdir()
