import matplotlib
import pytest

from helpers.memory import estimate_model_states
from helpers.plots import plot_losses, plot_memory_breakdown, plot_memory_timeline, plot_peak_vram
from helpers.train import RunResult


def run(name, **measured):
    """A RunResult as train_run returns it, with only what a plot reads."""
    return RunResult(name=name, model="m", params=1, config=name, precision="fp16", micro_batch=1, grad_accum=1,
                     seq_len=1, steps=1, checkpointing=False, runtime="x", **measured)


def test_plots_return_figures_without_touching_global_style():
    before = dict(matplotlib.rcParams)
    fig = plot_peak_vram([run("ZeRO-0", peak_vram_gib=2.9, estimated_vram_gib=2.5),
                          run("ZeRO-2", peak_vram_gib=2.8, estimated_vram_gib=2.4)], budget_gib=14.34)
    ax = fig.axes[0]
    assert len(ax.patches) == 4 and [p.get_height() for p in ax.patches] == [2.9, 2.8, 2.5, 2.4] and any("budget 14.34 GiB" in t.get_text() for t in ax.get_legend().get_texts())
    assert any("tight above 13.62 GiB" in t.get_text() for t in ax.get_legend().get_texts())  # the planner's margin
    assert [t.get_text() for t in ax.texts] == ["2.90", "2.80"]  # each measured peak written on its bar
    ests = [estimate_model_states(10**8, s, precision="fp16").with_activations(2**30) for s in (0, 3)]
    fig = plot_memory_breakdown(ests, budget_gib=15)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [x for x in labels if not x.startswith("budget")] == ["params", "grads", "optimizer", "activations"]
    ram = plot_memory_breakdown(ests, where="cpu", budget_bytes=int(12.13e9)).axes[0]  # RAM in GB, as budgeted
    assert ram.get_ylabel() == "RAM GB (estimate)" and ram.lines[0].get_ydata()[0] == 12.13
    samples = [{"t": 0.0, "rss": 1e9, "gpu_allocated": 2**30}, {"t": 1.0, "rss": 2e9, "gpu_allocated": 2**31}]
    fig = plot_memory_timeline(samples, ram_budget_gb=12.7)
    gpu_ax, host_ax = fig.axes  # one unit per axis: GiB for the GPU, GB for RAM and disk
    assert gpu_ax.get_ylabel() == "GiB" and host_ax.get_ylabel() == "GB"
    assert len(gpu_ax.lines) == 1 and len(host_ax.lines) == 2  # GPU allocated; RSS and the budget line
    cpu_only = plot_memory_timeline([{"t": 0.0, "rss": 1e9}, {"t": 1.0, "rss": 2e9}])
    assert len(cpu_only.axes) == 1 and cpu_only.axes[0].get_ylabel() == "GB"  # no GPU axis on a CPU run
    # notebook 00's run: RSS flat at 2.15 GB sat on the frame under the legend; no NVMe, so no "disk" in the title
    flat = plot_memory_timeline([{"t": 0.0, "rss": 2.15e9}, {"t": 1.0, "rss": 2.15e9}]).axes[0]
    assert flat.get_ylim()[1] >= 1.2 * 2.15 and flat.get_title() == "CPU RAM"
    assert plot_memory_timeline([{"t": 0.0, "rss": 2e9, "nvme": 5e9}]).axes[0].get_title() == "CPU RAM and disk"
    assert plot_losses([3.0, 2.0, 1.0], val=[2.5, 1.5]).axes[0].lines[1].get_ydata().tolist() == [2.5, 1.5]
    val_at_steps = plot_losses([3.0] * 40, val=[(10, 2.5), (40, 1.5)]).axes[0].lines[1]
    assert val_at_steps.get_xdata().tolist() == [10, 40]  # drawn where it was measured, not at x = 1, 2
    assert dict(matplotlib.rcParams) == before


