"""The planner's dashboard (notebook 00): `planner_widget`, an ipywidgets view over helpers.planner's `plan`, and its
HTML: the coloured verdict with the fix in the widget's own settings and a button that applies it, the plan drawn
against the budgets (helpers.plots.plot_plan), the DeepSpeed JSON to download or copy, and the static copy a notebook
reopened (or a kernel restarted) shows instead of a dead widget. The numbers are all `plan`'s.
"""
from __future__ import annotations

import html
import json
import os
import re
import urllib.parse
from typing import TYPE_CHECKING, Any

import helpers.planner as planner
from helpers.config import NAMED_CONFIGS
from helpers.memory import GB, GiB
from helpers.planner import ROW_STEP, SEQ_LENS, Plan, PreflightReport, _measured_text, _step_time_text

if TYPE_CHECKING:
    from helpers.hardware import Runtime

__all__ = ["planner_widget"]

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
    """'GPU 3.90 / 14.34 GiB · RAM 11.70 / 12.13 GB · disk 24.90 / 80.00 GB' (needed / budget)."""
    parts = [f"GPU {report.gpu_needed / GiB:.2f} / {report.gpu_budget / GiB:.2f} GiB" if report.gpu_budget
             else "no GPU: everything in RAM"]
    parts.append(f"RAM {report.ram_needed / GB:.2f} / {report.ram_budget / GB:.2f} GB")
    if report.disk_needed:
        parts.append(f"disk {report.disk_needed / GB:.2f} / {report.disk_budget / GB:.2f} GB")
    return " · ".join(parts)


# The controls a refusal's "Fix: name=value" may set, and the values each control takes.
_REFUSAL_CONTROLS = {"stage": (0, 1, 2, 3), "offload_optimizer": ("none", "cpu", "nvme"),
                     "offload_param": ("none", "cpu", "nvme"), "precision": ("auto", "fp16", "bf16", "fp32"),
                     "micro_batch_size": None, "seq_len": SEQ_LENS}


def _refusal_fix(error: str) -> dict[str, Any]:
    """The first 'name=value' settings of a refusal's 'Fix: ...' (up to its first 'or' / '('), where they are the
    widget's controls and take a value the control offers; {} otherwise. E.g. "Fix: stage=3, or keep stage and use
    ..." -> {'stage': 3}."""
    match = re.search(r"Fix:\s*(.*)", error)
    if not match:
        return {}
    first = re.split(r"\(|\bor\b|;", match.group(1))[0]
    out: dict[str, Any] = {}
    for name, raw in re.findall(r"(\w+)=('[^']*'|\d+)", first):
        value: Any = raw.strip("'") if raw.startswith("'") else int(raw)
        offered = _REFUSAL_CONTROLS.get(name, ())
        if name not in _REFUSAL_CONTROLS or (offered is not None and value not in offered):
            return {}  # a fix the controls cannot apply: its text stays, with no button
        if name == "micro_batch_size" and (not isinstance(value, int) or value < 1):
            return {}
        out[name] = value
    return out


def _refusal_settings(p: Plan, name: str, runtime: "Runtime", settings: dict[str, Any]) -> dict[str, Any]:
    """For a refused config: the controls' values its fix names, followed until a plan is no longer refused (a
    combination may be refused for two reasons: up to three fixes in a row); {} when a fix is not the controls' or
    does not end the refusals."""
    out: dict[str, Any] = {}
    current = dict(settings)
    for _ in range(3):
        step = _refusal_fix(p.error)
        if not step or all(current.get(k) == v for k, v in step.items()):
            return {}
        out.update(step)
        current.update(step)
        try:
            p = planner.plan(name, runtime=runtime, **current)
        except Exception:
            return {}
        if not p.error:
            return out
    return {}


def _suggested_settings(p: Plan) -> dict[str, Any]:
    """The widget's settings that the plan's fix names: a smaller micro-batch (then sequence) when the activations
    are what does not fit, else stage, offloads (and the smaller batch, or the model) of the course config that
    fits; {} when it names none."""
    report = p.report
    if report is None or report.fits:
        return {}
    if report.batch_suggestion:
        return dict(report.batch_suggestion)
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
    if report.suggestion is not None and report.suggestion_batch:  # the config fits at a smaller batch
        out.update(report.suggestion_batch)
    return out


