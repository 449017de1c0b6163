"""Every figure of the course: memory measured vs estimated, its breakdown and timeline, speed vs memory, losses,
MoE's parameters, expert load, capacity and balance, ZeRO's per-rank scaling, activations against sequence length
(notebooks 00-06).

Records in (`helpers.train.RunResult`s where a figure plots runs). In a notebook every figure is displayed where it is
made, inside an `if` or a loop too, and the function returns None (so a cell ending with it does not show it twice);
elsewhere, or with `show=False`, the matplotlib Figure is returned. matplotlib is imported inside the functions,
no torch or deepspeed here and no global style changes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from helpers.memory import ModelStateEstimate
    from helpers.planner import Plan
    from helpers.step_time import StepTimeEstimate
    from helpers.train import RunResult

__all__ = ["show_folded", "plot_peak_vram", "plot_step_time", "plot_memory_breakdown", "plot_memory_timeline",
           "plot_losses", "plot_plans", "plot_speed_vs_memory", "plot_expert_load", "plot_zero_scaling",
           "plot_activation_growth", "plot_longest_sequence"]

GiB = 1024**3
GB = 1000**3
# one colour per row of a memory breakdown or plan (helpers.memory.COMPONENTS, helpers.planner's extra rows)
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
          "step temporaries": "#E6A5A5", "buffers": "#8172B3", "staging": "#DA8BC3",
          "step on host": "#F0B6D8", "runtime": "#CCB974", "model copy": "#937860", "pinned copy": "#64B5CD",
          "already in use": "#BBBBBB"}
BUDGET_COLOR = "#C44E52"
TIGHT_COLOR = "#B8860B"  # a GPU total inside the planner's margin below the budget (planner.GPU_TIGHT_MARGIN)


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (Colab's too), where a figure can be displayed."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _show(fig: "Figure", show: bool | None) -> "Figure | None":
    """Display `fig` now when in a notebook (or `show=True`) and return None; otherwise return it."""
    if show is None:
        show = _in_notebook()
    if not show:
        return fig
    from IPython.display import display

    display(fig)
    return None


def _figure(width: float = 7.0, height: float = 4.0) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _tight_line(ax: Any, budget_gib: float) -> None:
    """A dotted line where the planner's margin below a GPU budget begins: a plan above it fits but is tight."""
    from helpers.planner import GPU_TIGHT_MARGIN

    ax.axhline(budget_gib * (1 - GPU_TIGHT_MARGIN), color=BUDGET_COLOR, linestyle=":", linewidth=1,
               label=f"budget less {GPU_TIGHT_MARGIN:.0%}: tight above {budget_gib * (1 - GPU_TIGHT_MARGIN):.2f} GiB")


def plot_peak_vram(runs: Sequence["RunResult"], budget_gib: float | None = None,
                   title: str = "Peak GPU memory per config", show: bool | None = None) -> "Figure | None":
    """Bars of each run's measured peak VRAM beside its estimate, with the budget as a dashed line and where the
    planner's margin below it begins (a plan above it is tight) dotted (notebook 01)."""
    fig = _figure()
    ax = fig.add_subplot()
    names = [r.name for r in runs]
    x = range(len(names))
    w = 0.38
    measured = ax.bar([i - w / 2 for i in x], [r.peak_vram_gib for r in runs], w, label="measured peak",
                      color="#4C72B0")
    ax.bar([i + w / 2 for i in x], [r.estimated_vram_gib for r in runs], w, label="estimate", color="#BBBBBB",
           edgecolor="#555555")
    # each measured peak written on its bar: beside a budget line far above them the bars' differences are too small
    # to read by eye (notebook 01: 2.8 vs 3.1 GiB under a 14.34 GiB line)
    ax.bar_label(measured, fmt="%.2f", fontsize=7, padding=2)
    if budget_gib:
        ax.axhline(budget_gib, color="#C44E52", linestyle="--", label=f"budget {budget_gib:.2f} GiB")
        _tight_line(ax, budget_gib)
    ax.set_xticks(list(x), list(names), rotation=20, ha="right")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend()
    return _show(fig, show)