def test_speed_vs_memory_has_one_point_per_config_and_the_ram_budget():
    from helpers.plots import plot_speed_vs_memory

    runs = [run("ZeRO-2 + CPU", peak_vram_gib=2.9, tokens_per_s=1400.0, peak_rss_gb=20.5),
            run("ZeRO-3 NVMe", peak_vram_gib=1.1, tokens_per_s=90.0, peak_rss_gb=9.8)]
    fig = plot_speed_vs_memory(runs, ram_budget_gb=12.7)
    scatter, bars = fig.axes
    assert len(scatter.collections) == 2 and scatter.get_yscale() == "log"
    assert [p.get_height() for p in bars.patches] == [20.5, 9.8]  # the runs' own peak RSS (GB)
    assert bars.lines[0].get_ydata()[0] == 12.7
    with_kernel = plot_speed_vs_memory(runs, ram_gb=[22.0, 11.0]).axes[1]
    assert [p.get_height() for p in with_kernel.patches] == [22.0, 11.0]
    cpu = [run("ZeRO-3 CPU", peak_vram_gib=0.0, tokens_per_s=500.0), run("plain", peak_vram_gib=0.0, tokens_per_s=900.0)]
    speed = plot_speed_vs_memory(cpu).axes[0]  # no GPU: tokens/s per run, not every point at x = 0 GiB
    assert not speed.collections and [p.get_height() for p in speed.patches] == [500.0, 900.0]
    # notebook 02's two NVMe runs (close speeds, linear axis): no point on the frame, where the legend sat on one
    nvme = plot_speed_vs_memory([run("params on GPU", peak_vram_gib=2.26, tokens_per_s=57.0),
                                 run("params on NVMe", peak_vram_gib=0.94, tokens_per_s=52.0)]).axes[0]
    assert nvme.get_yscale() == "linear" and nvme.get_xlim()[1] > 2.26 * 1.1 and nvme.get_ylim()[1] > 57.0 * 1.2


def test_moe_plots_draw_what_they_are_given():
    from helpers.plots import plot_balance, plot_capacity_sweep, plot_expert_load, plot_params

    fig = plot_expert_load([[3, 1], [2, 2], [0, 4]], capacity=3)
    image = fig.axes[0].images[0].get_array()  # a heatmap: one row per expert, one column per step, over capacity
    assert image.shape == (2, 3) and image[1, 2] == 4 / 3 and "50% of expert-steps" not in fig.axes[0].get_title()
    fig = plot_capacity_sweep([{"capacity_factor": 0.5, "dropped_fraction": 0.4, "val_loss": 6.30001},
                               {"capacity_factor": 2.0, "dropped_fraction": 0.0, "val_loss": 6.3}])
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 2
    low, high = fig.axes[1].get_ylim()  # a 0.00001 change in loss is not drawn as a steep line
    assert high - low >= 0.02 * 6.3
    moe = run("a", extras={"num_experts": 2, "routing": {"demand": [[3, 1]]}})
    ax = plot_balance([moe, moe]).axes[0]
    assert len(ax.patches) == 4 and [p.get_height() for p in ax.patches][:2] == [75.0, 25.0]
    assert ax.lines[0].get_ydata()[0] == 50.0  # an even share of 2 experts
    assert len(plot_params(["d", "m"], [10, 30], [10, 10]).axes[0].patches) == 4


