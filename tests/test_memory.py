import dataclasses
import json

import pytest
import torch

from helpers.config import ConfigSettings, build_ds_config
from helpers.memory import (RUNTIME_GROWTH_BYTES, EstimateSettings, count_params, deepspeed_estimate,
                            estimate_activations, estimate_for_config, estimate_model_states)

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
    assert e.cpu["grads"] == 2 * PSI + 4 * PSI
    # fp16 (a GPU runtime): DeepSpeed's overflow check over the host gradient buffer (|x| copy + mask, 3 B/param)
    # at each step, and what the runtime grows by (reports/host_memory.md)
    assert e.cpu["step on host"] == 3 * PSI and e.cpu["runtime"] == RUNTIME_GROWTH_BYTES and "staging" not in e.cpu
    assert e.cpu_total == 2**21 + 6 * PSI + 12 * PSI + 3 * PSI + RUNTIME_GROWTH_BYTES
    # helpers.chunk_zero3_overflow_check: min/max per slice, no temporary; bf16/fp32 without a GPU (CPU runtimes):
    # the zero.Init heap allowance
    chunked = estimate_model_states(PSI, 3, precision="fp16", offload_optimizer="cpu", offload_param="cpu",
                                    largest_layer_params=50_000, zero_init=True,
                                    settings=EstimateSettings(chunked_overflow_check=True))
    assert chunked.cpu["step on host"] == 0
    bf16 = estimate_model_states(PSI, 3, precision="bf16", offload_optimizer="cpu", offload_param="cpu",
                                 largest_layer_params=50_000, zero_init=True, settings=EstimateSettings(on_gpu=False))
    assert bf16.cpu["staging"] == 3.5 * PSI and "step on host" not in bf16.cpu and "runtime" not in bf16.cpu


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_bf16_and_fp32_on_a_gpu_count_fp16s_host_bytes_less_the_overflow_check(precision, device):
    """Issue 41 item 6: on a GPU, bf16/fp32 ZeRO-3 offload has no CPU staging (zero.Init builds the partitions in GPU
    memory) and no overflow check (DeepSpeed checks in fp16 only): fp16's account with the chunked check, less the
    16-bit buffers fp32 does not have."""
    kw = dict(offload_optimizer=device, offload_param=device, largest_layer_params=50_000, zero_init=True)
    buffers = dict(nvme_buffer_count=4, nvme_buffer_size=600_000, sub_group_size=100_000)
    gpu = estimate_model_states(PSI, 3, precision=precision, settings=EstimateSettings(on_gpu=True, **buffers), **kw)
    assert "staging" not in gpu.cpu and gpu.cpu["runtime"] == RUNTIME_GROWTH_BYTES
    assert gpu.cpu["step on host"] == (8 * 100_000 if device == "nvme" else 0)
    if precision == "bf16":
        fp16 = estimate_model_states(PSI, 3, precision="fp16",
                                     settings=EstimateSettings(chunked_overflow_check=True, **buffers), **kw)
        assert gpu.cpu == fp16.cpu and gpu.nvme == fp16.nvme
        assert estimate_model_states(PSI, 3, precision="fp16", settings=EstimateSettings(**buffers),
                                     **kw).cpu_total > gpu.cpu_total  # the check
    cpu = estimate_model_states(PSI, 3, precision=precision, settings=EstimateSettings(on_gpu=False, **buffers), **kw)
    assert "runtime" not in cpu.cpu and cpu.cpu["staging"] == 3.5 * PSI
    # None: fp16 is a GPU runtime; bf16/fp32 one when this process sees a CUDA GPU (CI has none)
    import torch

    assert estimate_model_states(PSI, 3, precision=precision, settings=EstimateSettings(**buffers), **kw).cpu == (
        gpu if torch.cuda.is_available() else cpu).cpu


def test_pinned_buffers_round_up_to_a_power_of_two():
    from helpers.memory import pinned_bytes

    assert pinned_bytes(1_548_000_000) == 2**31 and pinned_bytes(2**20) == 2**20 and pinned_bytes(0) == 0


