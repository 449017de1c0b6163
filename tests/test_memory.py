import dataclasses
import os

import pytest
import torch

from conftest import fake_runtime
from helpers.config import build_ds_config
from helpers.memory import (BudgetError, count_params, deepspeed_estimate, estimate_activations,
                            estimate_for_config, estimate_model_states, measure_peak, preflight)

PSI = 1_000_000


def test_mixed_precision_is_2_2_12_bytes_per_parameter():
    e = estimate_model_states(PSI, 0, precision="fp16")
    assert e.gpu == {"params": 2 * PSI, "grads": 2 * PSI, "optimizer": 12 * PSI}
    assert e.gpu_total == 16 * PSI and e.cpu["model copy"] == 4 * PSI


@pytest.mark.parametrize("stage, expected_gpu", [
    (0, 16 * PSI), (1, 2 * PSI + 2 * PSI + 12 * PSI // 4), (2, 2 * PSI + (2 + 12) * PSI // 4), (3, 16 * PSI // 4)])
def test_each_stage_partitions_one_more_component_over_4_gpus(stage, expected_gpu):
    assert estimate_model_states(PSI, stage, precision="bf16", n_gpus=4,
                                 reduce_bucket_elements=0).gpu_total == expected_gpu


def test_zero_paper_numbers_for_7_5b_on_64_gpus():
    # ZeRO paper, figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per GPU
    psi = 7_500_000_000
    got = [estimate_model_states(psi, s, precision="fp16", n_gpus=64, reduce_bucket_elements=0).gpu_total / 1e9
           for s in (0, 1, 2, 3)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_fp32_counts_deepspeeds_master_copy_and_plain_torch_does_not():
    assert estimate_model_states(PSI, 0, precision="fp32").gpu_total == 16 * PSI
    assert estimate_model_states(PSI, 2, precision="fp32", reduce_bucket_elements=0).gpu_total == 20 * PSI
    plain = estimate_model_states(PSI, None, precision="fp16")
    assert plain.gpu_total == 16 * PSI and plain.label.startswith("plain PyTorch AMP")


def test_optimizer_offload_moves_12_plus_4_bytes_to_cpu():
    e = estimate_model_states(PSI, 2, precision="fp16", offload_optimizer="cpu", reduce_bucket_elements=10_000)
    assert e.gpu == {"params": 2 * PSI, "buffers": 2 * 10_000}
    assert e.cpu["optimizer"] == 12 * PSI and e.cpu["grads"] == 4 * PSI


def test_param_offload_keeps_only_live_layers_on_gpu():
    e = estimate_model_states(PSI, 3, precision="fp16", offload_optimizer="cpu", offload_param="cpu",
                              largest_layer_params=50_000, zero_init=True)
    # the 16-bit params sit in one pinned buffer, which torch's host allocator rounds up to a power of two
    assert e.gpu["params"] == 2 * 2 * 50_000 and e.cpu["params"] == 2**21 and e.cpu["model copy"] == 0
    # stage 3 keeps a 16-bit gradient partition and the fp32 gradients the CPU optimizer steps on
    assert e.cpu["grads"] == 2 * PSI + 4 * PSI and e.cpu["staging"] == 3.5 * PSI
    assert e.cpu_total == 2**21 + 6 * PSI + 12 * PSI + 3.5 * PSI


def test_pinned_buffers_round_up_to_a_power_of_two():
    from helpers.memory import pinned_bytes

    assert pinned_bytes(1_548_000_000) == 2**31 and pinned_bytes(2**20) == 2**20 and pinned_bytes(0) == 0


def test_nvme_offload_puts_states_on_disk_and_buffers_in_ram():
    e = estimate_model_states(PSI, 3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                              nvme_buffer_count=4, nvme_buffer_size=600_000, sub_group_size=100_000)
    assert e.nvme == {"optimizer": 12 * PSI, "grads": 4 * PSI, "params": 2 * PSI}
    # param swap buffers (fp16) + 4 optimizer swap buffers of one fp32 sub-group
    assert e.cpu["buffers"] == 4 * 600_000 * 2 + 4 * 100_000 * 4
    # gradients: the 16-bit partition, and fp32 for one sub-group at a time
    assert e.cpu["grads"] == 2 * PSI + 4 * 100_000
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme", nvme_path="/x",
                          check_paths=False, nvme_buffer_count=4, nvme_buffer_size=600_000, sub_group_size=100_000)
    assert estimate_for_config(cfg, PSI, zero_init=True).cpu == e.cpu | {"model copy": 0}


def test_param_offload_below_stage_3_is_refused():
    with pytest.raises(ValueError, match="stage 3"):
        estimate_model_states(PSI, 2, offload_param="cpu")


def test_stage_1_and_2_count_deepspeeds_gradient_bucket():
    e = estimate_model_states(PSI, 2, precision="fp16")  # DeepSpeed's default bucket: 5e8 elements
    assert e.gpu["buffers"] == 500_000_000 * 2 and e.gpu_total == 16 * PSI + 10**9
    assert estimate_model_states(PSI, 1, precision="fp32", reduce_bucket_elements=10,
                                 overlap_comm=True).gpu["buffers"] == 80
    assert "buffers" not in estimate_model_states(PSI, 0).gpu and "buffers" not in estimate_model_states(PSI, 3).gpu
    literal = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}
    assert estimate_for_config(literal, PSI).gpu["buffers"] == 10**9
    built = build_ds_config(2, precision="fp16")  # the builder asks for 5e7
    assert estimate_for_config(built, PSI).gpu["buffers"] == 10**8


def test_estimate_reads_a_deepspeed_config():
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="cpu", offload_param="cpu")
    e = estimate_for_config(cfg, PSI, largest_layer_params=1000)
    assert e.cpu["optimizer"] == 12 * PSI and e.gpu["params"] == 4000
    assert estimate_for_config(build_ds_config(1, precision="fp32"), PSI).gpu_total == 20 * PSI + 4 * 50_000_000


def test_deepspeed_estimators_are_called_with_their_formulas():
    # DeepSpeed's ZeRO-2 formula: GPU 2Ψ + 18Ψ/N; with offload GPU 2Ψ, CPU Ψ·max(4N,16)·1.5
    assert deepspeed_estimate(PSI, 2, n_gpus=2)["gpu"] == 2 * PSI + 9 * PSI
    assert deepspeed_estimate(PSI, 2, offload_optimizer="cpu") == {"gpu": 2 * PSI, "cpu": int(16 * PSI * 1.5)}
    # ZeRO-3 full offload: GPU 4 x largest layer, CPU 18Ψ·1.5
    assert deepspeed_estimate(PSI, 3, offload_optimizer="cpu", offload_param="cpu",
                              largest_layer_params=1000) == {"gpu": 4000, "cpu": int(18 * PSI * 1.5)}
    assert deepspeed_estimate(PSI, 1) is None


def test_activation_formula_by_hand():
    # b=2, s=8, h=16, L=3, V=100, fp16, fused attention: 3 * 34*s*b*h + b*s*V*(2+4+4)
    sbh = 8 * 2 * 16
    assert estimate_activations(2, 8, 16, 3, 100, precision="fp16") == 3 * 34 * sbh + 2 * 8 * 100 * 10
    # unfused attention adds 5*a*s*s*b per layer
    assert estimate_activations(2, 8, 16, 3, 100, n_heads=4, fused_attention=False) == \
        3 * (34 * sbh + 5 * 4 * 8 * 8 * 2) + 2 * 8 * 100 * 10
    # checkpointing keeps 2*s*b*h per layer plus one full layer
    assert estimate_activations(2, 8, 16, 3, 100, checkpointing=True) == 3 * 2 * sbh + 34 * sbh + 1600 * 10
    assert estimate_activations(2, 8, 16, 3, 100, precision="fp32") == 2 * 3 * 34 * sbh + 1600 * 12


def test_count_params_counts_tied_weights_once_also_on_meta():
    def build():
        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        return torch.nn.Sequential(emb, torch.nn.Linear(4, 4), head)

    assert count_params(build()) == (40 + 20, 40)
    with torch.device("meta"):
        meta = build()
    assert count_params(meta) == (60, 40)


def test_measure_peak_sees_ram_and_nvme_bytes(tmp_path):
    with measure_peak(nvme_path=tmp_path, interval_s=0.01, nvme_interval_s=0.0) as m:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB
        block += 1
        (tmp_path / "swap.bin").write_bytes(os.urandom(3 * 2**20))
        del block
    assert m.peak_rss - m.baseline_rss >= 48 * 2**20
    assert m.peak_nvme_bytes >= 3 * 2**20
    assert len(m.samples) >= 2 and m.seconds > 0
    assert "peak RSS" in m.summary()


def test_preflight_refuses_gpt2_xl_zero2_on_a_t4_and_names_a_config_that_fits(t4):
    cfg = build_ds_config(2, runtime=t4)
    with pytest.raises(BudgetError) as err:  # the rung alone in a fresh runtime, nothing else counted
        preflight(cfg, 1_557_611_200, t4, largest_layer_params=80_000_000, ram_in_use=0)
    msg = str(err.value)
    assert "GPU: needs ~" in msg and "budget 15.00 GiB" in msg
    # CPU offload would need ~20 bytes/param of RAM (> 12.1 GB): the first course config that fits is ZeRO-Infinity
    # with the fp16 params kept on the GPU (3.1 GB of the T4's 15 GiB) and only the optimizer on NVMe
    assert "Fix: the course's 'zero3_nvme_optimizer_gpu_params' config" in msg
    assert "helpers.offload_config('zero3_nvme_optimizer_gpu_params', runtime, nvme_path=...)" in msg


def test_preflight_moves_params_off_the_gpu_when_they_do_not_fit_there(t4):
    cfg = build_ds_config(2, runtime=t4)
    act = 4 * 2**30
    # 2.7B on a T4: 5.3 GB of 16-bit gradients + 9.3 GB of staging do not fit 12.1 GB of RAM in any config;
    # GPT-2 XL does when nothing else is in RAM, GPT-2 large beside 1 GB of other processes
    with pytest.raises(BudgetError, match="none of the course's configs fits this model here; a smaller one does: "
                                          "gpt2-xl with 'zero3_nvme_optimizer_gpu_params'"):
        preflight(cfg, 2_650_000_000, t4, largest_layer_params=130_000_000, ram_in_use=0, activation_bytes=act)
    with pytest.raises(BudgetError, match="a smaller one does: gpt2-large with 'zero3_nvme_optimizer_gpu_params'"):
        preflight(cfg, 2_650_000_000, t4, largest_layer_params=130_000_000, ram_in_use=int(1e9),
                  activation_bytes=act)
    # a GPU of 8 GiB with 40 GB of RAM: 5.3 GB of fp16 params + 4 GiB of activations overflow the GPU, so the
    # parameters go to RAM (ZeRO-3, params on CPU, optimizer on NVMe)
    small_gpu = fake_runtime(gpu_total_bytes=8 * 2**30, vram_budget_bytes=8 * 2**30, ram_total_bytes=int(40e9),
                             ram_budget_bytes=int(40e9), is_colab=False)
    report = preflight(cfg, 2_650_000_000, small_gpu, largest_layer_params=130_000_000, ram_in_use=int(1e9),
                       activation_bytes=act, raise_on_failure=False)
    assert report.suggestion == {"stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu"}
    # the same RAM with a GPU of 24 GiB: the params stay on the GPU
    big_gpu = dataclasses.replace(small_gpu, gpu_total_bytes=24 * 2**30, vram_budget_bytes=24 * 2**30)
    report = preflight(cfg, 2_650_000_000, big_gpu, largest_layer_params=130_000_000, ram_in_use=int(1e9),
                       activation_bytes=act, raise_on_failure=False)
    assert report.suggestion == {"stage": 3, "offload_optimizer": "nvme"}


def test_nvme_optimizer_with_params_on_the_gpu():
    sub = 100_000
    e = estimate_model_states(PSI, 3, precision="fp16", offload_optimizer="nvme", sub_group_size=sub,
                              zero_init=True)
    assert e.gpu == {"params": 2 * PSI}
    assert e.cpu == {"grads": 2 * PSI + 4 * sub, "buffers": 4 * sub * 4, "staging": 3.5 * PSI, "model copy": 0}
    assert e.nvme == {"optimizer": 12 * PSI, "grads": 4 * PSI}


def test_preflight_catches_the_cpu_ram_wall(t4):
    cfg = build_ds_config(3, runtime=t4, offload_optimizer="cpu", offload_param="cpu")
    with pytest.raises(BudgetError, match=r"CPU RAM: needs ~\d+\.\d+ GB, budget 12.13 GB") as err:
        preflight(cfg, 1_557_611_200, t4, largest_layer_params=80_000_000, ram_in_use=int(1e9))
    assert "deepspeed.zero.Init" in str(err.value)


def test_preflight_catches_too_little_disk(tmp_path):
    small_disk = fake_runtime(disk_free_bytes=int(5e9), ram_budget_bytes=int(500e9))
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                          nvme_path="/nonexistent-nvme", check_paths=False)
    with pytest.raises(BudgetError, match=r"disk: needs ~\d+\.\d+ GB, 5.00 GB free"):
        preflight(cfg, 2_000_000_000, small_disk, largest_layer_params=10**8, ram_in_use=0)