def _settings_text(settings: dict[str, Any]) -> str:
    """'model gpt2-large, ZeRO stage 3, opt. offload nvme, param offload cpu' (the widget's own labels)."""
    labels = {"model": "model", "stage": "ZeRO stage", "offload_optimizer": "opt. offload",
              "offload_param": "param offload", "precision": "precision", "micro_batch_size": "micro-batch",
              "seq_len": "seq len"}
    return ", ".join(_ZERO_INIT_LABEL if k == "zero_init" else f"{labels[k]} {v}" for k, v in settings.items())


def _batch_hidden_text(p: Plan) -> str:
    """When the step's temporaries outgrow the activations: that the batch does not move the peak until the
    activations pass them; else ''."""
    r = p.report
    if r is None or ROW_STEP not in (r.gpu_rows if r.gpu_budget else r.ram_rows):
        return ""
    unit, name = (GiB, "GiB") if r.gpu_budget else (GB, "GB")
    return (f"activations at micro-batch {p.micro_batch_size} x {p.seq_len}: {r.activation_bytes / unit:.2f} {name}, "
            f"under the optimizer step's temporaries ({r.step_transient_bytes / unit:.2f} {name}, counted instead: "
            "they come after the activations are freed); a larger batch raises the peak once its activations pass them")


def _small_line(css: str, text: str) -> str:
    return f'<div class="{css}" style="padding:0 14px">{html.escape(text)}</div>' if text else ""


def _verdict_html(p: "Plan | None", name: str, error: str = "", refusal_fix: dict[str, Any] | None = None) -> str:
    """The one coloured line at the top of the planner: fits (green; 'fits, tight' within the GPU margin, with why) /
    does not fit (red) / refused / cannot plan; under it the predicted speed when the plan has one, what the batch
    does to the peak, and why CPU offload saves nothing on a runtime without a GPU."""
    def line(colour: str, head: str, rest: str) -> str:
        return (f'<div class="ds-plan-verdict" style="border-left:6px solid {colour};padding:4px 8px;'
                f'margin:2px 0;line-height:1.4"><b style="color:{colour}">{html.escape(head)}</b> '
                f"{html.escape(rest)}</div>")

    if error or p is None:
        return line(_VERDICT_COLOURS["no"], f"cannot plan {name!r}:", error)
    if p.error:
        try_ = f" Try: {_settings_text(refusal_fix)}." if refusal_fix else ""
        return line(_VERDICT_COLOURS["refused"], "config refused:", p.error + try_)
    assert p.report is not None
    head = f"{p.shape.name} ({p.shape.n_params / 1e6:,.0f}M params) with {p.report.estimate.label}"
    below = (_small_line("ds-plan-offload", p.report.offload_note) + _small_line("ds-plan-batch", _batch_hidden_text(p))
             + _small_line("ds-plan-speed", _step_time_text(p)))
    if p.report.fits:
        return (line(_VERDICT_COLOURS["fits"], "fits, tight" if p.report.tight else "fits",
                     f"{head}: {_needs_line(p.report)}")
                + _small_line("ds-plan-tight", p.report.tight_note[:1].upper() + p.report.tight_note[1:]) + below)
    fix = _suggested_settings(p)
    rest = f"{head}: " + "; ".join(p.report.problems) + "."
    if fix and p.report.batch_suggestion:
        rest += f" Try: {_settings_text(fix)} (the activations are what does not fit; {planner._batch_fix_text(p.report)})."
    elif fix:
        rest += f" Try: {_settings_text(fix)}."
    else:
        rest += " " + p.report.fix() + "."
    return (line(_VERDICT_COLOURS["no"], "does NOT fit", rest) + _small_line("ds-plan-measured", _measured_text(p))
            + below)


def _picture_html(p: "Plan | None") -> str:
    """The plan as stacked bars against the budgets (helpers.plots.plot_plan), as an <img>; '' without a plan."""
    if p is None or p.report is None:
        return ""
    from helpers.plots import figure_html, plot_plan

    # drawn at its own pixel size, scrolled sideways in a narrow column (a narrowed image shrank its labels to ~5 px)
    return figure_html(plot_plan(p, show=False), alt=f"memory plan of {p.shape.name}: {_needs_line(p.report)}",
                       css_class="ds-plan-picture", scroll=True)


_BUTTON_STYLE = ("display:inline-block;padding:2px 10px;margin:0 4px;border:1px solid #888;border-radius:3px;"
                 "background:#f4f4f4;color:#111;font:inherit;text-decoration:none;cursor:pointer")
