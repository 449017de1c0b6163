"""Matplotlib figures of memory: measured vs estimated, breakdown, over time (notebooks 00-05).

Records in, Figure out; no torch or deepspeed here and no global style changes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from helpers.memory import ModelStateEstimate

GiB = 1024**3
GB = 1000**3
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
          "buffers": "#8172B3", "model copy": "#937860",
          "staging": "#DA8BC3"}


def _figure(width: float = 7.0, height: float = 4.0) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def plot_peak_vram(names: Sequence[str], measured_gib: Sequence[float], estimated_gib: Sequence[float],
                   budget_gib: float | None = None, title: str = "Peak GPU memory per config") -> "Figure":
    """Bars of measured peak VRAM beside the estimate, with the budget as a dashed line."""
    fig = _figure()
    ax = fig.add_subplot()
    x = range(len(names))
    w = 0.38
    ax.bar([i - w / 2 for i in x], measured_gib, w, label="measured peak", color="#4C72B0")
    ax.bar([i + w / 2 for i in x], estimated_gib, w, label="estimate", color="#BBBBBB", edgecolor="#555555")
    if budget_gib:
        ax.axhline(budget_gib, color="#C44E52", linestyle="--", label=f"budget {budget_gib:.1f} GiB")
    ax.set_xticks(list(x), list(names), rotation=20, ha="right")
    ax.set_ylabel("GiB")
    ax.set_title(title)
    ax.legend()
    return fig


def plot_memory_breakdown(estimates: Sequence["ModelStateEstimate"], where: str = "gpu",
                          budget_gib: float | None = None, title: str | None = None) -> "Figure":
    """Stacked bars: params / grads / optimizer / activations per estimate, on 'gpu' or 'cpu'."""
    fig = _figure()
    ax = fig.add_subplot()
    labels = [e.label for e in estimates]
    bottoms = [0.0] * len(estimates)
    present = {comp for e in estimates for comp, value in getattr(e, where).items() if value}
    components = [c for c in COLORS if c in present] + sorted(present - set(COLORS))
    for comp in components:
        values = [getattr(e, where).get(comp, 0) / GiB for e in estimates]
        ax.bar(range(len(estimates)), values, bottom=bottoms, label=comp, color=COLORS.get(comp))
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if budget_gib:
        ax.axhline(budget_gib, color="#C44E52", linestyle="--", label=f"budget {budget_gib:.1f} GiB")
    ax.set_xticks(range(len(estimates)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"{where.upper()} GiB (estimate)")
    ax.set_title(title or f"What fills {where.upper()} memory")
    ax.legend(fontsize=8)
    return fig


def plot_memory_timeline(samples: Sequence[dict[str, float]], title: str = "Memory during training",
                         ram_budget_gb: float | None = None) -> "Figure":
    """GPU allocated/reserved (GiB) and process RSS (GB) over time from `Measurement.samples`."""
    fig = _figure()
    ax = fig.add_subplot()
    t = [s["t"] for s in samples]
    series: list[tuple[str, str, float]] = [("gpu_allocated", "GPU allocated (GiB)", GiB),
                                            ("gpu_reserved", "GPU reserved (GiB)", GiB),
                                            ("rss", "CPU RSS (GB)", GB), ("nvme", "NVMe folder (GB)", GB)]
    for key, label, unit in series:
        points = [(s["t"], s[key] / unit) for s in samples if key in s]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
    if ram_budget_gb:
        ax.axhline(ram_budget_gb, color="#C44E52", linestyle="--", label=f"RAM budget {ram_budget_gb:.1f} GB")
    ax.set_xlabel("seconds")
    ax.set_ylabel("GiB / GB")
    ax.set_title(title)
    if t:
        ax.set_xlim(0, max(t))
    ax.legend(fontsize=8)
    return fig


def plot_losses(losses: Sequence[float], title: str = "Training loss", **named: Any) -> "Figure":
    """Loss per step; extra keyword series (e.g. val=[...]) are drawn too."""
    fig = _figure(6, 3.5)
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, label="train", marker=".")
    for name, values in named.items():
        ax.plot(range(1, len(values) + 1), values, label=name, marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    return fig


def plot_speed_vs_memory(names: Sequence[str], peak_vram_gib: Sequence[float], tokens_per_s: Sequence[float],
                         peak_rss_gb: Sequence[float], ram_budget_gb: float | None = None,
                         title: str = "Speed for scale") -> "Figure":
    """Left: peak VRAM vs tokens/s per config (scatter); right: peak CPU RSS per config (notebook 02)."""
    fig = _figure(11, 4)
    ax, ax2 = fig.subplots(1, 2)
    for i, (name, x, y) in enumerate(zip(names, peak_vram_gib, tokens_per_s)):
        ax.scatter([x], [y], s=60, color=f"C{i}", label=name)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("tokens/s")
    ax.set_yscale("log")
    ax.set_title(title)
    ax2.bar(range(len(names)), list(peak_rss_gb), color=[f"C{i}" for i in range(len(names))])
    if ram_budget_gb:
        ax2.axhline(ram_budget_gb, color="#C44E52", linestyle="--", label=f"RAM budget {ram_budget_gb:.1f} GB")
        ax2.legend(fontsize=8)
    ax2.set_xticks(range(len(names)), list(names), rotation=20, ha="right", fontsize=8)
    ax2.set_ylabel("peak process RSS (GB)")
    ax2.set_title("CPU RAM")
    return fig