def test_preflight_passes_a_config_that_fits(t4):
    report = preflight(build_ds_config(2, runtime=t4), 124_000_000, t4, ram_in_use=int(1e9))
    assert report.fits and "fits" in str(report)


def test_model_states_per_gpu_shrinks_as_each_stage_promises():
    from helpers.memory import model_states_per_gpu

    t = model_states_per_gpu(PSI, "fp16")
    assert t[0] == {1: 16 * PSI, 2: 16 * PSI, 4: 16 * PSI, 8: 16 * PSI}
    assert t[3][8] == 16 * PSI // 8 and t[2][4] == 2 * PSI + 14 * PSI // 4 and t[1][2] == 4 * PSI + 12 * PSI // 2


# ------------------------------------------------------------------ every refusal suggests what passes (issue 12)

def _suggested_config(report, runtime, largest, nvme_path="/nvme"):
    from helpers.config import offload_config

    if report.suggestion_kind == "zero2":
        return build_ds_config(2, runtime=runtime)
    return offload_config(report.suggestion_kind, runtime, largest_param=largest, nvme_path=nvme_path,
                          check_paths=False)


def _assert_fix_passes(report, runtime, n_params, largest, act, ram_in_use):
    assert not report.fits
    if report.suggestion_kind is not None:
        cfg = _suggested_config(report, runtime, largest)
        again = preflight(cfg, n_params, runtime, largest_layer_params=largest, activation_bytes=act,
                          zero_init=report.suggestion_zero_init, ram_in_use=ram_in_use)
        assert again.fits, (report.suggestion_kind, str(again))
    else:
        from helpers.config import offload_config
        from helpers.models import model_shape

        assert report.smaller_model, report.fix()
        shape = model_shape(report.smaller_model)
        cfg = offload_config(report.smaller_model_kind, runtime, largest_param=shape.largest_layer_params,
                             nvme_path="/nvme", check_paths=False) if report.smaller_model_kind != "zero2" else \
            build_ds_config(2, runtime=runtime)
        assert preflight(cfg, shape.n_params, runtime, largest_layer_params=shape.largest_layer_params,
                         activation_bytes=act, zero_init=True, ram_in_use=ram_in_use).fits