# runs in the browser: the widget's HTML and a trusted output keep inline handlers (the kernel cannot reach the
# clipboard); where the clipboard is blocked (an http page, some iframes) it says to use the download link
_COPY_JS = ("const b = this, t = decodeURIComponent(b.dataset.json);"
            "(navigator.clipboard ? navigator.clipboard.writeText(t) : Promise.reject())"
            ".then(() => {b.textContent = 'copied'}, () => {b.textContent = 'copy blocked here: use download'});")


def _json_actions_html(p: "Plan | None") -> str:
    """'DeepSpeed config: [download ds_config.json] [copy JSON]' for the plan's config; '' without one."""
    if p is None or p.config is None:
        return ""
    text = json.dumps(p.config, indent=2)
    quoted = urllib.parse.quote(text)
    return (f'<div class="ds-plan-actions" style="margin:4px 0">DeepSpeed config: '
            f'<a class="ds-plan-download" download="ds_config.json" href="data:application/json;charset=utf-8,{quoted}"'
            f' style="{_BUTTON_STYLE}">download ds_config.json</a>'
            f'<button class="ds-plan-copy" type="button" data-json="{quoted}" onclick="{html.escape(_COPY_JS)}" '
            f'style="{_BUTTON_STYLE}">copy JSON</button>'
            + (f'<div class="ds-plan-checkpointing" style="font-size:90%">{html.escape(p.checkpointing_note)}</div>'
               if p.checkpointing_note else "") + '</div>')


_PRE = '<pre style="line-height:1.3">'  # ipywidgets 7's HTML widget (Colab's) sets a 28px line-height on its content


def _details_html(p: "Plan | None", name: str, error: str = "") -> str:
    """The folded part: the plan's table and verdict, then its DeepSpeed JSON."""
    if p is None:
        return f"{_PRE}{html.escape(f'cannot plan {name!r}: {error}')}</pre>"
    text = str(p) + ("\n\n" + json.dumps(p.config, indent=2) if p.config is not None else "")
    return f"{_PRE}{html.escape(text)}</pre>"


def _rendering(p: "Plan | None", name: str, error: str = "", refusal_fix: dict[str, Any] | None = None
               ) -> dict[str, str]:
    """The planner's parts as HTML: verdict (with the speed, when known), picture, JSON actions, details."""
    return {"verdict": _verdict_html(p, name, error, refusal_fix), "picture": _picture_html(p),
            "actions": _json_actions_html(p), "details": _details_html(p, name, error)}


# A reopened notebook has no widget state ("Error displaying widget: model not found"): the planner also displays a
# static copy of its last plan. While the live widget is in the same output area, CSS hides the copy; while it is not
# (a reopened notebook: the widget's output shows only that error, or "Loading widget..."), CSS hides the widget's
# output instead: in JupyterLab and Notebook 7 the widget renderer's node is the one output without a data-mime-type
# (class jupyter-widgets once it failed). In classic Notebook 6 (ipywidgets 7.7.1, Colab's versions) the outputs are
# .output_area's in .output: a widget it cannot find reads "A Jupyter widget could not be displayed ..." in a
# .jupyter-widgets-view, or falls back to its text/plain (the `VBox(children=...` repr, a non-stream .output_text);
# both are hidden there. A page without these classes (Colab's output frame of one cell; untested there) is taken as
# a whole. Separate rules, so that a browser refusing one still reads the others.
# After a kernel restart the widget stays on the page, its model's comm dead: ipywidgets (7 and 8) then adds
# jupyter-widgets-disconnected to every view (the broken-link icons). The copy is hidden only beside a planner that is
# not disconnected; beside a disconnected one the copy shows and the dead controls are hidden (or, where the output
# classes differ, greyed and unclickable, with the note to re-run the cell).
# The class lands on the planner's own element (its VBox's view): no :has() inside :has(), which browsers refuse.
_LIVE = ".ds-planner:not(.jupyter-widgets-disconnected)"
_DEAD = ".ds-planner.jupyter-widgets-disconnected"
# issue 41 item 9: after a restart, re-running this cell alone met NameError (helpers, runtime are gone): the note
# names what works
RERUN_NOTE = ("Re-run this cell for the live planner, after the cells above it when the kernel restarted (Run > "
              "Run All Above: the setup cell brings back helpers)")
