"""Plan a run before running it (notebooks 00-02): pre-flight of a config against this runtime's budget, the course
config that fits instead, and `plan`: model, stage, offload, precision, micro-batch -> DeepSpeed JSON and the
verdict (notebook 00; `planner_widget` is an ipywidgets form over it). The estimates are helpers.memory's.
"""
from __future__ import annotations

import html
import json
import os
import shutil
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from helpers.checks import ConfigError, check_model_size, check_number
from helpers.config import NAMED_CONFIGS, OFFLOAD_KINDS, build_ds_config, check_nvme_buffers, nvme_buffer_size_for, \
    offload_config
from helpers.memory import GB, GiB, ModelStateEstimate, estimate_activations, estimate_for_config, \
    estimate_step_transient, rss_bytes

if TYPE_CHECKING:
    from helpers.hardware import Runtime
    from helpers.models import ModelShape

__all__ = ["FALLBACK_LADDER", "RAM_ESTIMATE_MARGIN", "BudgetError", "Plan", "PreflightReport", "plan",
           "planner_widget", "preflight"]

# Pre-flight keeps this share of the RAM budget free: the RAM estimates of reports/ladder.json are within about 5 %
# of the measured peaks (both ways), and a Colab kernel that runs out of RAM is killed without a Python error.
RAM_ESTIMATE_MARGIN = 0.05


class BudgetError(RuntimeError):
    """A config predicted not to fit this runtime; the message names a config that would."""


@dataclass
class PreflightReport:
    """Estimated need against this runtime's budget (notebooks 00-02).

    `gpu_needed` is the predicted peak: model states + the larger of the activations and the optimizer step's
    temporaries (`estimate_step_transient`). `ram_needed` includes `ram_in_use` (the process, or the kernel plus a
    fresh child process). When it does not fit, `suggestion_kind` names the first course config that does
    (FALLBACK_LADDER), checked by the same rules, and `suggestion_report` is its check.
    """

    estimate: ModelStateEstimate
    gpu_needed: int
    gpu_budget: int
    ram_needed: int
    ram_budget: int
    disk_needed: int
    disk_budget: int
    suggestion: dict[str, Any] | None = None
    suggestion_zero_init: bool = False
    suggestion_kind: str | None = None
    suggestion_report: "PreflightReport | None" = None
    smaller_model: str | None = None  # when no course config fits: the largest ladder model that does
    smaller_model_kind: str | None = None
    ram_margin: float = RAM_ESTIMATE_MARGIN  # share of the RAM budget kept free for the estimate's error

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

    def needs(self) -> str:
        """'GPU 3.9 GiB, RAM 11.7 GB, disk 24.9 GB' (what this check predicts)."""
        gpu = f"GPU {self.gpu_needed / GiB:.2f} GiB, " if self.gpu_budget else ""
        return f"{gpu}RAM {self.ram_needed / GB:.2f} GB" + (f", disk {self.disk_needed / GB:.1f} GB"
                                                            if self.disk_needed else "")

    def fix(self) -> str:
        """The fix to print with a refusal: a course config that passes this check, or what would."""
        if self.suggestion_kind is not None:
            call = ("helpers.build_ds_config(2, runtime=runtime)" if self.suggestion_kind == "zero2" else
                    f"helpers.offload_config({self.suggestion_kind!r}, runtime"
                    + (", nvme_path=..." if "nvme" in self.suggestion_kind else "")
                    + (", largest_param=..." if self.suggestion_kind == "zero3_nvme_all" else "") + ")")
            built = (" with the model built under deepspeed.zero.Init (HfDeepSpeedConfig, helpers.build_zero3_model)"
                     if self.suggestion_zero_init else "")
            need = f" (predicted: {self.suggestion_report.needs()})" if self.suggestion_report else ""
            return f"Fix: the course's {self.suggestion_kind!r} config, {call}{built}{need}"
        if self.smaller_model:
            return (f"Fix: none of the course's configs fits this model here; a smaller one does: {self.smaller_model} "
                    f"with {self.smaller_model_kind!r}. Or a machine with more memory")
        return ("Fix: none of the course's configs fits this model here, nor a smaller GPT-2: train a smaller model, "
                "shorten sequences or micro-batch, or move to a machine with more memory")

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit: " + "; ".join(self.problems)
        gpu = (f"GPU {self.gpu_needed / GiB:.2f} / {self.gpu_budget / GiB:.2f} GiB" if self.gpu_budget
               else "no GPU (all of it in RAM)")
        return (f"{self.estimate.label}: {gpu}, "
                f"RAM {self.ram_needed / GB:.2f} / {self.ram_budget / GB:.2f} GB, "
                f"disk {self.disk_needed / GB:.2f} / {self.disk_budget / GB:.2f} GB -> {verdict}")