def test_zero2_on_gpt2_large_is_refused_for_its_optimizer_step_not_suggested(t4):
    """ZeRO-2 without offload on 774M: 16 bytes/param fit 15 GiB, but the optimizer step's fp32 temporaries do not.
    Pre-flight counted only model states + activations and suggested exactly this config (issue 12)."""
    from helpers.models import model_shape

    shape = model_shape("gpt2-large")
    act = estimate_activations(2, 512, shape.hidden, shape.n_layers, shape.vocab, n_heads=shape.n_heads,
                               precision="fp16", checkpointing=True)
    ram = int(3e9)  # a kernel plus a fresh child process
    report = preflight(build_ds_config(2, runtime=t4), shape.n_params, t4, largest_layer_params=shape.largest_layer_params,
                       activation_bytes=act, ram_in_use=ram, raise_on_failure=False)
    assert any(p.startswith("GPU") for p in report.problems)
    assert report.suggestion_kind not in (None, "zero2")
    _assert_fix_passes(report, t4, shape.n_params, shape.largest_layer_params, act, ram)


@pytest.mark.parametrize("kind", ["zero2_offload_cpu", "zero3_offload_cpu"])
def test_ram_refusals_of_cpu_offload_suggest_a_config_that_passes(t4, kind):
    """The issue's case: CPU offload of 774M refused for RAM printed 'Fix: build_ds_config(stage=2)'."""
    from helpers.config import offload_config
    from helpers.models import model_shape

    shape = model_shape("gpt2-large")
    act = estimate_activations(2, 512, shape.hidden, shape.n_layers, shape.vocab, n_heads=shape.n_heads,
                               precision="fp16", checkpointing=True)
    ram = int(3e9)
    cfg = offload_config(kind, t4, largest_param=shape.largest_layer_params)
    with pytest.raises(BudgetError) as err:
        preflight(cfg, shape.n_params, t4, largest_layer_params=shape.largest_layer_params, activation_bytes=act,
                  zero_init=True, ram_in_use=ram)
    assert "CPU RAM" in str(err.value) and "build_ds_config(stage=2)" not in str(err.value)
    report = preflight(cfg, shape.n_params, t4, largest_layer_params=shape.largest_layer_params, activation_bytes=act,
                       zero_init=True, ram_in_use=ram, raise_on_failure=False)
    assert report.suggestion_kind == "zero3_nvme_optimizer_gpu_params"
    _assert_fix_passes(report, t4, shape.n_params, shape.largest_layer_params, act, ram)


