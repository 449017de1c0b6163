import matplotlib

from helpers.memory import estimate_model_states
from helpers.plots import plot_losses, plot_memory_breakdown, plot_memory_timeline, plot_peak_vram


def test_plots_return_figures_without_touching_global_style():
    before = dict(matplotlib.rcParams)
    fig = plot_peak_vram(["ZeRO-0", "ZeRO-2"], [2.9, 2.8], [2.5, 2.4], budget_gib=15)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 and any("budget 15.0 GiB" in t.get_text() for t in ax.get_legend().get_texts())
    ests = [estimate_model_states(10**8, s, precision="fp16").with_activations(2**30) for s in (0, 3)]
    fig = plot_memory_breakdown(ests, budget_gib=15)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [x for x in labels if not x.startswith("budget")] == ["params", "grads", "optimizer", "activations"]
    samples = [{"t": 0.0, "rss": 1e9, "gpu_allocated": 2**30}, {"t": 1.0, "rss": 2e9, "gpu_allocated": 2**31}]
    fig = plot_memory_timeline(samples, ram_budget_gb=12.7)
    assert len(fig.axes[0].lines) == 3  # GPU allocated, RSS, budget line
    assert plot_losses([3.0, 2.0, 1.0], val=[2.5, 1.5]).axes[0].lines[1].get_ydata().tolist() == [2.5, 1.5]
    assert dict(matplotlib.rcParams) == before


def test_speed_vs_memory_has_one_point_per_config_and_the_ram_budget():
    from helpers.plots import plot_speed_vs_memory

    fig = plot_speed_vs_memory(["ZeRO-2 + CPU", "ZeRO-3 NVMe"], [2.9, 1.1], [1400.0, 90.0], [20.5, 9.8],
                               ram_budget_gb=12.7)
    scatter, bars = fig.axes
    assert len(scatter.collections) == 2 and scatter.get_yscale() == "log"
    assert [p.get_height() for p in bars.patches] == [20.5, 9.8]
    assert bars.lines[0].get_ydata()[0] == 12.7