# Tried in order when a config does not fit: cheapest in speed first. ZeRO-2 without offload, then the course's
# offload configs (helpers.config.OFFLOAD_KINDS) in NAMED_CONFIGS' order.
FALLBACK_LADDER: tuple[str, ...] = ("zero2", *OFFLOAD_KINDS)


def _report(est: ModelStateEstimate, runtime: "Runtime", activation_bytes: int, nvme_path: Any,
            ram_in_use: int, transient: int = 0) -> PreflightReport:
    if runtime.has_gpu:
        gpu_needed, ram_needed = est.gpu_total + max(activation_bytes, transient), est.cpu_total + ram_in_use
    else:  # on CPU what would sit on the GPU sits in RAM, and the model built on CPU is not copied
        cpu_total = est.cpu_total - est.cpu.get("model copy", 0)
        gpu_needed, ram_needed = 0, est.gpu_total + cpu_total + max(activation_bytes, transient) + ram_in_use
    disk_budget = int(shutil.disk_usage(nvme_path).free) if (nvme_path and os.path.isdir(nvme_path)) \
        else runtime.disk_free_bytes
    return PreflightReport(est, gpu_needed, runtime.vram_budget_bytes, ram_needed, runtime.ram_budget_bytes,
                           est.nvme_total, disk_budget)


