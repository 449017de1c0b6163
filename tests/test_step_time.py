"""The step-time model (helpers.step_time) and the runtime limits it reads (helpers.limits)."""
import json
import math

import pytest

import helpers
from helpers import limits as L
from helpers.step_time import estimate_step_time, training_flops_per_token

XL = helpers.model_shape(helpers.gpt2_config("gpt2-xl"))
GPU_LIMITS = L.RuntimeLimits(runtime="test GPU", cpus=2, has_gpu=True, disk_path="/nvme", disk_read_gbps=1.0, disk_write_gbps=1.0,
                             h2d_pinned_gbps=20.0, h2d_pageable_gbps=10.0, d2h_pinned_gbps=20.0,
                             d2h_pageable_gbps=10.0, cpu_adam_params_per_s=1e9, matmul_tflops=100.0,
                             matmul_dtype="fp16")


def _nvme_config(**overrides):
    runtime = helpers.colab_t4_profile()
    return helpers.config.offload_config("zero3_nvme_optimizer_gpu_params", runtime, nvme_path="/nvme", check_paths=False,
                                  **overrides)


def test_nvme_step_moves_what_deepspeed_moves():
    n = XL.n_params
    est = estimate_step_time(_nvme_config(micro_batch_size=2), XL, GPU_LIMITS, seq_len=512)
    c = est.components
    # 1 GB/s disk: seconds = GB moved; fp32 master weights + 2 Adam moments + fp32 gradients read, 12 bytes written
    assert c["optimizer states + gradients from disk"] == pytest.approx(16 * n / 1e9)
    assert c["optimizer states to disk"] == pytest.approx(12 * n / 1e9)
    assert c["fp32 gradients to disk"] == pytest.approx(4 * n / 1e9)
    assert c["CPU Adam"] == pytest.approx(n / 1e9)
    assert c["gradients via host (PCIe)"] == pytest.approx(2 * 2 * n / 10e9)  # pageable: pin_memory is off
    assert est.resources["CPU Adam"] == "CPU" and est.bottleneck == "disk"
    assert est.seconds == pytest.approx(sum(c.values()))
    assert est.roofline_seconds == pytest.approx(32 * n / 1e9)  # the disk alone: 16 read + 16 written
    assert est.tokens_per_s == pytest.approx(1024 / est.seconds) and est.roofline_tokens_per_s > est.tokens_per_s


def test_accumulation_and_bigger_micro_batches_amortise_the_optimizer_io():
    base = estimate_step_time(_nvme_config(micro_batch_size=2), XL, GPU_LIMITS, seq_len=512)
    acc = estimate_step_time(_nvme_config(micro_batch_size=8, grad_accum_steps=16), XL, GPU_LIMITS, seq_len=512)
    assert acc.tokens_per_step == 64 * base.tokens_per_step
    assert acc.components["optimizer states to disk"] == base.components["optimizer states to disk"]
    assert acc.components["GPU compute"] == pytest.approx(64 * base.components["GPU compute"])
    assert acc.tokens_per_step == 64 * 1024 and acc.bottleneck == "disk"
    assert acc.tokens_per_s > 10 * base.tokens_per_s
    pinned = estimate_step_time(_nvme_config(micro_batch_size=8, grad_accum_steps=16, pin_memory=True), XL,
                                GPU_LIMITS, seq_len=512)
    assert pinned.components["gradients via host (PCIe)"] == pytest.approx(
        acc.components["gradients via host (PCIe)"] / 2)


def test_flops_follow_the_published_6n_rule():
    per_token = training_flops_per_token(XL, 512, checkpointing=False)
    assert 6 * XL.n_params < per_token < 6.5 * XL.n_params
    assert training_flops_per_token(XL, 512) > per_token  # recomputation


def test_unmeasured_limits_are_left_out_and_named():
    no_disk = L.RuntimeLimits(runtime="gpu, no disk measured", cpus=2, h2d_pageable_gbps=10.0, d2h_pageable_gbps=10.0,
                              cpu_adam_params_per_s=5e7, matmul_tflops=50.0)
    est = estimate_step_time(_nvme_config(), XL, no_disk, seq_len=512)
    assert "CPU Adam" in est.components and "optimizer states to disk" not in est.components
    assert any("disk" in m for m in est.missing) and "not measured here" in est.table()


def test_a_cpu_runtime_computes_on_the_cpu_and_moves_nothing_over_pcie():
    cpu = L.RuntimeLimits(runtime="cpu", cpus=2, has_gpu=False, disk_read_gbps=1.0, disk_write_gbps=1.0,
                          cpu_adam_params_per_s=5e7, matmul_tflops=0.5)
    est = estimate_step_time(_nvme_config(), XL, cpu, seq_len=512)
    assert "CPU compute" in est.components and est.resources["CPU compute"] == "CPU"
    assert not [c for c, r in est.resources.items() if r == "PCIe"] and not est.missing
    plain = estimate_step_time(None, XL, cpu, seq_len=512, micro_batch=2)
    assert list(plain.components) == ["CPU compute"] and not plain.missing


def test_table_and_dict_agree():
    est = estimate_step_time(_nvme_config(micro_batch_size=8, grad_accum_steps=4), XL, GPU_LIMITS, seq_len=512)
    d = est.as_dict()
    assert d["predicted_tokens_per_s"] == round(est.tokens_per_s, 1) and d["bottleneck"] == "disk"
    assert math.isclose(sum(d["components_s"].values()), d["predicted_step_s"], rel_tol=1e-3)
    text = est.table({"CPU Adam": 2.0})
    assert "roofline (disk alone)" in text and "measured s" in text


