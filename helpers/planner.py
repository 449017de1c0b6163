"""Plan a run before running it (notebooks 00-02): pre-flight of a config against this runtime's budget, the course
config that fits instead, and `plan`: model, stage, offload, precision, micro-batch -> DeepSpeed JSON and the
verdict (notebook 00; helpers.planner_widget is the ipywidgets dashboard over it). The estimates are helpers.memory's.

Every total is the sum of rows that are shown (`PreflightReport.gpu_rows`, `ram_rows`, `disk_rows`): the model
states, the activations (or the optimizer step's temporaries, whichever is larger), buffers, staging, the fp32 model
copy built on CPU, and the RAM already in use. One unit convention (UNITS): GPU memory in GiB, RAM and disk in GB.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from helpers.checks import ConfigError, check_model_size, check_number, check_runtime
from helpers.config import IN_SETTINGS, NAMED_CONFIGS, OFFLOAD_KINDS, ConfigSettings, _nvme_folders_of, \
    _split_arguments, build_ds_config, check_nvme_buffers, check_nvme_path, nvme_buffer_size_for, offload_config
from helpers.memory import GB, GiB, ModelStateEstimate, estimate_activations, estimate_for_config, \
    estimate_step_transient, round_to_total, rss_bytes

if TYPE_CHECKING:
    from helpers.hardware import Runtime
    from helpers.models import ModelShape

__all__ = ["ROW_STEP", "BudgetError", "fresh_runtime_command", "plan", "preflight"]

# Pre-flight keeps this share of the RAM budget free: the RAM estimates of reports/ladder.json are within about 5 %
# of the measured peaks (both ways), and a Colab kernel that runs out of RAM is killed without a Python error.
RAM_ESTIMATE_MARGIN = 0.05
# A GPU need within this share of the GPU budget still fits, but is called tight in the verdict, the table and the
# chart (the budget itself, helpers.T4_VRAM_GIB on a T4, holds no margin): the cap binds what the caching allocator
# reserves, and what it reserved but did not use stood 0.16-0.55 GiB above the allocated peak at each long-context
# rung's longest length (reports/long_context.json); GPT-2 large with plain AMP, predicted at 14.42 GiB under the
# earlier 15 GiB cap (3.9 % below it), failed with 14.44 GiB allocated and 0.57 GiB reserved but unallocated
# (reports/ladder_probe.json). 5 % of a T4's 14.34 GiB is 0.72 GiB.
GPU_TIGHT_MARGIN = 0.05
# The course's one unit convention, stated once in every plan's table.
UNITS = "GPU memory in GiB (2**30 bytes, as torch counts it); RAM and disk in GB (10**9 bytes, as their budgets are set)"
# Rows beside the model states (helpers.memory.COMPONENTS and 'model copy'):
ROW_STEP = "step temporaries"  # the optimizer step's fp32 temporaries, when larger than the activations (freed by then)
ROW_IN_USE = "already in use"  # RAM the kernel (and what it started) holds before the run
# The sequence lengths the planner offers (those up to the model's positions) and its fixes propose.
SEQ_LENS: tuple[int, ...] = (128, 256, 512, 1024, 2048)


class BudgetError(RuntimeError):
    """A config predicted not to fit this runtime; the message names a config that would (notebook 00)."""


@dataclass
class PreflightReport:
    """Estimated need against this runtime's budget (notebooks 00-02).

    Each need is the sum of its rows: `gpu_rows` (the predicted peak: model states + the larger of the activations
    and the optimizer step's temporaries, `estimate_step_transient`), `ram_rows` (host model states, the fp32 model
    copy unless built under zero.Init, and `ROW_IN_USE`: the process, or the kernel plus a fresh child process),
    `disk_rows` (NVMe). On a runtime without a GPU what would sit on the GPU sits in RAM and `gpu_rows` is empty.
    When it does not fit, `suggestion_kind` names the first course config that does (FALLBACK_LADDER), checked by
    the same rules, and `suggestion_report` is its check. When the activations are what does not fit, `plan` sets
    `batch_suggestion` ({'micro_batch_size': 8}, or with a shorter 'seq_len' too): the same config at a batch that
    passes the same check (`batch_suggestion_report`); `fix` names it first. When neither that nor a course config at
    this batch fits, `plan` looks for a course config at a smaller batch before a smaller model: `suggestion_kind`
    with `suggestion_batch` ({'micro_batch_size': 4}), checked by the same rules (`suggestion_report`).
    """

    estimate: ModelStateEstimate
    gpu_rows: dict[str, int]
    gpu_budget: int
    ram_rows: dict[str, int]
    ram_budget: int
    disk_rows: dict[str, int]
    disk_budget: int
    activation_bytes: int = 0
    step_transient_bytes: int = 0
    suggestion: dict[str, Any] | None = None
    suggestion_zero_init: bool = False
    suggestion_kind: str | None = None
    suggestion_report: "PreflightReport | None" = None
    smaller_model: str | None = None  # when no course config fits: the largest ladder model that does
    smaller_model_kind: str | None = None
    # when no course config fits beside what runs now: the config the emulated ladder measured training this model
    # from a fresh runtime (`measured_fresh_runtime`), and that measurement
    fresh_runtime_kind: str | None = None
    fresh_runtime: dict[str, Any] | None = None
    model_name: str | None = None
    ram_margin: float = RAM_ESTIMATE_MARGIN  # share of the RAM budget kept free for the estimate's error
    gpu_margin: float = GPU_TIGHT_MARGIN  # share of the GPU budget below it where a fitting plan is called tight
    batch_suggestion: dict[str, int] | None = None  # set by `plan`: a smaller micro-batch (then sequence) that fits
    batch_suggestion_report: "PreflightReport | None" = None
    batch_now: dict[str, int] | None = None  # the plan's own micro-batch and sequence, beside batch_suggestion
    suggestion_batch: dict[str, int] | None = None  # set by `plan`: the smaller batch the suggested config fits at

    @property
    def gpu_needed(self) -> int:
        return sum(self.gpu_rows.values())

    @property
    def ram_needed(self) -> int:
        return sum(self.ram_rows.values())

    @property
    def disk_needed(self) -> int:
        return sum(self.disk_rows.values())

    @property
    def problems(self) -> list[str]:
        out = []
        if self.gpu_budget and self.gpu_needed > self.gpu_budget:
            out.append(f"GPU: needs ~{self.gpu_needed / GiB:.2f} GiB, budget {self.gpu_budget / GiB:.2f} GiB")
        if self.ram_needed > self.ram_budget * (1 - self.ram_margin):
            margin = f" ({self.ram_margin:.0%} of it kept free for the estimate's error)" if self.ram_margin else ""
            out.append(f"CPU RAM: needs ~{self.ram_needed / GB:.2f} GB, budget {self.ram_budget / GB:.2f} GB{margin}")
        if self.disk_needed > self.disk_budget:
            out.append(f"disk: needs ~{self.disk_needed / GB:.2f} GB, {self.disk_budget / GB:.2f} GB free")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def gpu_tight_from(self) -> int:
        """The GPU need above which a plan that fits is tight (the budget less `gpu_margin` of it); 0 without a GPU."""
        return int(self.gpu_budget * (1 - self.gpu_margin)) if self.gpu_budget else 0

    @property
    def tight(self) -> bool:
        """Fits, with the GPU need within `gpu_margin` of the GPU budget: memory the allocator reserved but does not
        use can tip such a step over the cap."""
        return self.fits and bool(self.gpu_budget) and self.gpu_needed > self.gpu_tight_from

    @property
    def tight_note(self) -> str:
        """Why a tight plan is tight, for the verdict; '' when it is not."""
        if not self.tight:
            return ""
        return (f"tight: GPU {self.gpu_needed / GiB:.2f} GiB is within {self.gpu_margin:.0%} of its "
                f"{self.gpu_budget / GiB:.2f} GiB budget (above {self.gpu_tight_from / GiB:.2f}), where memory the "
                "allocator reserved but does not use can tip a step over; a smaller micro-batch or more offload "
                "leaves room")

    def needs(self) -> str:
        """'GPU 3.90 GiB, RAM 11.70 GB, disk 24.90 GB' (what this check predicts)."""
        gpu = f"GPU {self.gpu_needed / GiB:.2f} GiB, " if self.gpu_budget else ""
        return f"{gpu}RAM {self.ram_needed / GB:.2f} GB" + (f", disk {self.disk_needed / GB:.2f} GB"
                                                            if self.disk_needed else "")

    def table(self) -> str:
        """The rows of each need, their total (the verdict's number) and the budget: GPU GiB | RAM GB | disk GB.

        No GPU column on a runtime without a GPU, no disk column without NVMe offload. Rows are rounded so that they
        add up to the printed total (`round_to_total`)."""
        columns = ([("GPU GiB", self.gpu_rows, GiB, self.gpu_budget)] if self.gpu_budget else []) + \
            [("RAM GB", self.ram_rows, GB, self.ram_budget)] + \
            ([("disk GB", self.disk_rows, GB, self.disk_budget)] if self.disk_rows else [])
        names = _row_order(*(rows for _, rows, _, _ in columns))
        shown = [round_to_total([rows.get(n, 0) / unit for n in names], 2) for _, rows, unit, _ in columns]
        lines = [UNITS, f"{'':<18}" + "".join(f"{head:>10}" for head, _, _, _ in columns)]
        lines += [f"{name:<18}" + "".join(f"{col[i]:>10.2f}" if rows.get(name) else f"{'-':>10}"
                                          for col, (_, rows, _, _) in zip(shown, columns))
                  for i, name in enumerate(names)]
        lines.append(f"{'total':<18}" + "".join(f"{sum(rows.values()) / unit:>10.2f}" for _, rows, unit, _ in columns))
        lines.append(f"{'budget':<18}" + "".join(f"{budget / unit:>10.2f}" for _, _, unit, budget in columns))
        return "\n".join(lines + self._notes())

    @property
    def offload_note(self) -> str:
        """On a runtime without a GPU, for a config that offloads to CPU: that offloading needs a GPU; else ''."""
        parts = self.estimate.label.split(" + ")
        if self.gpu_budget or not any(p.endswith("->cpu") for p in parts):
            return ""
        return ("CPU offload needs a GPU: it moves model states off the GPU into RAM, and without a GPU they sit in "
                "RAM already, so it saves no memory here (the rows change only by DeepSpeed's offload buffers and "
                "its CPU optimizer step); NVMe offload does move states to disk")

    def _notes(self) -> list[str]:
        """What a row of `table` stands for, when it is not a model state."""
        notes = []
        if not self.gpu_budget:
            notes.append("no GPU: what would sit on a GPU sits in RAM (the model built on CPU is trained in place)")
        if self.offload_note:
            notes.append(self.offload_note)
        if ROW_STEP in self.gpu_rows or ROW_STEP in self.ram_rows:
            unit, name = (GiB, "GiB") if self.gpu_budget else (GB, "GB")
            notes.append(f"{ROW_STEP}: the optimizer step's fp32 temporaries ({self.step_transient_bytes / unit:.2f} "
                         f"{name}) outgrow the activations ({self.activation_bytes / unit:.2f} {name}), freed by then")
        if self.ram_rows.get("model copy"):
            notes.append("model copy: the fp32 model built on CPU before deepspeed.initialize (not with zero.Init)")
        if self.ram_rows.get(ROW_IN_USE):
            notes.append(f"{ROW_IN_USE}: RAM this kernel (and what it started) holds now")
        if self.gpu_budget and self.gpu_margin:
            notes.append(f"tight when GPU passes {self.gpu_tight_from / GiB:.2f} GiB: within {self.gpu_margin:.0%} of "
                         "the budget, memory the allocator reserved but does not use can tip a step over")
        if self.ram_margin:
            notes.append(f"fits when RAM stays under {(1 - self.ram_margin) * self.ram_budget / GB:.2f} GB: "
                         f"{self.ram_margin:.0%} of the budget is kept free for the estimate's error")
        return notes

    def fix(self) -> str:
        """The fix to print with a refusal: a smaller batch (when the activations are what does not fit), a course
        config that passes this check, or what would."""
        if self.batch_suggestion:
            return "Fix: " + _batch_fix_text(self)
        if self.suggestion_kind is not None:
            call = ("helpers.build_ds_config(2, runtime=runtime)" if self.suggestion_kind == "zero2" else
                    f"helpers.config.offload_config({self.suggestion_kind!r}, runtime"
                    + (", nvme_path=..." if "nvme" in self.suggestion_kind else "")
                    + (", largest_param=..." if self.suggestion_kind == "zero3_nvme_all" else "") + ")")
            built = (" with the model built under deepspeed.zero.Init (HfDeepSpeedConfig, helpers.checkpoints.build_zero3_model)"
                     if self.suggestion_zero_init else "")
            need = f" (predicted: {self.suggestion_report.needs()})" if self.suggestion_report else ""
            batch = (" at " + ", ".join(f"{k}={v}" for k, v in self.suggestion_batch.items())
                     if self.suggestion_batch else "")
            return f"Fix: the course's {self.suggestion_kind!r} config{batch}, {call}{built}{need}"
        fresh = ""
        if self.fresh_runtime_kind and self.fresh_runtime and self.model_name:
            m = self.fresh_runtime
            fresh = (f"; from a fresh runtime, without this kernel's RAM, {self.fresh_runtime_kind!r} trained it, "
                     f"measured at {m['peak_ram_gb']:.2f} GB of {m['ram_limit_gb']} GB ({m['runtime']}, {m['batch']}"
                     f"{CHUNKED_NOTE if m.get('chunked_overflow_check') else ''}): "
                     "Runtime > "
                     "Restart session, run the setup cell, then "
                     f"!{fresh_runtime_command(self.fresh_runtime_kind, self.model_name)}")
        if self.smaller_model:
            return (f"Fix: none of the course's configs fits this model here{fresh}; a smaller one does: "
                    f"{self.smaller_model} with {self.smaller_model_kind!r}. Or a machine with more memory")
        if fresh:
            return f"Fix: none of the course's configs fits this model here{fresh}"
        return ("Fix: none of the course's configs fits this model here, nor a smaller GPT-2: train a smaller model, "
                "shorten sequences or micro-batch, or move to a machine with more memory")

    def __str__(self) -> str:
        verdict = (("fits (" + self.tight_note + ")" if self.tight else "fits") if self.fits
                   else "does NOT fit: " + "; ".join(self.problems))
        gpu = (f"GPU {self.gpu_needed / GiB:.2f} / {self.gpu_budget / GiB:.2f} GiB" if self.gpu_budget
               else "no GPU (all of it in RAM)")
        return (f"{self.estimate.label}: {gpu}, "
                f"RAM {self.ram_needed / GB:.2f} / {self.ram_budget / GB:.2f} GB, "
                f"disk {self.disk_needed / GB:.2f} / {self.disk_budget / GB:.2f} GB -> {verdict}")


# Tried in order when a config does not fit: cheapest in speed first. ZeRO-2 without offload, then the course's
# offload configs (helpers.config.OFFLOAD_KINDS) in NAMED_CONFIGS' order.
FALLBACK_LADDER: tuple[str, ...] = ("zero2", *OFFLOAD_KINDS)


def _batch_fix_text(report: PreflightReport) -> str:
    """'micro_batch_size=8 (activations 4.17 -> 2.09 GB; gradient_accumulation_steps x2 keeps the batch; predicted:
    ...)' for a report with a batch suggestion."""
    fix, now = report.batch_suggestion or {}, report.batch_now or {}
    unit, name = (GiB, "GiB") if report.gpu_budget else (GB, "GB")
    new = report.batch_suggestion_report
    act = (f"activations {report.activation_bytes / unit:.2f} -> {new.activation_bytes / unit:.2f} {name}"
           if new is not None else "")
    tokens_now = now.get("micro_batch_size", 0) * now.get("seq_len", 0)
    tokens_new = fix.get("micro_batch_size", now.get("micro_batch_size", 0)) * fix.get("seq_len", now.get("seq_len", 0))
    keep = (f"; gradient_accumulation_steps x{tokens_now // tokens_new} keeps the tokens per step"
            if "seq_len" not in fix and tokens_new and tokens_now % tokens_new == 0 and tokens_now > tokens_new
            else "")
    need = f"; predicted: {new.needs()}" if new is not None else ""
    return (", ".join(f"{k}={v}" for k, v in fix.items()) + f" with the same config ({act}{keep}{need})")