def plot_memory_breakdown(estimates: Sequence["ModelStateEstimate"], where: str = "gpu",
                          budget_gib: float | None = None, title: str | None = None,
                          show: bool | None = None, budget_bytes: int | None = None) -> "Figure | None":
    """Stacked bars: params / grads / optimizer / activations per estimate, on 'gpu' (GiB) or 'cpu' / 'nvme' (GB,
    the course's unit for RAM and disk) (notebook 01). The budget line: `budget_bytes`, or `budget_gib` (GPU); on the
    GPU also where the planner's margin below it begins (dotted)."""
    unit, unit_name = (GiB, "GiB") if where == "gpu" else (GB, "GB")
    budget = budget_bytes / unit if budget_bytes else (budget_gib * GiB / unit if budget_gib else None)
    fig = _figure()
    ax = fig.add_subplot()
    labels = [e.label for e in estimates]
    bottoms = [0.0] * len(estimates)
    present = {comp for e in estimates for comp, value in getattr(e, where).items() if value}
    components = [c for c in COLORS if c in present] + sorted(present - set(COLORS))
    for comp in components:
        values = [getattr(e, where).get(comp, 0) / unit for e in estimates]
        ax.bar(range(len(estimates)), values, bottom=bottoms, label=comp, color=COLORS.get(comp))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if budget:
        ax.axhline(budget, color=BUDGET_COLOR, linestyle="--", label=f"budget {budget:.2f} {unit_name}")
        if where == "gpu":
            _tight_line(ax, budget)
    ax.set_xticks(range(len(estimates)), labels, rotation=20, ha="right", fontsize=8)
    place = {"gpu": "GPU", "cpu": "RAM", "nvme": "NVMe"}.get(where, where.upper())
    ax.set_ylabel(f"{place} {unit_name} (estimate)")
    ax.set_title(title or f"What fills {place} memory")
    ax.legend(fontsize=8)
    return _show(fig, show)


# ---------------------------------------------------------------- the planner (notebook 00)

# (attribute of a PreflightReport's rows and budget, label, bytes per unit, unit)
_PLAN_PANELS = (("gpu", "GPU", GiB, "GiB"), ("ram", "CPU RAM", GB, "GB"), ("disk", "disk (NVMe)", GB, "GB"))


def _plan_panels(plans: Sequence["Plan"]) -> list[tuple[str, str, float, str]]:
    """The budgets some plan uses: GPU where the runtime has one, RAM always, disk where a plan offloads to NVMe."""
    reports = [p.report for p in plans if p.report is not None]
    keep = {"gpu": any(r.gpu_budget for r in reports), "ram": True, "disk": any(r.disk_rows for r in reports)}
    return [panel for panel in _PLAN_PANELS if keep[panel[0]]]


def _plan_label(p: "Plan") -> str:
    """'ZeRO-3, opt.->cpu, params->cpu, zero.Init': the config in short, without the precision every bar shares."""
    assert p.report is not None
    parts = p.report.estimate.label.split(" + ")[:-1]  # the last part is the precision
    label = ", ".join(part.replace("optimizer->", "opt.->") for part in parts)
    return label + (", zero.Init" if p.zero_init and parts[0] == "ZeRO-3" else "")


# the planner's picture, in inches (100 px each as figure_html draws it): it fits the 449 px output column JupyterLab
# leaves at a 900 px window with its file browser open (issue 41 item 9)
PLAN_PICTURE_WIDTH_IN = 4.4