def test_zero_scaling_plots_one_panel_per_stage_with_the_estimate():
    from helpers.plots import plot_zero_scaling

    rows = [{"stage": s, "world": n, "n_params": 10**6, "precision": "fp16", "params": 2e6, "grads_peak": 2e6 / n,
             "optimizer": 12e6 / n} for s in (1, 3) for n in (1, 2, 4)]
    fig = plot_zero_scaling(rows)
    assert [ax.get_title() for ax in fig.axes] == ["ZeRO-1", "ZeRO-3"]
    assert len(fig.axes[0].lines) == 6  # measured and estimated, for params, grads and optimizer
    # the legend is the figure's, below the panels: it covers none of the lines (it sat on ZeRO-3's)
    assert all(ax.get_legend() is None for ax in fig.axes) and len(fig.legends) == 1
    assert len(fig.legends[0].get_texts()) == 6
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the constrained layout places the legend at draw time
    renderer = canvas.get_renderer()
    legend_box = fig.legends[0].get_window_extent(renderer)
    assert all(not legend_box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    assert legend_box.y1 <= min(ax.get_window_extent(renderer).y0 for ax in fig.axes)


def test_in_a_notebook_a_figure_is_displayed_where_it_is_made_and_not_returned(monkeypatch):
    import IPython.display

    from helpers import plots

    shown = []
    monkeypatch.setattr(plots, "_in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", shown.append)
    assert plots.plot_losses([3.0, 2.0]) is None  # a cell ending with it shows it once, not twice
    assert len(shown) == 1 and type(shown[0]).__name__ == "Figure"
    assert plots.plot_losses([3.0, 2.0], show=False) is not None and len(shown) == 1


def test_a_plan_is_drawn_as_stacked_bars_of_its_table_rows_against_this_runtimes_budgets():
    from conftest import fake_runtime
    from helpers.planner import PlanHost, plan
    from helpers.plots import GB, GiB, plot_plan

    t4 = fake_runtime()
    p = plan("gpt2-xl", 3, offload_optimizer="nvme", offload_param="nvme", runtime=t4,
             host=PlanHost(ram_in_use=int(1e9)))
    fig = plot_plan(p, show=False)
    gpu, ram, disk = fig.axes
    for ax, rows, unit, budget in ((gpu, p.report.gpu_rows, GiB, 14.34), (ram, p.report.ram_rows, GB, 12.13),
                                   (disk, p.report.disk_rows, GB, None)):
        widths = [bar.get_width() for bar in ax.patches]
        assert len(widths) == len(rows) and abs(sum(widths) - sum(rows.values()) / unit) < 1e-9  # one bar: the total
        budget_line = ax.lines[0].get_xdata()[0]
        assert budget is None or round(budget_line, 2) == budget  # this runtime's budget, in the column's unit
    assert [ax.get_xlabel() for ax in fig.axes] == ["GiB", "GB", "GB"]
    assert len(ram.lines) == 2  # RAM: the budget and where the share kept free for the estimate's error begins
    assert len(gpu.lines) == 2 and round(gpu.lines[1].get_xdata()[0], 2) == 13.62  # GPU: where a plan is tight
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "model copy" in legend and "already in use" in legend and legend[0] == "params"


def test_a_cpu_runtime_is_drawn_without_a_gpu_panel_and_several_plans_side_by_side():
    from conftest import fake_runtime
    from helpers.planner import PlanHost, plan
    from helpers.plots import plot_plans

    cpu = fake_runtime(device="cpu", gpu_name=None, compute_capability=None, gpu_total_bytes=0, vram_budget_bytes=0,
                       ram_total_bytes=int(24e9), ram_budget_bytes=int(24e9), gpu_count=0, precision="fp32")
    plans = [plan("gpt2", s, offload_optimizer=o, runtime=cpu,
                  host=PlanHost(ram_in_use=int(1e9))) for s, o in ((2, "none"),
                                                                                                  (2, "cpu"))]
    plans.append(plan("gpt2", 2, offload_param="cpu", runtime=cpu))  # refused: left out
    fig = plot_plans(plans, title="this runtime", show=False)
    assert len(fig.axes) == 1 and fig.axes[0].get_xlabel() == "CPU RAM (GB)"  # no GPU here, nothing on disk
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["ZeRO-2", "ZeRO-2, opt.->cpu"]  # first on top


def test_the_planner_s_picture_keeps_its_size_and_readable_labels_in_a_narrow_column():
    """At 900 px with JupyterLab's file browser open the picture was narrowed and its labels came out at ~5 px: it is
    now shown at its own pixel size (a sideways scroll where the column is narrower), and no label is under 8 pt
    (11 px at the 100 dpi it is drawn at)."""
    import re

    from conftest import fake_runtime
    from helpers.planner import PlanHost, plan
    from helpers.plots import figure_html, plot_plan

    p = plan("gpt2-xl", 3, offload_optimizer="nvme", offload_param="nvme", runtime=fake_runtime(),
             host=PlanHost(ram_in_use=0))
    fig = plot_plan(p, show=False)
    fig.canvas.draw() if hasattr(fig.canvas, "draw") else None
    sizes = [t.get_fontsize() for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and getattr(a, "get_text",
                                                                                                  lambda: "")())]
    assert sizes and min(sizes) >= 8
    page = figure_html(fig, css_class="x", scroll=True)
    width, height = (round(v * 100) for v in fig.get_size_inches())
    assert f'style="width:{width}px;height:{height}px;max-width:none"' in page and "overflow-x:auto" in page
    assert re.search(r'style="max-width:100%;height:auto"', figure_html(fig))  # other figures: as before