def test_limits_are_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "CACHE_DIR", tmp_path)
    first = L.measure_limits(None, cpu_adam=False)
    assert first.matmul_tflops and first.matmul_tflops > 0 and first.disk_read_gbps is None
    assert "no GPU" in " ".join(first.notes)
    files = list(tmp_path.glob("limits-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["matmul_tflops"] == first.matmul_tflops
    assert L.measure_limits(None, cpu_adam=False).seconds == first.seconds  # read back, not measured again
    assert "matmul" in first.table()


def test_disk_is_measured_through_deepspeeds_aio(tmp_path):
    read, write = L.measure_disk(tmp_path, size_bytes=64 << 20, buffer_bytes=16 << 20)
    assert read > 0.01 and write > 0.01
    assert not list(tmp_path.iterdir())  # the probe file is removed


def test_the_accumulation_picture_draws_every_component_and_the_measured_points():
    from matplotlib.figure import Figure

    from helpers.plots import plot_step_time

    curve = {g: estimate_step_time(_nvme_config(micro_batch_size=2, grad_accum_steps=g), XL, GPU_LIMITS, seq_len=512)
             for g in (1, 4, 16)}
    fig = plot_step_time(curve, measured={1: 30.0}, show=False)
    assert isinstance(fig, Figure)
    left, right = fig.axes
    assert len(left.patches) == 3 * len(curve[1].components)  # a stacked bar per component and accumulation count
    assert [line.get_label() for line in right.lines][:2] == ["predicted (components one after another)",
                                                             "roofline (the busiest resource alone)"]
    assert list(right.lines[0].get_ydata()) == [curve[g].tokens_per_s for g in (1, 4, 16)]
    assert len(right.collections) == 1  # the measured point


def test_the_chunked_overflow_check_is_timed_at_its_own_measured_rate():
    """Issue 24: the course's overflow check (min/max per slice) is a lever; the model times it at its own rate, and
    names it as missing where only DeepSpeed's was measured."""
    import dataclasses

    cfg = _nvme_config(micro_batch_size=16, grad_accum_steps=8)
    lim = dataclasses.replace(GPU_LIMITS, overflow_check_per_s=0.25e9, overflow_check_chunked_per_s=10e9)
    own = estimate_step_time(cfg, XL, lim, seq_len=512)
    chunked = estimate_step_time(cfg, XL, lim, seq_len=512, chunked_overflow_check=True)
    assert own.components["fp16 overflow check (host)"] == pytest.approx(XL.n_params / 0.25e9)
    assert chunked.components["fp16 overflow check (host)"] == pytest.approx(XL.n_params / 10e9)
    assert chunked.seconds == pytest.approx(own.seconds - XL.n_params / 0.25e9 + XL.n_params / 10e9)
    unmeasured = estimate_step_time(cfg, XL, dataclasses.replace(lim, overflow_check_chunked_per_s=None), seq_len=512,
                                    chunked_overflow_check=True)
    assert "fp16 overflow check (host)" not in unmeasured.components
    assert "chunked overflow check rate" in unmeasured.missing


def test_a_step_moved_to_a_t4_scales_only_the_gpu_compute_by_the_datasheet_peaks():
    from helpers.step_time import DATASHEET_FP16_TFLOPS, project_to_gpu

    proj = project_to_gpu({"GPU compute": 4.0, "optimizer states to disk": 20.0}, 50.0, 65_536)
    ratio = DATASHEET_FP16_TFLOPS["H200"] / DATASHEET_FP16_TFLOPS["T4"]
    assert proj.target_gpu_s == pytest.approx(4.0 * ratio) and proj.step_s == pytest.approx(46.0 + 4.0 * ratio)
    assert proj.tokens_per_s == pytest.approx(65_536 / proj.step_s) and "not a measurement on a T4" in proj.text()
    same = project_to_gpu({"GPU compute": 4.0}, 50.0, 65_536, measured_on="H100", target="H200")
    assert same.step_s == pytest.approx(50.0)
    with pytest.raises(ValueError, match="no datasheet fp16 peak for 'V100'"):
        project_to_gpu({"GPU compute": 4.0}, 50.0, 65_536, target="V100")
    with pytest.raises(ValueError, match="positive seconds"):
        project_to_gpu({"GPU compute": 4.0}, 0.0, 65_536)


def test_a_tilde_nvme_folder_is_measured_in_the_home_folder(tmp_path, monkeypatch, cpu):
    """Issue 41 item 2: notebook 02 passes NVME_PATH ('~/nvme' if the learner writes so) to measure_limits, whose
    probe made a folder named '~'."""
    monkeypatch.setattr(L, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    measured = []
    monkeypatch.setattr(L, "_measure_disk_in_child", lambda path, aio: measured.append(path) or (1.0, 1.0))
    monkeypatch.setattr(L, "measure_matmul", lambda dtype: 1.0)
    limits = L.measure_limits("~/nvme", runtime=cpu, cpu_adam=False)
    assert measured == [str(tmp_path / "nvme")] and limits.disk_path == str(tmp_path / "nvme")
    assert not (tmp_path / "~").exists()