def _plan_figure(plans: Sequence["Plan"], title: str | None) -> "Figure":
    """One horizontal panel per budget (GPU GiB, RAM GB, disk GB), one stacked bar per plan, the budget dashed (and,
    for RAM, where the share kept free for the estimate's error begins, dotted; for the GPU, where the planner's
    margin begins, dotted: a total past it is tight, drawn in TIGHT_COLOR); each bar's total at its end; the
    legend on the right in the table's row order. Laid out in inches by hand: the planner redraws it on every change
    and matplotlib's automatic layouts take most of the time.

    One plan (the planner's picture) is drawn PLAN_PICTURE_WIDTH_IN wide, its legend below the panels and its title
    wrapped: at 900 px with JupyterLab's file browser open the output column is 449 px, and the 760 px picture showed
    its left part only (the title cut, the totals and the legend hidden until scrolled; issue 41 item 9)."""
    import textwrap

    from matplotlib.figure import Figure

    from helpers.planner import _row_order

    plans = [p for p in plans if p.report is not None]
    panels = _plan_panels(plans)
    single = len(plans) == 1
    longest = max((len(_plan_label(p)) for p in plans), default=0)
    names = _row_order(*(getattr(p.report, f"{key}_rows") for p in plans for key, *_ in panels))
    if single:  # narrow: y labels, the panels, the totals inside them; the legend below
        width, left, right = PLAN_PICTURE_WIDTH_IN, 0.2 + 0.072 * max(len(panel[1]) for panel in panels), 0.25
        used = [n for n in names if any(getattr(plans[0].report, f"{key}_rows").get(n) for key, *_ in panels)]
        columns = max(1, min(3, int((width - 0.2) // (0.45 + 0.066 * max((len(n) for n in used), default=8)))))
        legend_rows = -(-len(used) // columns)
        bottom = 0.12 + 0.19 * legend_rows
        lines = textwrap.wrap(title, int((width - 0.2) * 72 / 5.6)) if title else []  # ~5.6 pt a character at 10 pt
    else:
        width, left, right = 7.6, 0.25 + 0.062 * longest, 1.55  # inches: y labels, legend on the right
        columns, bottom, lines = 1, 0.0, [title] if title else []
    heights = [max(len(plans), 1) * 0.36 + 0.22 for _ in panels]
    gap, top = 0.62, (0.25 + 0.17 * len(lines) if lines else 0.22)
    height = top + sum(heights) + gap * len(panels) - 0.12 + bottom
    fig = Figure(figsize=(width, height))
    handles: dict[str, Any] = {}
    y_top = height - top
    for (key, label, unit, unit_name), panel_height in zip(panels, heights):
        y_top -= panel_height
        ax = fig.add_axes((left / width, y_top / height, (width - left - right) / width, panel_height / height))
        y_top -= gap
        y = list(range(len(plans)))[::-1]  # the first plan on top
        ends = [0.0] * len(plans)
        for name in names:
            widths = [getattr(p.report, f"{key}_rows").get(name, 0) / unit for p in plans]
            if any(widths):
                bars = ax.barh(y, widths, left=ends, height=0.62, color=COLORS.get(name, "#999999"), label=name,
                               edgecolor="white", linewidth=0.5)
                handles.setdefault(name, bars)
                ends = [a + b for a, b in zip(ends, widths)]
        report = plans[0].report if plans else None
        budget = getattr(report, f"{key}_budget") / unit if report is not None else 0.0
        margin = {"ram": report.ram_margin, "gpu": report.gpu_margin}.get(key, 0.0) if report is not None else 0.0
        limit = budget * (1 - margin)  # RAM: where the share kept free begins; GPU: where a plan is tight
        over = limit if key == "ram" else budget  # past it the plan does not fit
        span = max(ends + [budget]) * 1.14 or 1.0
        if budget:
            ax.axvline(budget, color=BUDGET_COLOR, linestyle="--", linewidth=1.5)
            ax.text(budget, 1.02, f"budget {budget:.2f} {unit_name}", transform=ax.get_xaxis_transform(),
                    color=BUDGET_COLOR, fontsize=8, va="bottom", ha="right" if budget > 0.5 * span else "left")
        if limit < budget:
            ax.axvline(limit, color=BUDGET_COLOR, linestyle=":", linewidth=1)
        for yy, total in zip(y, ends):
            ax.text(total + 0.01 * span, yy, f"{total:.2f}" if total else "0", va="center", fontsize=8,
                    fontweight="bold" if total else "normal",
                    color=BUDGET_COLOR if budget and total > over else TIGHT_COLOR if budget and total > limit
                    else "#222222" if total else "#888888")
        ax.set_xlim(0, span)
        ax.set_ylim(-0.55, len(plans) - 0.45)
        ax.set_yticks(y, [label] if single else [_plan_label(p) for p in plans], fontsize=9 if single else 8)
        ax.set_xlabel(unit_name if single else f"{label} ({unit_name})", fontsize=8, labelpad=1)
        ax.tick_params(axis="both", length=2, pad=2)
        ax.tick_params(axis="x", labelsize=8)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    order = [n for n in names if n in handles]  # the table's row order, top to bottom
    if single:  # below the panels, row by row in the table's order
        fig.legend([handles[n] for n in order], order, loc="lower left", fontsize=8, frameon=False, ncol=columns,
                   bbox_to_anchor=(0.1 / width, 0.06 / height), borderaxespad=0, columnspacing=1.0,
                   handlelength=1.5, handletextpad=0.5, labelspacing=0.35)
    else:
        fig.legend([handles[n] for n in order], order, loc="upper left", fontsize=8, frameon=False,
                   bbox_to_anchor=((width - right + 0.12) / width, (height - top) / height), borderaxespad=0)
    if lines:
        fig.text(0.5, 1 - 0.1 / height, "\n".join(lines), ha="center", va="top", fontsize=10, linespacing=1.2)
    return fig


def plot_plan(plan: "Plan", title: str | None = None, show: bool | None = None) -> "Figure | None":
    """One plan as a picture (notebook 00's planner): for each budget (GPU in GiB where there is a GPU, CPU RAM in GB,
    disk in GB when it offloads to NVMe) a bar stacked from the rows of the plan's table, against this runtime's
    budget (dashed; for RAM the dotted line is where the share kept free for the estimate's error begins, for the
    GPU where the planner's margin begins: a plan past it fits but is tight)."""
    if title is None and plan.report is not None:
        title = f"{plan.shape.name}, {plan.report.estimate.label}: {plan.runtime_label}" if plan.runtime_label \
            else f"{plan.shape.name}, {plan.report.estimate.label}"
    return _show(_plan_figure([plan], title), show)


def plot_plans(plans: Sequence["Plan"], title: str | None = None, show: bool | None = None) -> "Figure | None":
    """Several plans side by side (notebook 00): one bar per plan in each budget's panel, as `plot_plan` draws one.
    Refused configs (no estimate) are left out."""
    return _show(_plan_figure(plans, title), show)


def show_folded(text: str, summary: str) -> None:
    """Show a long printed text folded under a one-line `summary` a reader clicks to open (an HTML <details>), so a
    cell's output stays short (notebook 00's raw ds_report). Where no HTML is shown, the summary alone is printed."""
    import html

    body = f"<details><summary>{html.escape(summary)}</summary><pre>{html.escape(text)}</pre></details>"
    if _in_notebook():
        from IPython.display import display

        display({"text/html": body, "text/plain": f"{summary} (folded: open it in Jupyter or Colab)"}, raw=True)
    else:
        print(summary)


def figure_html(fig: "Figure", alt: str = "", css_class: str = "", dpi: int = 100, scroll: bool = False) -> str:
    """`fig` as an <img> tag with the PNG inline (a widget's HTML, a static copy of it), at most as wide as its place;
    with `scroll`, at its own pixel size (fonts stay as drawn) in a box that scrolls sideways where the place is
    narrower (notebook 00's planner beside an open file browser)."""
    import base64
    import html
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    width, height = (round(x * dpi) for x in fig.get_size_inches())
    style = f"width:{width}px;height:{height}px;max-width:none" if scroll else "max-width:100%;height:auto"
    img = (f'<img class="{html.escape(css_class)}" alt="{html.escape(alt)}" style="{style}" '
           f'src="data:image/png;base64,{data}">')
    return f'<div class="ds-figure-scroll" style="overflow-x:auto;max-width:100%">{img}</div>' if scroll else img


def plot_memory_timeline(samples: Sequence[dict[str, float]], title: str = "Memory during training",
                         ram_budget_gb: float | None = None, show: bool | None = None) -> "Figure | None":
    """GPU allocated/reserved (GiB) and process RSS (GB) over time from `Measurement.samples` (notebook 00)."""
    t = [s["t"] for s in samples]
    gpu = [(key, label) for key, label in (("gpu_allocated", "GPU allocated"), ("gpu_reserved", "GPU reserved"))
           if any(s.get(key) for s in samples)]
    fig = _figure(11 if gpu else 7, 4)
    axes = fig.subplots(1, 2 if gpu else 1, squeeze=False)[0]
    host = axes[-1]  # CPU RAM and disk, in GB (the unit they are budgeted in)
    for key, label in (("rss", "process RSS"), ("nvme", "NVMe folder")):
        points = [(s["t"], s[key] / GB) for s in samples if key in s]
        if points:
            host.plot([p[0] for p in points], [p[1] for p in points], label=label)
    if ram_budget_gb:
        host.axhline(ram_budget_gb, color="#C44E52", linestyle="--", label=f"RAM budget {ram_budget_gb:.1f} GB")
    host.set_ylabel("GB")
    host.set_title("CPU RAM and disk" if any("nvme" in s for s in samples) else "CPU RAM")
    if gpu:  # GPU memory in GiB, as torch and the VRAM budget count it
        for key, label in gpu:
            axes[0].plot([s["t"] for s in samples if key in s], [s[key] / GiB for s in samples if key in s], label=label)
        axes[0].set_ylabel("GiB")
        axes[0].set_title("GPU memory")
    for ax in axes:
        ax.set_xlabel("seconds")
        tops = [max(line.get_ydata(), default=0) for line in ax.get_lines()]
        # a flat line (RSS through a short run) sat on the frame under the legend: room above the highest one
        if tops and max(tops) > 0:
            ax.set_ylim(0, 1.25 * max(tops))
        else:
            ax.set_ylim(bottom=0)
        if t:
            ax.set_xlim(0, max(t))
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _show(fig, show)


def plot_losses(losses: Sequence[float], title: str = "Training loss", show: bool | None = None,
                label: str = "train", **named: Any) -> "Figure | None":
    """Loss per step (named `label`); extra keyword series are drawn too (notebook 01).

    An extra series is a list of losses per step, or of (step, loss) pairs for one measured at some steps only
    (validation every k steps: ``val=[(10, 3.2), (20, 2.9)]``), drawn at those steps."""
    fig = _figure(6, 3.5)
    ax = fig.add_subplot()
    named = {name: list(values) for name, values in named.items()}  # each series read once (an iterator too)
    per_step = [n for n, v in named.items() if not (v and isinstance(v[0], (tuple, list)))]
    # where other per-step series may lie on this one (the same run through other drivers), this one is drawn wide
    # and pale and each other one in a line style of its own, so a reader sees them agree instead of one line
    ax.plot(range(1, len(losses) + 1), losses, label=label, marker=".",
            **({"linewidth": 5, "alpha": 0.45} if per_step else {}))
    styles = iter(["--", ":", "-."] * len(named))
    for name, values in named.items():
        if name not in per_step:
            ax.plot([v[0] for v in values], [v[1] for v in values], label=name, marker="o")
        else:
            ax.plot(range(1, len(values) + 1), values, label=name, linestyle=next(styles), linewidth=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    return _show(fig, show)


def plot_speed_vs_memory(runs: Sequence["RunResult"], ram_gb: Sequence[float] | None = None,
                         ram_budget_gb: float | None = None, title: str = "Speed for scale", show: bool | None = None,
                         ram_label: str = "peak process RSS (GB)") -> "Figure | None":
    """Left: peak VRAM vs tokens/s per run (scatter); right: RAM per run (notebook 02).

    `ram_gb`: the RAM to show per run (e.g. with the notebook kernel's share added; say so in `ram_label`); default
    each run's peak RSS.
    """
    fig = _figure(11, 4)
    ax, ax2 = fig.subplots(1, 2)
    names = [r.name for r in runs]
    peak_rss_gb = list(ram_gb) if ram_gb is not None else [r.peak_rss_gb for r in runs]
    if any(r.peak_vram_gib for r in runs):
        for i, (name, x, y) in enumerate(zip(names, [r.peak_vram_gib for r in runs], [r.tokens_per_s for r in runs])):
            ax.scatter([x], [y], s=60, color=f"C{i}", label=name)
        ax.set_xlim(0, 1.15 * max(r.peak_vram_gib for r in runs))  # room around the points for their legend
        ax.set_xlabel("peak GPU memory (GiB)")
        ax.legend(fontsize=7)
    else:  # no GPU: no VRAM axis, tokens/s per run
        ax.bar(range(len(names)), [r.tokens_per_s for r in runs], color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), list(names), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s")
    speeds = [r.tokens_per_s for r in runs if r.tokens_per_s > 0]
    if speeds and max(speeds) > 10 * min(speeds):  # a log axis only where the speeds span orders of magnitude
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (log scale)")
    elif speeds:
        ax.set_ylim(0, 1.3 * max(speeds))  # no point on the frame, room for the legend
    else:
        ax.set_ylim(bottom=0)
    ax.set_title("speed" + (" against peak GPU memory" if any(r.peak_vram_gib for r in runs) else " per run"))
    fig.suptitle(title)  # the long runtime label once, above both panels (it overlapped the right panel's title)
    ax2.bar(range(len(names)), list(peak_rss_gb), color=[f"C{i}" for i in range(len(names))])
    if ram_budget_gb:
        ax2.axhline(ram_budget_gb, color="#C44E52", linestyle="--", label=f"RAM budget {ram_budget_gb:.2f} GB")
        ax2.legend(fontsize=8)
    ax2.set_xticks(range(len(names)), list(names), rotation=20, ha="right", fontsize=8)
    ax2.set_ylabel(ram_label)
    ax2.set_title("CPU RAM")
    return _show(fig, show)


def plot_step_time(curve: dict[int, "StepTimeEstimate"], measured: dict[int, float] | None = None,
                   title: str = "Speed for scale", show: bool | None = None) -> "Figure | None":
    """Left: one optimizer step's predicted seconds by component (stacked) per gradient-accumulation count; right:
    predicted tokens/s, the roofline and the measured points, against accumulation steps (notebook 02).

    `curve`: accumulation steps -> helpers.estimate_step_time for it; `measured`: accumulation steps -> tokens/s.
    """
    fig = _figure(11, 4)
    ax, ax2 = fig.subplots(1, 2)
    steps = sorted(curve)
    names = list(dict.fromkeys(n for g in steps for n in curve[g].components))
    bottom = [0.0] * len(steps)
    for i, name in enumerate(names):
        heights = [curve[g].components.get(name, 0.0) for g in steps]
        ax.bar(range(len(steps)), heights, bottom=bottom, color=f"C{i}",
               label=f"{name} ({curve[steps[0]].resources.get(name, curve[steps[-1]].resources.get(name, ''))})")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(steps)), [str(g) for g in steps])
    ax.set_xlabel("micro-batches per optimizer step (gradient accumulation)")
    ax.set_ylabel("predicted seconds per optimizer step")
    ax.set_title("Where one optimizer step's time goes")
    ax.legend(fontsize=7)
    ax2.plot(steps, [curve[g].tokens_per_s for g in steps], marker="o", label="predicted (components one after another)")
    ax2.plot(steps, [curve[g].roofline_tokens_per_s for g in steps], linestyle="--", color="grey",
             label="roofline (the busiest resource alone)")
    if measured:
        xs = sorted(measured)
        ax2.scatter(xs, [measured[g] for g in xs], s=70, color="#C44E52", zorder=3, label="measured")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(steps, [str(g) for g in steps])
    ax2.set_yscale("log")
    ax2.set_xlabel("micro-batches per optimizer step (log scale)")
    ax2.set_ylabel("tokens/s (log scale)")
    ax2.set_title("tokens/s against accumulation")
    fig.suptitle(title)  # the long label once, above both panels
    ax2.legend(fontsize=7)
    return _show(fig, show)


# ---------------------------------------------------------------- Mixture of Experts (notebook 03)


def plot_expert_load(history: Sequence[Sequence[int]], title: str = "Tokens per expert over training",
                     capacity: float | None = None, show: bool | None = None) -> "Figure | None":
    """Routes each expert was asked for per step, as a heatmap: one row per expert, one column per step, the colour
    the routes over the capacity (`capacity`; without it, over the step's mean) (notebook 03). Above 1.0 (red) the
    expert was full and the routes beyond its capacity were dropped. Eight lines on one axis overlap beyond reading;
    eight rows do not."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    data = np.asarray(history, dtype=float).T  # (experts, steps)
    if data.size == 0:
        data = np.zeros((1, 1))
    scale = capacity if capacity else max(float(data.mean()), 1.0)
    ratio = data / scale
    fig = _figure(7.0, 3.2)
    ax = fig.add_subplot()
    top = max(2.0, float(ratio.max()))
    image = ax.imshow(ratio, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                      norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top),
                      extent=(0.5, ratio.shape[1] + 0.5, ratio.shape[0] - 0.5, -0.5))
    ax.set_yticks(range(ratio.shape[0]))
    ax.set_yticklabels([f"expert {e}" for e in range(ratio.shape[0])], fontsize=7)
    ax.set_xlabel("step")
    bar = fig.colorbar(image, ax=ax, pad=0.01)
    bar.set_label("routes asked / capacity" if capacity else "routes asked / mean", fontsize=8)
    if capacity:
        bar.ax.axhline(1.0, color="black", linewidth=1)
    full = float((ratio > 1).mean())
    ax.set_title(f"{title}\nred: asked for more than its capacity ({full:.0%} of expert-steps); "
                 "the routes beyond it were dropped" if capacity else title, fontsize=9)
    return _show(fig, show)


def plot_capacity_sweep(rows: Sequence[dict[str, float]], title: str = "Capacity factor", show: bool | None = None) -> "Figure | None":
    """Dropped share of routes (bars) and validation loss (line) against the capacity factor (`capacity_sweep`)
    (notebook 03)."""
    fig = _figure(7.0, 3.8)
    ax = fig.add_subplot()
    x = [str(r["capacity_factor"]) for r in rows]
    ax.bar(x, [100 * r["dropped_fraction"] for r in rows], color="#DD8452", label="dropped routes %")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("dropped routes (%)")
    ax2 = ax.twinx()
    ax2.plot(x, [r["val_loss"] for r in rows], color="#4C72B0", marker="o", label="validation loss")
    ax2.set_ylabel("validation loss")
    ax2.ticklabel_format(axis="y", useOffset=False)
    losses = [r["val_loss"] for r in rows]
    if losses:  # at least +-1 % of the loss around the points: a 0.0003 change must not look steep
        mid, half = (max(losses) + min(losses)) / 2, max((max(losses) - min(losses)) / 2 * 1.2, 0.01 * abs(max(losses)))
        ax2.set_ylim(mid - half, mid + half)
    ax.set_title(title)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    return _show(fig, show)


def plot_balance(runs: Sequence["RunResult"], title: str = "Share of routes per expert", show: bool | None = None) -> "Figure | None":
    """For each MoE run (`helpers.moe.MoEHooks`): the share of routes each expert was asked for (first MoE layer),
    as grouped bars (notebook 03)."""
    fig = _figure(7.0, 3.8)
    ax = fig.add_subplot()
    n = len(runs)
    width = 0.8 / max(n, 1)
    for i, r in enumerate(runs):
        row = r.extras["routing"]["demand"][0]
        total = sum(row) or 1
        ax.bar([e + (i - (n - 1) / 2) * width for e in range(len(row))], [100 * c / total for c in row], width,
               label=r.name)
    if runs:
        ax.axhline(100 / runs[0].extras["num_experts"], color="#555555", linestyle="--", label="even")
    ax.set_xlabel("expert")
    ax.set_ylabel("% of routes")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _show(fig, show)


def plot_params(names: Sequence[str], total: Sequence[int], active: Sequence[int],
                title: str = "Parameters: held vs used per token", show: bool | None = None) -> "Figure | None":
    """Total (held) and active (per token) parameters per model, side by side, in millions (notebook 03)."""
    fig = _figure(6, 3.5)
    ax = fig.add_subplot()
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [t / 1e6 for t in total], 0.4, label="total (held)", color="#4C72B0")
    ax.bar([i + 0.2 for i in x], [a / 1e6 for a in active], 0.4, label="active (per token)", color="#55A868")
    ax.set_xticks(list(x), list(names))
    ax.set_ylabel("million parameters")
    ax.set_title(title)
    ax.legend()
    return _show(fig, show)


# ---------------------------------------------------------------- scaling out (notebook 05)


def plot_zero_scaling(rows: Sequence[dict[str, Any]], title: str = "Model states per rank", show: bool | None = None) -> "Figure | None":
    """Per-rank bytes of each part against N, one panel per ZeRO stage; dashed: the estimator (notebook 05)."""
    from matplotlib.figure import Figure

    from helpers.scale_out import estimate_parts

    stages = sorted({r["stage"] for r in rows})
    fig = Figure(figsize=(3.2 * len(stages), 4.0), layout="constrained")
    axes = fig.subplots(1, len(stages), sharey=True, squeeze=False)[0]
    colors = {"params": "tab:blue", "grads_peak": "tab:orange", "optimizer": "tab:green"}
    labels = {"params": "params", "grads_peak": "grads (peak)", "optimizer": "optimizer"}
    for ax, stage in zip(axes, stages):
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["world"])
        ns = [r["world"] for r in mine]
        for key, color in colors.items():
            style = {"params": "s-", "grads_peak": "o-", "optimizer": "^-"}[key]  # params can equal grads: both show
            ax.plot(ns, [r[key] / 1e6 for r in mine], style, color=color, label=f"{labels[key]}, measured",
                    markersize=8 if key == "params" else 5, linewidth=3 if key == "params" else 1.5,
                    alpha=0.6 if key == "params" else 1.0, zorder=1 if key == "params" else 2)
            part = "grads" if key == "grads_peak" else key
            ax.plot(ns, [estimate_parts(r["n_params"], stage, r["world"], r["precision"])[part] / 1e6 for r in mine],
                    "x--", color=color, alpha=0.6, markersize=7, label=f"{part}, estimate")  # x: seen on a line
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)  # 1/N: a straight line down; not partitioned: flat
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_title(f"ZeRO-{stage}")
        ax.set_xlabel("ranks N")
    axes[0].set_ylabel("MB per rank (log scale)")
    # below the panels, not inside one: on the last (ZeRO-3) panel every line falls with N and the legend hid them
    handles, names = axes[-1].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title)
    return _show(fig, show)


# ---------------------------------------------------------------- long sequences (notebook 06)

def plot_activation_growth(lengths: Sequence[int], series: dict[str, tuple[Sequence[float], Sequence[float]]],
                           title: str = "Activation memory against sequence length",
                           show: bool | None = None) -> "Figure | None":
    """Measured points and estimated lines against sequence length, log-log (notebook 06). `series`: name ->
    (measured bytes per length, estimated bytes per length); a measured value of 0 is left out (not measured)."""
    fig = _figure()
    ax = fig.add_subplot()
    for i, (name, (measured, estimated)) in enumerate(series.items()):
        ax.plot(lengths, [b / GiB for b in estimated], color=f"C{i}", label=f"{name}: estimate")
        pts = [(n, b / GiB) for n, b in zip(lengths, measured) if b]
        if pts:
            ax.scatter(*zip(*pts), color=f"C{i}", s=40, zorder=3, label=f"{name}: measured")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(lengths), [f"{n:,}" for n in lengths])
    ax.set_xlabel("tokens in the sequence (batch 1)")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _show(fig, show)


def plot_longest_sequence(rows: Sequence[dict[str, Any]], title: str = "Longest sequence that trains",
                          show: bool | None = None, longest_tried: int | None = None) -> "Figure | None":
    """Left: the longest length each technique trained (bars) beside the estimate's prediction (outlined); right:
    tokens/s against sequence length, one line per technique (notebook 06). Each row: 'rung', 'longest', 'predicted'
    and 'speed' ({seq_len: tokens/s}). `longest_tried`: the last length a fixed list tried (notebook 06's
    TRY_LENGTHS), drawn as a line: a bar that reaches it stopped there because nothing longer was tried."""
    fig = _figure(11, 4)
    ax, ax2 = fig.subplots(1, 2)
    names = [r["rung"] for r in rows]
    x = range(len(rows))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["longest"] for r in rows], w, color="#4C72B0", label="trained (measured)")
    ax.bar([i + w / 2 for i in x], [r["predicted"] for r in rows], w, color="white", edgecolor="#555555",
           label="predicted to fit")
    ax.set_yscale("log", base=2)
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tokens")
    ax.set_title("longest sequence per technique")
    if longest_tried:
        ax.axhline(longest_tried, color="#555555", linestyle=":", linewidth=1,
                   label=f"longest tried ({longest_tried:,}): nothing longer was run")
    top = max([max(r["longest"], r["predicted"]) for r in rows] + [longest_tried or 0])
    if top > 0:
        ax.set_ylim(top=top * 8)  # room above the tallest bar: the legend sits there, over no bar (issue 52)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    for i, r in enumerate(rows):
        speed = r.get("speed") or {}
        if speed:
            lens = sorted(speed)
            ax2.plot(lens, [speed[n] for n in lens], marker="o", color=f"C{i}", label=r["rung"])
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens in the sequence")
    ax2.set_ylabel("tokens/s")
    ax2.set_title("tokens/s against sequence length (one step each)")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    return _show(fig, show)


def plot_long_context_memory(parts: dict[str, dict[str, int]], budget_bytes: int | None = None,
                             title: str = "Where GPU memory goes at each technique's longest sequence",
                             show: bool | None = None) -> "Figure | None":
    """Stacked bars, one per technique: its estimated peak by part (model states, what is kept for backward, the
    largest transient), with the budget line (notebook 06). `parts`: technique -> {part: bytes}."""
    fig = _figure(10, 4)
    ax = fig.add_subplot()
    names = list(parts)
    order = list(dict.fromkeys(k for p in parts.values() for k in p))
    bottom = [0.0] * len(names)
    for i, part in enumerate(order):
        values = [parts[n].get(part, 0) / GiB for n in names]
        ax.bar(range(len(names)), values, bottom=bottom, color=f"C{i}", label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    if budget_bytes:
        ax.axhline(budget_bytes / GiB, color=BUDGET_COLOR, linestyle="--", label=f"budget {budget_bytes / GiB:.2f} GiB")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GiB (estimate)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over one
    return _show(fig, show)