def _row_order(*rows: dict[str, int]) -> list[str]:
    """The rows of a plan's tables and pictures in one order: model states first, what the run adds after."""
    from helpers.memory import COMPONENTS

    order = ["params", "grads", "optimizer", "activations", ROW_STEP, *COMPONENTS, "model copy", ROW_IN_USE]
    present = {name for r in rows for name, value in r.items() if value}
    return [n for n in dict.fromkeys(order) if n in present] + sorted(present - set(order))


def _need_rows(est: ModelStateEstimate, has_gpu: bool, activation_bytes: int, transient: int,
               ram_in_use: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(GPU, RAM, disk) rows whose sums are the needs pre-flight checks: the GPU's peak holds the larger of the
    activations and the optimizer step's temporaries; without a GPU all of it sits in RAM, and the model built
    on CPU is trained there in place (no 'model copy')."""
    peak_extra = {"activations": int(activation_bytes)} if activation_bytes >= transient else {ROW_STEP: int(transient)}
    if has_gpu:
        gpu, ram = {**est.gpu, **peak_extra}, dict(est.cpu)
    else:
        gpu, ram = {}, dict(est.gpu)
        for name, value in [*est.cpu.items(), *peak_extra.items()]:
            if name != "model copy":
                ram[name] = ram.get(name, 0) + value
    ram[ROW_IN_USE] = int(ram_in_use)
    keep = lambda rows: {k: int(v) for k, v in rows.items() if v}  # noqa: E731
    return keep(gpu), keep(ram), keep(est.nvme)


def _report(est: ModelStateEstimate, runtime: "Runtime", activation_bytes: int, nvme_path: Any,
            ram_in_use: int, transient: int = 0) -> PreflightReport:
    gpu, ram, disk = _need_rows(est, runtime.has_gpu, activation_bytes, transient, ram_in_use)
    return PreflightReport(est, gpu, runtime.vram_budget_bytes, ram, runtime.ram_budget_bytes, disk,
                           _disk_budget(runtime, nvme_path), activation_bytes=int(activation_bytes),
                           step_transient_bytes=int(transient))


def _what_if(runtime: "Runtime") -> bool:
    """A runtime that stands for another machine (`helpers.colab_t4_profile`, whose note says so)."""
    return any("not this machine" in note for note in runtime.notes)


def _disk_budget(runtime: "Runtime", nvme_path: Any) -> int:
    """Free space now where the NVMe folder is; a what-if runtime, which stands for another machine
    (`helpers.colab_t4_profile`, notebook 00's Colab chart), keeps its own number. In the Colab profile
    (DS_COURSE_COLAB=1, `Runtime.emulation`) the folder's free space is held to Colab's NVMe budget, as
    `detect_runtime` holds the runtime's disk: the two numbers agree."""
    from helpers.hardware import COLAB_NVME_BUDGET_BYTES

    path = os.path.expanduser(nvme_path) if isinstance(nvme_path, str) else nvme_path
    if path and isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and not _what_if(runtime):
        free = int(shutil.disk_usage(path).free)
        return min(free, COLAB_NVME_BUDGET_BYTES) if runtime.emulation else free
    return runtime.disk_free_bytes


def _check(config: dict[str, Any], n_params: int, runtime: "Runtime", largest_layer_params: int,
           activation_bytes: int, nvme_path: Any, zero_init: bool, ram_in_use: int) -> PreflightReport:
    """Pre-flight of one config, without suggestions."""
    est = estimate_for_config(config, n_params, largest_layer_params=largest_layer_params, zero_init=zero_init,
                              on_gpu=runtime.has_gpu)
    zero = config.get("zero_optimization", {})
    transient = estimate_step_transient(n_params, int(zero.get("stage", 0)), precision=est.label.rsplit(" + ", 1)[-1],
                                        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"),
                                        multi_tensor=runtime.has_gpu)  # torch's AdamW: foreach on GPU only
    return _report(est, runtime, activation_bytes, nvme_path, ram_in_use, transient)


def _candidates(runtime: "Runtime", precision: str, largest_layer_params: int, nvme_path: Any
                ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(name, build_ds_config arguments, config) for each course config, in FALLBACK_LADDER's order."""
    out = []
    common = dict(check_paths=False, nvme_path=nvme_path or "/nvme")
    for name in FALLBACK_LADDER:
        args = dict(NAMED_CONFIGS[name].kwargs)
        if name in OFFLOAD_KINDS:
            cfg = offload_config(name, runtime, largest_param=max(largest_layer_params, 1), precision=precision,
                                 **common)
        else:
            cfg = build_ds_config(**_split_arguments({**args, "precision": precision, **common}))
        out.append((name, args, cfg))
    return out


def _check_preflight_inputs(config: Any, n_params: Any, runtime: Any, largest_layer_params: Any,
                            activation_bytes: Any) -> None:
    """preflight's arguments, and the NVMe parameter swap buffers of `config`, before anything is estimated."""
    if not isinstance(config, dict):
        raise ConfigError(f"preflight needs a DeepSpeed config dict (got {config!r}). Fix: "
                          "preflight(helpers.build_ds_config(2, runtime=runtime), n_params, runtime).")
    if runtime is None:
        raise ConfigError(f"preflight needs the runtime to compare with (got {runtime!r}). "
                          "Fix: runtime=helpers.detect_runtime().")
    check_runtime(runtime, "preflight")
    check_model_size(n_params, largest_layer_params)
    check_number("activation_bytes", activation_bytes, positive=False, integer=False, example=0,
                 hint=", or helpers.memory.estimate_activations(...)")
    offload_param = (config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload_param.get("device") == "nvme":
        fp32 = not (config.get("fp16", {}).get("enabled") or config.get("bf16", {}).get("enabled"))
        check_nvme_buffers(offload_param.get("buffer_count", 5), offload_param.get("buffer_size", 100_000_000),
                           element_bytes=4 if fp32 else 2, largest_param=int(largest_layer_params), within=IN_SETTINGS)


def preflight(config: dict[str, Any], n_params: int, runtime: "Runtime", *, largest_layer_params: int = 0,
              activation_bytes: int = 0, nvme_path: str | None = None, zero_init: bool = False,
              ram_in_use: int | None = None, raise_on_failure: bool = True) -> PreflightReport:
    """Compare the estimate for `config` with this runtime's VRAM/RAM/disk before allocating anything (notebook 00).

    `ram_in_use` is the RAM already taken beside the run (default: this process's RSS; notebook 02 passes the
    kernel's RSS plus a fresh child process's). Raises BudgetError (when `raise_on_failure`) naming each overflow
    and the first course config that passes this same check (`PreflightReport.fix`), or, when none does, the
    largest GPT-2 that one of them fits.
    A config with parameters on NVMe has its swap buffers checked first (`check_nvme_buffers`, against
    `largest_layer_params` when given). The disk budget is the free space of `nvme_path`, by default the
    config's own NVMe folder (`plan` passes the folder it built the config with); the fallback NVMe configs swap there.
    """
    _check_preflight_inputs(config, n_params, runtime, largest_layer_params, activation_bytes)
    if ram_in_use is None:
        ram_in_use = rss_bytes()
    check_number("ram_in_use", ram_in_use, positive=False, integer=False, example=0,
                 hint=" (bytes), or leave it out: this process's RSS now")
    nvme_path = nvme_path or next(iter(_nvme_folders_of(config)), None)  # the config's own folder, its one home
    report = _check(config, n_params, runtime, largest_layer_params, activation_bytes, nvme_path, zero_init,
                    ram_in_use)
    if report.fits:
        return report
    est = report.estimate
    precision = est.label.rsplit(" + ", 1)[-1]
    for kind, args, cand_cfg in _candidates(runtime, precision, largest_layer_params, nvme_path):
        cand_init = zero_init or args["stage"] == 3
        cand = _check(cand_cfg, n_params, runtime, largest_layer_params, activation_bytes, nvme_path, cand_init,
                      ram_in_use)
        if cand.fits:
            report.suggestion, report.suggestion_zero_init = args, cand_init
            report.suggestion_kind, report.suggestion_report = kind, cand
            break
    if report.suggestion is None:
        report.smaller_model, report.smaller_model_kind = _smaller_model_that_fits(
            n_params, runtime, precision, activation_bytes, nvme_path, ram_in_use)
        if runtime.is_colab or runtime.t4_budget:  # the emulated ladder measured a Colab T4's budgets
            from helpers.models import GPT2_LADDER, model_shape

            report.model_name = next((m for m in GPT2_LADDER if model_shape(m).n_params == n_params), None)
            for kind in OFFLOAD_KINDS:
                m = measured_fresh_runtime(kind, report.model_name) if report.model_name else None
                if m and m["fits"]:
                    report.fresh_runtime_kind, report.fresh_runtime = kind, m
                    break
    if raise_on_failure:
        ram_problem = any(p.startswith("CPU RAM") for p in report.problems)
        model_copy_counted = runtime.has_gpu and est.cpu.get("model copy", 0) > 0
        hint = "" if not (ram_problem and model_copy_counted) else (
            " (it counts the fp32 model built on CPU before deepspeed.initialize"
            + (": build it under deepspeed.zero.Init / HfDeepSpeedConfig to avoid that)"
               if int(config.get("zero_optimization", {}).get("stage", 0)) == 3 else ")"))
        raise BudgetError(f"{est.label} is predicted not to fit this runtime ({runtime.label}): "
                          + "; ".join(report.problems) + hint + ". " + report.fix() + ".")
    return report


def _smaller_model_that_fits(n_params: int, runtime: "Runtime", precision: str, activation_bytes: int,
                             nvme_path: Any, ram_in_use: int) -> tuple[str | None, str | None]:
    """The largest GPT-2 of the course's ladder, smaller than `n_params`, that a course config fits (and which)."""
    from helpers.models import GPT2_LADDER, model_shape

    for name in reversed(list(GPT2_LADDER)):
        shape = model_shape(name)
        if shape.n_params >= n_params:
            continue
        for kind, args, cfg in _candidates(runtime, precision, shape.largest_layer_params, nvme_path):
            if _check(cfg, shape.n_params, runtime, shape.largest_layer_params, activation_bytes, nvme_path,
                      args["stage"] == 3, ram_in_use).fits:
                return name, kind
    return None, None


# The committed ladder measured inside the Colab emulation (RAM, CPUs and VRAM enforced), each rung alone in a fresh
# process: what a learner gets from a fresh runtime (benchmarks/ladder.py --emulate).
EMULATED_LADDER = "reports/ladder_colab_emulation.json"
LADDER_LR = 3e-4  # benchmarks/ladder.py's default peak learning rate
LADDER_UNTIMED_STEPS = 1  # and its default --untimed-steps
LADDER_MICRO_BATCH = 2  # and its default --micro-batch (one optimizer step: one micro-batch, --grad-accum 1)

CHUNKED_NOTE = (", with helpers.chunk_zero3_overflow_check: DeepSpeed's fp16 overflow check otherwise needs 3 bytes "
                "per parameter more RAM at each step; the command turns it on")


def ladder_warmup_steps(steps: int) -> int:
    """benchmarks/ladder.py's default warm-up: the learning rate ramps linearly over half the steps (issue 42: at 2560
    wide a one-step warm-up sent the loss up after the first full-lr step; reports/lr_warmup_cpu.md). Rungs run
    before issue 42 warmed up over max(1, steps // 10) (`ladder_flags` names that for them)."""
    return max(1, int(steps) // 2)


def _warmup_ran(row: dict[str, Any], steps: int) -> int:
    """The warm-up a ladder row ran with: its own record, else the rule before issue 42."""
    return int(row.get("warmup_steps") or max(1, steps // 10))


def config_kind(config: dict[str, Any] | None) -> str | None:
    """The course offload config (helpers.config.OFFLOAD_KINDS) a DeepSpeed dict is, by stage and offload devices; None
    for any other config."""
    if not config:
        return None
    zero = config.get("zero_optimization") or {}
    got = {"stage": int(zero.get("stage", 0))}
    for section in ("offload_optimizer", "offload_param"):
        device = (zero.get(section) or {}).get("device", "none")
        if device != "none":
            got[section] = device
    # by stage and devices only (a learner's configs/ file may set other arguments too)
    return next((kind for kind in OFFLOAD_KINDS if NAMED_CONFIGS[kind].placement == got), None)


def fresh_runtime_command(kind: str, model: str, *, nvme_path: str = "/content/nvme",
                          out: str | None = None) -> str:
    """The command that trains `model` with the course config `kind` alone, in a fresh process, and writes what it
    measured (benchmarks/ladder.py; notebooks 00 and 02, the README). Run it after Runtime > Restart session and the
    setup cell, so that no notebook kernel holds RAM beside it. tests/test_ladder.py runs it smoke-sized in a
    memory cgroup."""
    if kind not in OFFLOAD_KINDS:
        raise ValueError(f"unknown offload config {kind!r}. Fix: one of {', '.join(OFFLOAD_KINDS)}.")
    out = out or f"/content/ladder-{model}.json"
    measured = measured_fresh_runtime(kind, model) or {}
    return (f"python benchmarks/ladder.py --configs {kind} --sizes {model} --verify-refusals {kind} --fresh "
            f"--nvme-path {nvme_path} --out {out}" + measured.get("ladder_flags", ""))


def ladder_flags(row: dict[str, Any], settings: dict[str, Any]) -> str:
    """The ladder.py options with which a rung of the emulated ladder ran where they differ from the ladder's defaults
    (the 2.7B rung: its own lr, steps and warm-up, the chunked overflow check; issue 42's curve: its micro-batch and
    accumulation), so the printed command repeats that run."""
    flags = ""
    if row.get("lr") not in (None, LADDER_LR):
        flags += f" --lr {row['lr']:g}"
    if row.get("steps") not in (None, settings.get("steps")):
        flags += f" --steps {row['steps']}"
    if row.get("untimed_steps") not in (None, LADDER_UNTIMED_STEPS):
        flags += f" --untimed-steps {row['untimed_steps']}"
    steps = row.get("steps") or settings.get("steps")
    # DeepSpeed's WarmupLR warms up over 2 steps at least: a warm-up below that is the same run
    if steps and max(2, _warmup_ran(row, steps)) != max(2, ladder_warmup_steps(steps)):
        flags += f" --warmup-steps {_warmup_ran(row, steps)}"
    micro_batch = row.get("micro_batch") or settings.get("micro_batch") or LADDER_MICRO_BATCH
    if micro_batch != LADDER_MICRO_BATCH:
        flags += f" --micro-batch {micro_batch}"
    grad_accum = row.get("grad_accum") or settings.get("grad_accum") or 1
    if grad_accum != 1:
        flags += f" --grad-accum {grad_accum}"
    if row.get("chunked_overflow_check"):
        flags += " --chunked-overflow-check"
    return flags


def measured_fresh_runtime(kind: str | None, model: str) -> dict[str, Any] | None:
    """The emulated ladder's row for (`kind`, `model`) when it ran to the end there, else None: {'fits', 'peak_ram_gb',
    'ram_limit_gb', 'tokens_per_s', 'runtime', 'batch'} (notebook 00's planner, notebook 02)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / EMULATED_LADDER
    if kind is None or not path.is_file():
        return None
    report = json.loads(path.read_text())
    for r in report.get("rows", []):
        if (r.get("config"), r.get("model")) == (kind, model) and r.get("ran") and not r.get("timed_out"):
            enc = r.get("enclosure", {})
            return {"fits": bool(r.get("fits")), "peak_ram_gb": enc.get("peak_ram_gb"),
                    "ram_limit_gb": enc.get("ram_limit_gb", report.get("budgets", {}).get("ram_gb")),
                    "tokens_per_s": r.get("tokens_per_s", 0.0), "runtime": report.get("runtime", ""),
                    "batch": f"micro-batch {report['settings']['micro_batch']} x {report['settings']['seq_len']}",
                    "chunked_overflow_check": bool(r.get("chunked_overflow_check")),
                    "ladder_flags": ladder_flags(r, report.get("settings", {}))}
    return None


def _measured_text(p: "Plan") -> str:
    """For a refused plan whose config and model the emulated ladder trained from a fresh runtime: that measurement
    and the command that repeats it; else ''."""
    if p.report is None or p.report.fits:
        return ""
    kind = config_kind(p.config)
    m = measured_fresh_runtime(kind, p.shape.name)
    if not m or not m["fits"]:
        return ""
    return (f"measured from a fresh runtime ({m['runtime']}, {m['batch']}{CHUNKED_NOTE if m['chunked_overflow_check'] else ''}): "
            f"it trains, peak RAM {m['peak_ram_gb']:.2f} GB of "
            f"{m['ram_limit_gb']} GB, {m['tokens_per_s']:,.0f} tokens/s. The estimate above counts what this "
            "kernel holds and keeps a margin, so beside a notebook it refuses; to run it, Runtime > Restart session, "
            f"run the setup cell, then: !{fresh_runtime_command(kind, p.shape.name)}")  # type: ignore[arg-type]


@dataclass
class Plan:
    """The config, the estimate and the verdict for one choice of settings (notebook 00's planner).

    A speed model may set `step_time` (predicted tokens/s) on a plan: the planner then shows it; a plan without
    that attribute (or with None) shows no speed (`_step_time_text`)."""

    shape: "ModelShape"
    config: dict[str, Any] | None
    report: PreflightReport | None
    activation_bytes: int
    error: str = ""
    micro_batch_size: int = 4
    seq_len: int = 512
    checkpointing: bool = True
    zero_init: bool = False  # built under deepspeed.zero.Init (stage 3): no fp32 model copy in RAM
    runtime_label: str = ""

    @property
    def settings(self) -> str:
        """'micro-batch 4 x 512 tokens, activation checkpointing' (+ ', model built under zero.Init' at stage 3)."""
        text = f"micro-batch {self.micro_batch_size} x {self.seq_len} tokens" + (
            ", activation checkpointing" if self.checkpointing else ", no activation checkpointing")
        stage = int((self.config or {}).get("zero_optimization", {}).get("stage", 0))
        return text + (", model built under zero.Init" if self.zero_init and stage == 3 else "")

    @property
    def checkpointing_note(self) -> str:
        """How the activation checkpointing this plan counts on is switched on: not by its JSON ('' without it)."""
        if not self.checkpointing:
            return ""
        return ("activation checkpointing, which this plan assumes, is switched on in the model, not in the JSON:\n"
                "model.gradient_checkpointing_enable() on a Hugging Face model (DeepSpeed's \"activation_checkpointing\" "
                "section configures only its own deepspeed.checkpointing API)")

    def __str__(self) -> str:
        head = f"model {self.shape.name}: {self.shape.n_params / 1e6:,.1f}M params, {self.settings}"
        if self.error:
            return f"{head}\nconfig refused: {self.error}"
        assert self.report is not None
        text = [head, self.report.table(), str(self.report)]
        if self.checkpointing_note:
            text.append(self.checkpointing_note)
        if _measured_text(self):
            text.append(_measured_text(self))
        if _step_time_text(self):
            text.append(_step_time_text(self))
        if self.report.batch_suggestion:
            text.append(f"a batch predicted to fit: {_batch_fix_text(self.report)}")
        if self.report.suggestion:
            init = " with the model built under deepspeed.zero.Init" if self.report.suggestion_zero_init else ""
            batch = ("".join(f", {k}={v}" for k, v in self.report.suggestion_batch.items())
                     if self.report.suggestion_batch else "")
            text.append(f"a config predicted to fit: build_ds_config(**{self.report.suggestion}{batch}){init}")
        return "\n".join(text)


@dataclass(frozen=True)
class PlanHost:
    """What `plan` checks on the machine beyond its `Runtime`: the settings no notebook passes to it (notebook 00
    plans with the defaults; `helpers.pick_plan` of notebook 07 and the tests set them), as
    `plan(..., host=PlanHost(...))`."""

    nvme_path: str | None = None  # the NVMe offload folder; one named here must exist (None: default_nvme_path())
    ram_in_use: int | None = None  # bytes of RAM already in use (None: this process's RSS now)


def plan(model: "str | ModelShape" = "gpt2", stage: int = 2, *, offload_optimizer: str = "none",
         offload_param: str = "none", precision: str = "auto", micro_batch_size: int = 4, seq_len: int = 512,
         checkpointing: bool = True, zero_init: bool = False, runtime: "Runtime | None" = None,
         host: PlanHost | None = None) -> Plan:
    """Build the config and estimate it against the budget; a refused config is reported, not raised (notebook 00).

    `zero_init`: the model is built under deepspeed.zero.Init (stage 3), so no fp32 copy of it sits in RAM; the
    planner widget's checkbox sets it, so a cell and the widget give the same numbers for the same settings.
    `host` (`PlanHost`): the NVMe folder, by default the course's (`helpers.default_nvme_path`), and the RAM already
    in use, by default this process's RSS now. Bad inputs that are not config settings (the model, seq_len, the
    runtime, ram_in_use) raise ValueError / ConfigError with the fix; so does a seq_len longer than the model's
    positions (`ModelShape.n_positions`: 1024 for GPT-2). An `nvme_path` passed for NVMe offload must exist (unless
    the runtime is a what-if of another machine): a missing one is a refused config whose fix creates it. NVMe
    parameter buffers are sized for the model's largest tensor, as `offload_config` sizes them.
    """
    from helpers.hardware import default_nvme_path, detect_runtime
    from helpers.models import ModelShape, model_shape

    host = host or PlanHost()
    nvme_path, ram_in_use = host.nvme_path, host.ram_in_use
    check_number("seq_len", seq_len, positive=True, integer=True, example=512)
    check_runtime(runtime, "plan")
    if ram_in_use is not None:
        check_number("ram_in_use", ram_in_use, positive=False, integer=False, example=0,
                     hint=" (bytes), or leave it out: this process's RSS now")
    runtime = runtime or detect_runtime()
    explicit_nvme_path = nvme_path is not None
    nvme_path = nvme_path or default_nvme_path()
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    if shape.n_positions and seq_len > shape.n_positions:
        raise ConfigError(f"seq_len={seq_len} is longer than {shape.name} takes: it has {shape.n_positions} "
                          "positions, and a longer sequence fails in training ('IndexError: index out of range in "
                          f"self', the position embedding). Fix: seq_len={shape.n_positions} (or shorter).")
    settings = dict(micro_batch_size=micro_batch_size, seq_len=seq_len, checkpointing=checkpointing,
                    zero_init=bool(zero_init), runtime_label=runtime.label)
    try:
        config = build_ds_config(stage, precision=precision, runtime=runtime, micro_batch_size=micro_batch_size,
                                 offload_optimizer=offload_optimizer, offload_param=offload_param,
                                 nvme_path=nvme_path, settings=ConfigSettings(
                                     check_paths=False, largest_param=shape.largest_layer_params,
                                     nvme_buffer_size=nvme_buffer_size_for(shape.largest_layer_params)))
        # no "activation_checkpointing" section: it configures deepspeed.checkpointing, which a Hugging Face model
        # does not call; checkpointing is switched on in the model (`Plan.checkpointing_note`)
    except ConfigError as exc:
        return Plan(shape, None, None, 0, error=str(exc), **settings)
    if "nvme" in (offload_optimizer, offload_param) and explicit_nvme_path and not _what_if(runtime):
        try:  # a folder named by the caller must be there; its free space is the verdict's disk budget (not 1 GB)
            check_nvme_path(nvme_path, bytes_needed=1)
        except ConfigError as exc:
            return Plan(shape, None, None, 0, error=str(exc), **settings)
    act_precision = "fp32" if runtime.precision == "fp32" else "fp16"
    act = _activation_bytes(shape, micro_batch_size, seq_len, precision=act_precision, checkpointing=checkpointing)
    report = preflight(config, shape.n_params, runtime, largest_layer_params=shape.largest_layer_params,
                       activation_bytes=act, nvme_path=nvme_path, zero_init=bool(zero_init), ram_in_use=ram_in_use,
                       raise_on_failure=False)
    _suggest_batch(report, shape, runtime, micro_batch_size, seq_len, act_precision, checkpointing, nvme_path)
    _suggest_config_at_smaller_batch(report, shape, runtime, micro_batch_size, seq_len, act_precision, checkpointing,
                                     nvme_path, bool(zero_init))
    return Plan(shape, config, report, act, **settings)


def _activation_bytes(shape: "ModelShape", batch: int, seq_len: int, *, precision: str, checkpointing: bool) -> int:
    """The activations the planner counts: for a Llama-shaped model notebook 06's part-by-part estimate
    (`helpers.long_context.estimate_activation_peak`: kept for backward + backward's largest transient, measured within a few %),
    for the others the GPT formula (`helpers.memory.estimate_activations`)."""
    if shape.llama is not None:
        from helpers.long_context import estimate_activation_peak
        from helpers.memory import bytes_per_element

        return estimate_activation_peak(shape.llama, seq_len, batch, precision_bytes=bytes_per_element(precision),
                                        checkpointing=checkpointing).gpu_peak
    return estimate_activations(batch, seq_len, shape.hidden, shape.n_layers, shape.vocab, n_heads=shape.n_heads,
                                precision=precision, checkpointing=checkpointing)


def _suggest_batch(report: PreflightReport, shape: "ModelShape", runtime: "Runtime", micro_batch_size: int,
                   seq_len: int, precision: str, checkpointing: bool, nvme_path: Any) -> None:
    """When the activations are what does not fit (they, not the step's temporaries, are in the peak's rows, and a
    smaller batch passes the same check): set `report.batch_suggestion` to the largest power-of-two micro-batch below
    this one that fits, else micro-batch 1 with the longest of SEQ_LENS below this sequence that fits."""
    rows = report.gpu_rows if runtime.has_gpu else report.ram_rows
    if report.fits or "activations" not in rows:
        return
    in_use = report.ram_rows.get(ROW_IN_USE, 0)

    def check(batch: int, seq: int) -> PreflightReport:
        act = _activation_bytes(shape, batch, seq, precision=precision, checkpointing=checkpointing)
        return _report(report.estimate, runtime, act, nvme_path, in_use, report.step_transient_bytes)

    for fix, batch, seq in _smaller_batches(micro_batch_size, seq_len):
        cand = check(batch, seq)
        if cand.fits:
            report.batch_suggestion, report.batch_suggestion_report = fix, cand
            report.batch_now = {"micro_batch_size": micro_batch_size, "seq_len": seq_len}
            return


def _smaller_batches(micro_batch_size: int, seq_len: int) -> list[tuple[dict[str, int], int, int]]:
    """(fix, micro-batch, sequence) below this batch, in the order they are tried: the power-of-two micro-batches
    below it, largest first, then micro-batch 1 with each of SEQ_LENS below this sequence, longest first."""
    tries = [({"micro_batch_size": 2 ** k}, 2 ** k, seq_len) for k in range(11, -1, -1) if 2 ** k < micro_batch_size]
    tries += [({"micro_batch_size": 1, "seq_len": s} if micro_batch_size > 1 else {"seq_len": s}, 1, s)
              for s in sorted(SEQ_LENS, reverse=True) if s < seq_len]
    return tries


def _suggest_config_at_smaller_batch(report: PreflightReport, shape: "ModelShape", runtime: "Runtime",
                                     micro_batch_size: int, seq_len: int, precision: str, checkpointing: bool,
                                     nvme_path: Any, zero_init: bool) -> None:
    """When neither this config at a smaller batch (`_suggest_batch`) nor a course config at this batch fits: the
    first course config (FALLBACK_LADDER's order) that fits at a smaller micro-batch (the largest), else the first
    that fits at micro-batch 1 with a shorter sequence, each by preflight's own check; it replaces the smaller model
    as the fix (`suggestion_kind`, `suggestion_batch`). A smaller micro-batch with gradient accumulation keeps the
    tokens per step, so it comes before a shorter sequence or another model."""
    if report.fits or report.batch_suggestion or report.suggestion is not None:
        return
    in_use = report.ram_rows.get(ROW_IN_USE, 0)
    prec = report.estimate.label.rsplit(" + ", 1)[-1]
    tries = _smaller_batches(micro_batch_size, seq_len)
    candidates = _candidates(runtime, prec, shape.largest_layer_params, nvme_path)
    for shorter in (False, True):  # micro-batch alone first, then the sequence too
        for kind, args, cand_cfg in candidates:
            for fix, batch, seq in tries:
                if ("seq_len" in fix) != shorter:
                    continue
                act = _activation_bytes(shape, batch, seq, precision=precision, checkpointing=checkpointing)
                cand_init = zero_init or args["stage"] == 3
                cand = _check(cand_cfg, shape.n_params, runtime, shape.largest_layer_params, act, nvme_path,
                              cand_init, in_use)
                if cand.fits:
                    report.suggestion, report.suggestion_zero_init = args, cand_init
                    report.suggestion_kind, report.suggestion_report, report.suggestion_batch = kind, cand, fix
                    report.smaller_model = report.smaller_model_kind = None
                    report.batch_now = {"micro_batch_size": micro_batch_size, "seq_len": seq_len}
                    return


def _step_time_text(p: Plan) -> str:
    """'predicted speed: ~1,234 tokens/s' when a speed model has set `step_time` on the plan, else ''."""
    speed = getattr(p, "step_time", None)
    if speed is None:
        return ""
    if isinstance(speed, (int, float)):
        return f"predicted speed: ~{speed:,.0f} tokens/s"
    return f"predicted speed: {speed}"