def test_nvme_offload_puts_states_on_disk_and_buffers_in_ram():
    buffers = EstimateSettings(nvme_buffer_count=4, nvme_buffer_size=600_000, sub_group_size=100_000)
    e = estimate_model_states(PSI, 3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                              settings=buffers)
    assert e.nvme == {"optimizer": 12 * PSI, "grads": 4 * PSI, "params": 2 * PSI}
    # param swap buffers (fp16) + 4 optimizer swap buffers of one fp32 sub-group
    assert e.cpu["buffers"] == 4 * 600_000 * 2 + 4 * 100_000 * 4
    # gradients: the 16-bit partition; the fp32 gradients of one sub-group exist in RAM only while the optimizer
    # states are initialised in fp16 (counted in 'step on host'), and always on a CPU runtime (bf16/fp32)
    assert e.cpu["grads"] == 2 * PSI
    bf16 = estimate_model_states(PSI, 3, precision="bf16", offload_optimizer="nvme", offload_param="nvme",
                                 settings=dataclasses.replace(buffers, on_gpu=False))
    assert bf16.cpu["grads"] == 2 * PSI + 4 * 100_000
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme", nvme_path="/x",
                          settings=ConfigSettings(check_paths=False, nvme_buffer_count=4, nvme_buffer_size=600_000,
                                                  sub_group_size=100_000))
    assert estimate_for_config(cfg, PSI, zero_init=True).cpu == e.cpu | {"model copy": 0}


def test_param_offload_below_stage_3_is_refused():
    with pytest.raises(ValueError, match="stage 3"):
        estimate_model_states(PSI, 2, offload_param="cpu")


def test_stage_1_and_2_count_deepspeeds_gradient_bucket():
    e = estimate_model_states(PSI, 2, precision="fp16")  # DeepSpeed's default bucket: 5e8 elements
    assert e.gpu["buffers"] == 500_000_000 * 2 and e.gpu_total == 16 * PSI + 10**9
    assert estimate_model_states(PSI, 1, precision="fp32", reduce_bucket_elements=10,
                                 settings=EstimateSettings(overlap_comm=True)).gpu["buffers"] == 80
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


@pytest.mark.slow
def test_measure_peak_sees_ram_and_nvme_bytes(tmp_path):
    """In a fresh process, the block held for several sampling intervals: in CI's shared pytest process a 64 MiB
    tensor once landed on pages earlier tests had left resident, and RSS rose 1.5 MB while a sample saw it alive.
    What the measurement sees must not depend on what ran before it in the process."""
    from conftest import last_line_of_fresh_process

    code = f"""
import json, os, time, torch
from pathlib import Path
from helpers.memory import measure_peak
folder = Path({str(tmp_path)!r})
with measure_peak(nvme_path=folder, interval_s=0.01, nvme_interval_s=0.0) as m:
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB
    block += 1
    (folder / "swap.bin").write_bytes(os.urandom(3 * 2**20))
    time.sleep(0.1)  # ten sampling intervals: a sampled peak cannot miss it
    del block
print(json.dumps({{"rss": m.peak_rss - m.baseline_rss, "nvme": m.peak_nvme_bytes, "samples": len(m.samples),
                  "seconds": m.seconds, "summary": m.summary(), "cuda": torch.cuda.is_available()}}))
"""
    r = json.loads(last_line_of_fresh_process(code))
    assert r["rss"] >= 48 * 2**20, r
    assert r["nvme"] >= 3 * 2**20
    assert r["samples"] >= 2 and r["seconds"] > 0
    assert "peak RSS" in r["summary"] and "NVMe" in r["summary"]
    if not r["cuda"]:
        assert "GPU" not in r["summary"]  # a CPU run reads no 0.000 GiB of GPU memory