_STATIC_STYLE = (f"<style>.jp-OutputArea:has({_LIVE}) .ds-plan-static {{display: none}}\n"
                 f".output_wrapper .output:has({_LIVE}) .ds-plan-static {{display: none}}\n"
                 f"body:not(:has(.jp-OutputArea)):has({_LIVE}) .ds-plan-static {{display: none}}\n"
                 f".jp-OutputArea:has(.ds-plan-static) .jp-OutputArea-child:has({_DEAD}) {{display: none}}\n"
                 f".output_wrapper .output:has(.ds-plan-static) .output_area:has({_DEAD}) {{display: none}}\n"
                 f"{_DEAD} {{pointer-events: none; opacity: 0.45}}\n"
                 f"{_DEAD}::after {{content: '{RERUN_NOTE}: the kernel behind these "
                 "controls has stopped'; display: block; color: #b3261e; font-weight: bold}\n"
                 ".jp-OutputArea:has(.ds-plan-static) .jp-OutputArea-child:has(.jupyter-widgets):not(:has(.ds-planner))"
                 " {display: none}\n"
                 ".jp-OutputArea:has(.ds-plan-static) .jp-OutputArea-child:not(:has([data-mime-type]))"
                 ":not(:has(.ds-planner)) {display: none}\n"
                 ".output_wrapper .output:has(.ds-plan-static) .output_area:has(.jupyter-widgets-view)"
                 ":not(:has(.ds-planner)) {display: none}\n"
                 ".output_wrapper .output:has(.ds-plan-static) .output_area:has(.output_text:not(.output_stream)"
                 ":not(.output_error)):not(:has(.ds-planner)) {display: none}</style>")


def _static_html(parts: dict[str, str], note: str) -> str:
    """The planner's last plan as static HTML (issue 16, problem 5), under a banner that says it is a copy and to
    re-run the cell (`note` says why there are no controls)."""
    banner = (f'<div class="ds-plan-rerun" style="border:1px solid {_VERDICT_COLOURS["refused"]};background:#fff8e5;'
              f'color:#111;padding:4px 8px;margin:2px 0"><b>{RERUN_NOTE}</b> ({html.escape(note)})</div>')
    return (f'<div class="ds-plan-static">{banner}{parts["verdict"]}{parts["picture"]}{parts["actions"]}'
            '<details><summary style="display:list-item;cursor:pointer">memory table and DeepSpeed JSON</summary>'
            f'{parts["details"]}</details></div>')


def _static_copy_html(parts: dict[str, str]) -> str:
    """The copy a live planner keeps in its output for a notebook reopened without its kernel, or a restarted one."""
    return _STATIC_STYLE + _static_html(parts, "a saved copy of its last plan: its kernel has stopped or restarted, "
                                               "or the notebook was reopened")


# ipywidgets (7 and 8) keep a button's label on one line and cut it ('...') where the column is narrow: the apply
# button's label wraps instead. In the verdict's HTML, which the widget always shows.
_WIDGET_STYLE = ("<style>.ds-planner .widget-button.ds-plan-apply {white-space: normal; overflow: visible; "
                 "height: auto; min-height: var(--jp-widgets-inline-height, 28px); text-align: left; "
                 "line-height: 1.3; padding-top: 2px; padding-bottom: 2px} "
                 # the chart's HTML widget is a flex item: its default min-width (auto) kept it at the picture's 760 px,
                 # so the whole planner scrolled (title and legend cut) instead of the picture's own scroll box
                 ".ds-planner .ds-plan-chart, .ds-planner .ds-plan-chart > .widget-html-content {min-width: 0}</style>")


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


def _plan_or_error(name: str, runtime: "Runtime", **settings: Any) -> tuple["Plan | None", str]:
    """plan(name, ...) for the planner, or the error that stopped it (unknown model id, no network ...)."""
    try:
        return planner.plan(name, runtime=runtime, **settings), ""
    except Exception as exc:
        return None, str(exc)


def _planner_controls(w: Any, model: str) -> dict[str, Any]:
    """The planner's settings as ipywidgets controls, keyed by `plan`'s argument names (`planner_widget`)."""
    from helpers.models import GPT2_CONTEXT, GPT2_LADDER

    style = {"description_width": "initial"}

    def box(width: str) -> Any:  # spaced by its margin: ipywidgets' Layout has no `gap` (7.7.1 and 8.1 alike)
        return w.Layout(width=width, min_width=width, margin="2px 12px 2px 0")

    return {
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
        # no max (a bounded field clamped 2000 to 1024 in silence): plan estimates any size, and refuses 0 or less
        # with the fix, which "apply" sets
        "micro_batch_size": w.IntText(value=4, step=1, description="micro-batch", style=style,
                                      continuous_update=False, layout=box("170px")),
        # the ladder's GPT-2s have GPT2_CONTEXT positions: longer is not offered (plan refuses it with the fix)
        "seq_len": w.Dropdown(options=[n for n in SEQ_LENS if n <= GPT2_CONTEXT], value=512,
                              description="seq len", style=style, layout=box("150px")),
        "checkpointing": w.Checkbox(value=True, description="activation checkpointing", indent=False,
                                    style=style, layout=box("210px")),
        "zero_init": w.Checkbox(value=False, description=f"model {_ZERO_INIT_LABEL} (stage 3)", indent=False,
                                style=style, layout=box("260px"), disabled=True),
    }