@pytest.mark.parametrize("offload", [dict(offload_optimizer="nvme", offload_param="nvme"), {}])
def test_the_planner_s_picture_fits_the_column_beside_an_open_file_browser_whole(offload):
    """Issue 41 item 9: at 900 px with the file browser open the output column is 449 px and the 760 px picture
    showed its left part (the title cut to '...fp32: CPU or', the totals and the legend hidden until scrolled). Now
    it is at most 449 px wide at its own pixel size, and everything drawn - the wrapped title, each panel's labels
    and total, the legend below the panels - lies inside it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from conftest import fake_runtime
    from helpers.planner import PlanHost, plan
    from helpers.plots import plot_plan

    runtime = fake_runtime(gpu_name="NVIDIA H100 80GB HBM3", t4_budget=True, emulation="cgroup")
    p = plan("gpt2-xl", 3, runtime=runtime, host=PlanHost(ram_in_use=int(1e9)), **offload)
    fig = plot_plan(p, show=False)
    width, height = (v * 100 for v in fig.get_size_inches())
    assert width <= 449
    FigureCanvasAgg(fig)
    fig.set_dpi(100)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    texts = fig.texts + [t for ax in fig.axes for t in ax.texts]  # the title; each panel's budget and total
    assert any(runtime.label.split()[0] in t.get_text() for t in fig.texts)  # the title, the runtime's label in it
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    boxes += [(f"panel {ax.get_xlabel()} with its tick labels", ax.get_tightbbox(renderer)) for ax in fig.axes]
    boxes.append(("legend", fig.legends[0].get_window_extent(renderer)))
    for what, box in boxes:
        assert box.x0 >= -0.5 and box.x1 <= width + 0.5 and box.y0 >= -0.5 and box.y1 <= height + 0.5, (what, box)
    legend = fig.legends[0].get_window_extent(renderer)
    assert legend.y1 <= min(ax.get_tightbbox(renderer).y0 for ax in fig.axes)  # below the panels


def test_the_longest_sequence_plot_marks_the_longest_length_tried():
    """Notebook 06's ladder: bars that stop at the last of TRY_LENGTHS stopped because nothing longer was tried; the
    plot draws that length as a line (a learner read four equal bars at 65,536 as a measured limit)."""
    from helpers.plots import plot_longest_sequence

    rows = [{"rung": "plain", "longest": 4096, "predicted": 13568, "speed": {4096: 9000.0}},
            {"rung": "checkpointing", "longest": 65536, "predicted": 84224, "speed": {4096: 5000.0, 65536: 2000.0}}]
    ax = plot_longest_sequence(rows, longest_tried=65536).axes[0]
    assert [ln.get_ydata()[0] for ln in ax.lines] == [65536]
    assert any("longest tried (65,536)" in t.get_text() for t in ax.get_legend().get_texts())
    assert ax.get_ylim()[1] >= 84224 * 8  # the legend's room above the tallest bar
    assert not plot_longest_sequence(rows).axes[0].lines  # the committed search (no fixed list): no line