def test_nvme_optimizer_with_params_on_the_gpu():
    sub = 100_000
    e = estimate_model_states(PSI, 3, precision="fp16", offload_optimizer="nvme", zero_init=True,
                              settings=EstimateSettings(sub_group_size=sub))
    assert e.gpu == {"params": 2 * PSI}
    # the step's largest moment in RAM: the overflow check (3 B/param), larger here than the first step's Adam moments
    # of one sub-group (8 B x sub)
    # of one sub-group (8 B x sub); the sub-group's fp32 gradient buffer (4 B x sub) lives only while the optimizer
    # states are initialised
    assert e.cpu == {"grads": 2 * PSI, "buffers": 4 * sub * 4, "step on host": max(3 * PSI, 8 * sub),
                     "runtime": RUNTIME_GROWTH_BYTES, "model copy": 0}
    assert e.nvme == {"optimizer": 12 * PSI, "grads": 4 * PSI}


def test_model_states_per_gpu_shrinks_as_each_stage_promises():
    from helpers.memory import model_states_per_gpu

    t = model_states_per_gpu(PSI, "fp16")
    assert t[0] == {1: 16 * PSI, 2: 16 * PSI, 4: 16 * PSI, 8: 16 * PSI}
    assert t[3][8] == 16 * PSI // 8 and t[2][4] == 2 * PSI + 14 * PSI // 4 and t[1][2] == 4 * PSI + 12 * PSI // 2


def test_the_breakdown_table_uses_the_course_units_and_its_rows_add_up():
    from helpers.memory import estimate_model_states, round_to_total

    assert round_to_total([1.004, 1.004], 2) == [1.01, 1.0] and round_to_total([1 / 3] * 3, 2) == [0.34, 0.33, 0.33]
    table = estimate_model_states(1_557_611_200, 3, offload_optimizer="nvme", offload_param="nvme",
                                  largest_layer_params=80_000_000).table()
    lines = table.splitlines()
    assert "GPU(s)" not in lines[0] and lines[1].split() == ["component", "GPU", "GiB", "RAM", "GB", "NVMe", "GB"]
    rows = [[float(x) for x in line.split()[-3:]] for line in lines[2:-1]]
    total = [float(x) for x in lines[-1].split()[-3:]]
    assert [round(sum(col), 3) for col in zip(*rows)] == total


@pytest.mark.parametrize("precision, seq_len, checkpointing", [("fp32", 64, True), ("fp32", 512, False),
                                                               ("fp16", 512, True), ("fp16", 64, True)])
@pytest.mark.parametrize("name", ["plain", "zero0", "zero2", "zero3"])
def test_the_run_estimates_rows_add_up_to_its_predicted_peak(name, precision, seq_len, checkpointing):
    """Issue 52 item 2: the printed estimate (notebook 01, section 2) is rows that sum to the peak: the model states,
    then the larger of activations and the optimizer step's temporaries, so a peak set by the step (fp32, short
    sequences: 0.93 GiB of temporaries for GPT-2) is no longer in no row."""
    from helpers.config import course_config
    from helpers.memory import GiB, estimate_run
    from helpers.models import model_shape

    shape = model_shape("gpt2")
    cfg = None if name == "plain" else course_config(name, None, precision=precision, micro_batch_size=4)
    est = estimate_run(cfg, shape, seq_len=seq_len, precision=precision, checkpointing=checkpointing,
                       micro_batch=4 if cfg is None else None)
    rows = est.rows()
    assert sum(b for _, b in rows) == est.peak_bytes
    assert rows[-1] == (("step temporaries", est.step_transient_bytes) if est.step_transient_bytes > est.activation_bytes
                        else ("activations", est.activation_bytes))
    printed = est.table().splitlines()
    body = printed[2:-1]
    assert [line.split()[0] for line in body] == [n.split()[0] for n, _ in rows]
    peak = float(printed[-1].split()[1])
    assert peak == round(est.peak_bytes / GiB, 3)
    assert sum(float(line[18:27]) for line in body) == pytest.approx(peak, abs=1e-9)
    per_param = 16 if precision == "fp16" or name in ("plain", "zero0") else 20  # fp32 ZeRO-1..3: fp32 master copy
    assert f"model states: {per_param} bytes per parameter" in est.table()