def test_disk_refusal_suggests_a_config_that_fits_the_disk():
    from helpers.config import offload_config
    from helpers.models import model_shape

    shape = model_shape("gpt2-medium")
    roomy = fake_runtime(disk_free_bytes=int(2e9), ram_total_bytes=int(64e9), ram_budget_bytes=int(64e9))
    cfg = offload_config("zero3_nvme_all", roomy, largest_param=shape.largest_layer_params, nvme_path="/nonexistent",
                         check_paths=False)
    report = preflight(cfg, shape.n_params, roomy, largest_layer_params=shape.largest_layer_params, zero_init=True,
                       ram_in_use=int(1e9), raise_on_failure=False)
    assert [p.split(":")[0] for p in report.problems] == ["disk"]
    assert "nvme" not in report.suggestion_kind  # the disk is the problem: the fix keeps off it
    _assert_fix_passes(report, roomy, shape.n_params, shape.largest_layer_params, 0, int(1e9))


def test_when_nothing_fits_a_smaller_model_is_named_and_fits(t4):
    report = preflight(build_ds_config(2, runtime=t4), 6_650_000_000, t4, largest_layer_params=205_000_000,
                       ram_in_use=int(3e9), activation_bytes=2**30, raise_on_failure=False)
    assert report.suggestion_kind is None and report.smaller_model in ("gpt2-xl", "gpt2-large")
    assert report.smaller_model in report.fix()
    _assert_fix_passes(report, t4, 6_650_000_000, 205_000_000, 2**30, int(3e9))