def _check(config: dict[str, Any], n_params: int, runtime: "Runtime", largest_layer_params: int,
           activation_bytes: int, nvme_path: Any, zero_init: bool, ram_in_use: int) -> PreflightReport:
    """Pre-flight of one config, without suggestions."""
    est = estimate_for_config(config, n_params, largest_layer_params=largest_layer_params, zero_init=zero_init)
    zero = config.get("zero_optimization", {})
    transient = estimate_step_transient(n_params, int(zero.get("stage", 0)), precision=est.label.rsplit(" + ", 1)[-1],
                                        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"))
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
            cfg = build_ds_config(**args, precision=precision, **common)
        out.append((name, args, cfg))
    return out


def _check_preflight_inputs(config: Any, n_params: Any, runtime: Any, largest_layer_params: Any,
                            activation_bytes: Any) -> None:
    """preflight's arguments, and the NVMe parameter swap buffers of `config`, before anything is estimated."""
    if not isinstance(config, dict):
        raise ConfigError(f"preflight needs a DeepSpeed config dict (got {config!r}). Fix: "
                          "preflight(helpers.build_ds_config(2, runtime=runtime), n_params, runtime).")
    if not hasattr(runtime, "ram_budget_bytes"):
        raise ConfigError(f"preflight needs the runtime to compare with (got {runtime!r}). "
                          "Fix: runtime=helpers.detect_runtime().")
    check_model_size(n_params, largest_layer_params)
    check_number("activation_bytes", activation_bytes, positive=False, integer=False, example=0,
                 hint=", or helpers.estimate_activations(...)")
    offload_param = (config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload_param.get("device") == "nvme":
        fp32 = not (config.get("fp16", {}).get("enabled") or config.get("bf16", {}).get("enabled"))
        check_nvme_buffers(offload_param.get("buffer_count", 5), offload_param.get("buffer_size", 100_000_000),
                           element_bytes=4 if fp32 else 2, largest_param=int(largest_layer_params))


def preflight(config: dict[str, Any], n_params: int, runtime: "Runtime", *, largest_layer_params: int = 0,
              activation_bytes: int = 0, nvme_path: str | None = None, zero_init: bool = False,
              ram_in_use: int | None = None, raise_on_failure: bool = True) -> PreflightReport:
    """Compare the estimate for `config` with this runtime's VRAM/RAM/disk before allocating anything.

    `ram_in_use` is the RAM already taken beside the run (default: this process's RSS; notebook 02 passes the
    kernel's RSS plus a fresh child process's). Raises BudgetError (when `raise_on_failure`) naming each overflow
    and the first course config that passes this same check (`PreflightReport.fix`), or, when none does, the
    largest GPT-2 that one of them fits.
    A config with parameters on NVMe has its swap buffers checked first (`check_nvme_buffers`, against
    `largest_layer_params` when given).
    """
    _check_preflight_inputs(config, n_params, runtime, largest_layer_params, activation_bytes)
    if ram_in_use is None:
        ram_in_use = rss_bytes()
    nvme_path = nvme_path or config.get("zero_optimization", {}).get("offload_optimizer", {}).get("nvme_path") \
        or config.get("zero_optimization", {}).get("offload_param", {}).get("nvme_path")
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


@dataclass
class Plan:
    """The config, the estimate and the verdict for one choice of settings."""

    shape: "ModelShape"
    config: dict[str, Any] | None
    report: PreflightReport | None
    activation_bytes: int
    error: str = ""

    def __str__(self) -> str:
        head = f"model {self.shape.name}: {self.shape.n_params / 1e6:,.1f}M params"
        if self.error:
            return f"{head}\nconfig refused: {self.error}"
        assert self.report is not None
        est = self.report.estimate.with_activations(self.activation_bytes)
        text = [head, est.table(), str(self.report)]
        if self.report.suggestion:
            init = " with the model built under deepspeed.zero.Init" if self.report.suggestion_zero_init else ""
            text.append(f"a config predicted to fit: build_ds_config(**{self.report.suggestion}){init}")
        return "\n".join(text)


def plan(model: "str | ModelShape" = "gpt2", stage: int = 2, *, offload_optimizer: str = "none",
         offload_param: str = "none", precision: str = "auto", micro_batch_size: int = 4, seq_len: int = 512,
         checkpointing: bool = True, runtime: "Runtime | None" = None, nvme_path: str | None = None) -> Plan:
    """Build the config and estimate it against the budget; a refused config is reported, not raised.

    Bad inputs that are not config settings (the model, seq_len) raise ValueError / ConfigError with the fix.
    NVMe parameter buffers are sized for the model's largest tensor, as `offload_config` sizes them.
    """
    from helpers.hardware import detect_runtime
    from helpers.models import ModelShape, model_shape

    check_number("seq_len", seq_len, positive=True, integer=True, example=512)
    runtime = runtime or detect_runtime()
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    try:
        config = build_ds_config(stage, precision=precision, runtime=runtime, micro_batch_size=micro_batch_size,
                                 offload_optimizer=offload_optimizer, offload_param=offload_param,
                                 nvme_path=nvme_path, check_paths=False, largest_param=shape.largest_layer_params,
                                 nvme_buffer_size=nvme_buffer_size_for(shape.largest_layer_params),
                                 activation_checkpointing=checkpointing)
    except ConfigError as exc:
        return Plan(shape, None, None, 0, error=str(exc))
    act_precision = "fp32" if runtime.precision == "fp32" else "fp16"
    act = estimate_activations(micro_batch_size, seq_len, shape.hidden, shape.n_layers, shape.vocab,
                               n_heads=shape.n_heads, precision=act_precision, checkpointing=checkpointing)
    report = preflight(config, shape.n_params, runtime, largest_layer_params=shape.largest_layer_params,
                       activation_bytes=act, nvme_path=nvme_path, raise_on_failure=False)
    return Plan(shape, config, report, act)


# The planner widget's colours (verdict line) and the settings a suggestion may set.
_VERDICT_COLOURS = {"fits": "#1b7f3b", "no": "#b3261e", "refused": "#9a6700", "busy": "#555555"}
_ZERO_INIT_LABEL = "built under zero.Init"
_LOOKUP_NOTE = "looking up {name} (a local folder or the Hugging Face Hub) ..."


def _may_touch_the_hub(model: str) -> bool:
    """True when `model_shape(model)` may ask the Hub: not a ladder name, not a size, not a course-like name."""
    from helpers.models import GPT2_LADDER, parse_param_count

    name = str(model).strip()
    return bool(name) and name not in GPT2_LADDER and parse_param_count(name) is None \
        and not name.lower().startswith("gpt2") and not os.path.isdir(name)


def _needs_line(report: PreflightReport) -> str:
    """'GPU 3.90 / 15.00 GiB · RAM 11.70 / 12.13 GB · disk 0.0 / 80.0 GB' (needed / budget)."""
    parts = [f"GPU {report.gpu_needed / GiB:.2f} / {report.gpu_budget / GiB:.2f} GiB" if report.gpu_budget
             else "no GPU: everything in RAM"]
    parts.append(f"RAM {report.ram_needed / GB:.2f} / {report.ram_budget / GB:.2f} GB")
    if report.disk_needed:
        parts.append(f"disk {report.disk_needed / GB:.1f} / {report.disk_budget / GB:.1f} GB")
    return " · ".join(parts)


def _suggested_settings(p: Plan) -> dict[str, Any]:
    """The widget's settings (stage, offloads, model) that the plan's fix names; {} when it names none."""
    report = p.report
    if report is None or report.fits:
        return {}
    if report.suggestion is not None:
        args, zero_init, out = report.suggestion, report.suggestion_zero_init, {}
    elif report.smaller_model:
        args = dict(NAMED_CONFIGS[report.smaller_model_kind].kwargs) if report.smaller_model_kind else {}
        zero_init, out = args.get("stage") == 3, {"model": report.smaller_model}
    else:
        return {}
    out.update(stage=args.get("stage", 2), offload_optimizer=args.get("offload_optimizer", "none"),
               offload_param=args.get("offload_param", "none"))
    if zero_init:  # the fix was checked with the model built under deepspeed.zero.Init (no fp32 copy in RAM)
        out["zero_init"] = True
    return out


def _settings_text(settings: dict[str, Any]) -> str:
    """'model gpt2-large, ZeRO stage 3, opt. offload nvme, param offload cpu' (the widget's own labels)."""
    labels = {"model": "model", "stage": "ZeRO stage", "offload_optimizer": "opt. offload",
              "offload_param": "param offload"}
    return ", ".join(_ZERO_INIT_LABEL if k == "zero_init" else f"{labels[k]} {v}" for k, v in settings.items())


def _verdict_html(p: "Plan | None", name: str, error: str = "") -> str:
    """The one coloured line at the top of the planner: fits (green) / does not fit (red) / refused / cannot plan."""
    def line(colour: str, head: str, rest: str) -> str:
        return (f'<div class="ds-plan-verdict" style="border-left:6px solid {colour};padding:4px 8px;'
                f'margin:2px 0;line-height:1.4"><b style="color:{colour}">{html.escape(head)}</b> '
                f"{html.escape(rest)}</div>")

    if error or p is None:
        return line(_VERDICT_COLOURS["no"], f"cannot plan {name!r}:", error)
    if p.error:
        return line(_VERDICT_COLOURS["refused"], "config refused:", p.error)
    assert p.report is not None
    head = f"{p.shape.name} ({p.shape.n_params / 1e6:,.0f}M params) with {p.report.estimate.label}"
    if p.report.fits:
        return line(_VERDICT_COLOURS["fits"], "fits", f"{head}: {_needs_line(p.report)}")
    fix = _suggested_settings(p)
    rest = f"{head}: " + "; ".join(p.report.problems) + "."
    rest += f" Try: {_settings_text(fix)}." if fix else " " + p.report.fix() + "."
    return line(_VERDICT_COLOURS["no"], "does NOT fit", rest)


# A reopened notebook has no widget state ("Error displaying widget: model not found"): the planner also displays a
# static copy of its last plan, hidden by CSS while the live widget is in the same output area.
# JupyterLab / Notebook 7: the cell's output area; a page without JupyterLab's classes (Colab's output frame of one
# cell; untested there) as a whole. Two rules, so that a browser refusing one selector still reads the other.
_STATIC_STYLE = ("<style>.jp-OutputArea:has(.ds-planner) .ds-plan-static {display: none}\n"
                 "body:not(:has(.jp-OutputArea)):has(.ds-planner) .ds-plan-static {display: none}</style>")


def _static_copy_html(verdict: str, details: str) -> str:
    """The planner's last plan as static HTML, for a notebook reopened without its kernel (issue 16, problem 5)."""
    return (f'{_STATIC_STYLE}<div class="ds-plan-static"><p><b>The planner</b> (a saved copy of its last plan: '
            f"re-run this cell for its controls)</p>{verdict}<details><summary>memory table and DeepSpeed JSON"
            f"</summary>{details}</details></div>")


def _display_handle() -> Any:
    """A display to update with the static copy, when running in a kernel (None elsewhere, e.g. under pytest)."""
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    return display(HTML(""), display_id=True)


def _details_text(p: Plan) -> str:
    return str(p) + ("\n\n" + json.dumps(p.config, indent=2) if p.config is not None else "")


def planner_widget(runtime: "Runtime | None" = None, model: str = "gpt2") -> Any:
    """An ipywidgets dashboard over `plan`, starting at `model`: a coloured verdict line at the top (with the fix in
    the widget's own settings and a button that applies it), the controls, and the memory table and DeepSpeed JSON
    folded in an accordion. Changing a setting re-plans; the model field re-plans on Enter or when it loses focus
    (`continuous_update=False`), and shows "looking up ..." before a name that may ask the Hugging Face Hub.

    When a runner saves the notebook (`helpers.saved_run()`), a widget would be saved as `VBox(children=...)`: then the
    plan of the starting settings is returned as static HTML, saying to run the cell in Jupyter or Colab for controls.
    """
    from helpers.hardware import detect_runtime
    from helpers.models import GPT2_LADDER
    from helpers.progress import saved_run

    runtime = runtime or detect_runtime()
    if saved_run():
        from IPython.display import HTML

        try:
            p: Plan | None = plan(model, runtime=runtime, nvme_path="/tmp/nvme")
            verdict, text = _verdict_html(p, model), _details_text(p)
        except Exception as exc:  # unknown model id, no network ...
            verdict, text = _verdict_html(None, model, str(exc)), f"cannot plan this: {exc}"
        return HTML("<p><b>The planner</b> (a saved copy: run this cell in Jupyter or Colab for its controls). "
                    f"The plan for {html.escape(model)} with ZeRO-2, micro-batch 4 x 512:</p>{verdict}"
                    f"<details><summary>memory table and DeepSpeed JSON</summary><pre>{html.escape(text)}</pre>"
                    "</details>")
    import ipywidgets as w

    style = {"description_width": "initial"}

    def box(width: str) -> Any:
        return w.Layout(width=width, min_width=width)

    controls = {
        "model": w.Combobox(value=model, options=list(GPT2_LADDER), description="model", style=style,
                            placeholder="1.3B, gpt2-xl, a folder or Hub id", ensure_option=False,
                            continuous_update=False, layout=box("330px")),
        "stage": w.Dropdown(options=[0, 1, 2, 3], value=2, description="ZeRO stage", style=style,
                            layout=box("150px")),
        "offload_optimizer": w.Dropdown(options=["none", "cpu", "nvme"], value="none", description="opt. offload",
                                        style=style, layout=box("180px")),
        "offload_param": w.Dropdown(options=["none", "cpu", "nvme"], value="none", description="param offload",
                                    style=style, layout=box("190px")),
        "precision": w.Dropdown(options=["auto", "fp16", "bf16", "fp32"], value="auto", description="precision",
                                style=style, layout=box("170px")),
        "micro_batch_size": w.BoundedIntText(value=4, min=1, max=1024, step=1, description="micro-batch",
                                             style=style, continuous_update=False, layout=box("170px")),
        "seq_len": w.Dropdown(options=[128, 256, 512, 1024, 2048], value=512, description="seq len", style=style,
                              layout=box("150px")),
        "checkpointing": w.Checkbox(value=True, description="activation checkpointing", indent=False,
                                    style=style, layout=box("210px")),
        "zero_init": w.Checkbox(value=False, description=f"model {_ZERO_INIT_LABEL} (stage 3)", indent=False,
                                style=style, layout=box("260px"), disabled=True),
    }
    verdict = w.HTML()
    apply = w.Button(description="apply the fix", button_style="success", icon="check",
                     layout=w.Layout(width="auto", display="none"))
    details = w.HTML()
    fold = w.Accordion(children=[details])
    fold.set_title(0, "memory table and DeepSpeed JSON")
    fold.selected_index = None
    state: dict[str, Any] = {"fix": {}, "busy": False, "static": _display_handle()}

    def show(verdict_html: str, details_html: str) -> None:
        verdict.value, details.value = verdict_html, details_html
        if state["static"] is not None:
            from IPython.display import HTML

            state["static"].update(HTML(_static_copy_html(verdict_html, details_html)))

    def refresh(_: Any = None) -> None:
        if state["busy"]:  # "apply" sets several controls: plan once, at the end
            return
        kwargs = {k: c.value for k, c in controls.items()}
        name, zero_init = str(kwargs.pop("model")), kwargs.pop("zero_init")
        controls["zero_init"].disabled = kwargs["stage"] != 3
        apply.layout.display = "none"
        if _may_touch_the_hub(name):  # shown before a lookup that may take seconds (offline: retries)
            verdict.value = (f'<div class="ds-plan-verdict" style="color:{_VERDICT_COLOURS["busy"]};padding:4px 8px">'
                             f"<i>{html.escape(_LOOKUP_NOTE.format(name=repr(name)))}</i></div>")
        try:
            p = plan(name, runtime=runtime, nvme_path="/tmp/nvme", **kwargs)
            if zero_init and kwargs["stage"] == 3 and p.config is not None:  # no fp32 model copy in RAM
                p = replace(p, report=preflight(p.config, p.shape.n_params, runtime, nvme_path="/tmp/nvme",
                                                largest_layer_params=p.shape.largest_layer_params,
                                                activation_bytes=p.activation_bytes, zero_init=True,
                                                raise_on_failure=False))
        except Exception as exc:  # unknown model id, no network ...: the error, never the old verdict
            state["fix"] = {}
            show(_verdict_html(None, name, str(exc)), f"<pre>{html.escape(f'cannot plan {name!r}: {exc}')}</pre>")
            return
        state["fix"] = _suggested_settings(p)
        show(_verdict_html(p, name), f"<pre>{html.escape(_details_text(p))}</pre>")
        if state["fix"]:
            apply.description = "apply: " + _settings_text(state["fix"])
            apply.layout.display = None

    def on_apply(_: Any = None) -> None:
        fix = dict(state["fix"])
        state["busy"] = True
        try:
            for key, value in fix.items():
                controls[key].value = value
        finally:
            state["busy"] = False
        refresh()

    for c in controls.values():
        c.observe(refresh, names="value")
    apply.on_click(on_apply)
    refresh()
    c = list(controls.values())
    row = w.Layout(flex_flow="row wrap", gap="4px 12px")
    ui = w.VBox([verdict, apply, w.HBox(c[:4], layout=row), w.HBox(c[4:], layout=row), fold])
    ui.add_class("ds-planner")
    return ui