def planner_widget(runtime: "Runtime | None" = None, model: str = "gpt2") -> Any:
    """An ipywidgets dashboard over `plan`, starting at `model` (notebook 00): a coloured verdict line at the top
    (with the fix in the widget's own settings and a button that applies it, and the predicted speed when the plan
    has one), the plan as stacked bars against this runtime's budgets, the controls, a download / copy of the
    DeepSpeed JSON, and the memory table and JSON folded in an accordion. Changing a setting re-plans; the model
    field re-plans on Enter or when it loses focus (`continuous_update=False`), and shows "looking up ..." before a
    name that may ask the Hugging Face Hub (which answers within `helpers.models.HUB_LOOKUP_TIMEOUT_S` or fails).
    The same settings give the same numbers as `plan(...)` in a cell ("built under zero.Init" is plan's `zero_init`).

    When a runner saves the notebook (`helpers.progress.saved_run()`), a widget would be saved as `VBox(children=...)`:
    then the plan of the starting settings is returned as static HTML, saying to run the cell in Jupyter or Colab for
    controls.
    """
    from helpers.hardware import detect_runtime
    from helpers.progress import saved_run

    runtime = runtime or detect_runtime()
    if saved_run():
        from IPython.display import HTML

        p, error = _plan_or_error(model, runtime)
        note = (f"a saved copy: run this cell in Jupyter or Colab for its controls; {model}, ZeRO-2, "
                "micro-batch 4 x 512")
        return HTML(_static_html(_rendering(p, model, error), note))
    import ipywidgets as w

    controls = _planner_controls(w, model)
    verdict, picture, actions, details = w.HTML(), w.HTML(), w.HTML(), w.HTML()
    picture.add_class("ds-plan-chart")  # may shrink below its picture, whose own box then scrolls (_WIDGET_STYLE)
    apply = w.Button(description="apply the fix", button_style="success", icon="check",
                     layout=w.Layout(width="auto", max_width="100%", height="auto", display="none"))
    apply.add_class("ds-plan-apply")  # its label wraps in a narrow column (_WIDGET_STYLE), its tooltip is the fix
    fold = w.Accordion(children=[details])
    fold.set_title(0, "memory table and DeepSpeed JSON")
    fold.selected_index = None
    state: dict[str, Any] = {"fix": {}, "busy": False, "static": _display_handle()}

    def show(parts: dict[str, str]) -> None:
        verdict.value, picture.value = _WIDGET_STYLE + parts["verdict"], parts["picture"]
        actions.value, details.value = parts["actions"], parts["details"]
        if state["static"] is not None:
            from IPython.display import HTML

            state["static"].update(HTML(_static_copy_html(parts)))

    def refresh(_: Any = None) -> None:
        if state["busy"]:  # "apply" sets several controls: plan once, at the end
            return
        settings = {k: c.value for k, c in controls.items()}
        name = str(settings.pop("model"))
        controls["zero_init"].disabled = settings["stage"] != 3
        apply.layout.display = "none"
        if _may_touch_the_hub(name):  # shown before a lookup that may take seconds
            verdict.value = (f'<div class="ds-plan-verdict" style="color:{_VERDICT_COLOURS["busy"]};padding:4px 8px">'
                             f"<i>{html.escape(_LOOKUP_NOTE.format(name=repr(name)))}</i></div>")
        p, error = _plan_or_error(name, runtime, **settings)  # an error replaces the verdict, never the old one
        refused = _refusal_settings(p, name, runtime, settings) if p is not None and p.error else {}
        state["fix"] = refused or (_suggested_settings(p) if p is not None else {})
        show(_rendering(p, name, error, refused))
        if state["fix"]:
            apply.description = "apply: " + _settings_text(state["fix"])
            apply.tooltip = apply.description
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
    row = w.Layout(flex_flow="row wrap")
    ui = w.VBox([verdict, apply, picture, w.HBox(c[:4], layout=row), w.HBox(c[4:], layout=row), actions, fold])
    ui.add_class("ds-planner")
    return ui