def test_when_not_even_a_small_model_fits_the_fix_says_so():
    tiny_ram = fake_runtime(ram_total_bytes=int(0.5e9), ram_budget_bytes=int(0.5e9))
    with pytest.raises(BudgetError, match="nor a smaller GPT-2"):
        preflight(build_ds_config(2, runtime=tiny_ram), 124_000_000, tiny_ram, ram_in_use=int(1e9))


@pytest.mark.parametrize("size", ["gpt2-medium", "gpt2-large", "gpt2-xl", "gpt2-2.7b"])
@pytest.mark.parametrize("ram_in_use", [int(1e9), int(4e9)])
def test_every_suggestion_passes_the_check_that_refused(t4, size, ram_in_use):
    from helpers.config import OFFLOAD_KINDS, offload_config
    from helpers.models import model_shape

    shape = model_shape(size)
    act = estimate_activations(2, 512, shape.hidden, shape.n_layers, shape.vocab, n_heads=shape.n_heads,
                               precision="fp16", checkpointing=True)
    configs = [build_ds_config(2, runtime=t4)] + [
        offload_config(k, t4, largest_param=shape.largest_layer_params, nvme_path="/nvme", check_paths=False)
        for k in OFFLOAD_KINDS]
    for cfg in configs:
        report = preflight(cfg, shape.n_params, t4, largest_layer_params=shape.largest_layer_params,
                           activation_bytes=act, zero_init=True, ram_in_use=ram_in_use, raise_on_failure=False)
        if not report.fits:
            _assert_fix_passes(report, t4, shape.n_params, shape.largest_layer_params, act, ram_in_use)


def test_ram_margin_keeps_part_of_the_budget_free(t4):
    from helpers.memory import RAM_ESTIMATE_MARGIN

    cfg = build_ds_config(3, runtime=t4, offload_optimizer="nvme", nvme_path="/nvme", check_paths=False)
    needed = preflight(cfg, 500_000_000, t4, zero_init=True, ram_in_use=0, raise_on_failure=False).ram_needed
    edge = int(t4.ram_budget_bytes * (1 - RAM_ESTIMATE_MARGIN)) - needed  # what may still be in use beside it
    assert preflight(cfg, 500_000_000, t4, zero_init=True, ram_in_use=edge - 10**6, raise_on_failure=False).fits
    late = preflight(cfg, 500_000_000, t4, zero_init=True, ram_in_use=edge + 10**7, raise_on_failure=False)
    assert not late.fits and "5% of it kept free" in late.problems[0]
