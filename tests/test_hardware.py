import re

import pytest

from conftest import fake_runtime
from helpers import hardware
from helpers.hardware import NoGPUError, choose_precision, detect_runtime, require_gpu, sized, t4_budget_requested


@pytest.mark.parametrize("cc, budget, expected", [
    (None, False, "fp32"), ((7, 5), False, "fp16"), ((8, 0), False, "bf16"), ((9, 0), False, "bf16"),
    ((9, 0), True, "fp16"), ((8, 6), True, "fp16"), ((6, 0), False, "fp16"),
])
def test_choose_precision(cc, budget, expected):
    assert choose_precision(cc, budget) == expected


def test_t4_budget_from_parameter_or_environment(monkeypatch):
    monkeypatch.delenv(hardware.T4_BUDGET_ENV, raising=False)
    assert t4_budget_requested() is False
    monkeypatch.setenv(hardware.T4_BUDGET_ENV, "1")
    assert t4_budget_requested() is True
    assert t4_budget_requested(False) is False  # the parameter wins
    monkeypatch.setenv(hardware.T4_BUDGET_ENV, "0")
    assert t4_budget_requested() is False


def test_detect_runtime_on_this_cpu_machine(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    monkeypatch.setenv(hardware.T4_BUDGET_ENV, "1")
    rt = detect_runtime()
    assert rt.device == "cpu" and rt.precision == "fp32" and not rt.t4_budget
    assert rt.vram_budget_bytes == 0 and rt.ram_total_bytes > 1e9 and rt.disk_free_bytes > 0
    assert any("no GPU" in n for n in rt.notes) and any("T4 budget mode asked for" in n for n in rt.notes)
    assert rt.label.startswith("CPU only")


def test_labels_never_call_an_emulated_t4_a_t4():
    h200 = fake_runtime(gpu_name="NVIDIA H200", compute_capability=(9, 0), t4_budget=True, is_colab=False)
    assert h200.label == "H200 capped to T4 budget (14.34 GiB)"  # the cap it was measured under
    assert fake_runtime().label == "Colab T4"
    assert fake_runtime(t4_budget=False, is_colab=False, gpu_name="NVIDIA A100").label == "A100"


def test_native_bf16_follows_compute_capability(t4, a100, cpu):
    assert not t4.native_bf16 and a100.native_bf16 and not cpu.native_bf16


def test_require_gpu_says_how_to_get_one(cpu, t4):
    require_gpu(t4)
    with pytest.raises(NoGPUError, match="Runtime > Change runtime type > T4 GPU"):
        require_gpu(cpu, "training GPT-2")


def test_sized_picks_by_runtime(t4, cpu):
    assert sized(100, 3, t4) == 100
    assert sized(100, 3, cpu) == 3


def test_summary_mentions_budgets(t4):
    text = str(t4)
    assert "14.34 GiB of 14.76 GiB physical" in text and "12.1 GB of 13.6 GB" in text and "fp16" in text and "CPUs            2" in text


def test_colab_t4_profile_is_the_free_colab_budget():
    from helpers.hardware import colab_t4_profile

    t4 = colab_t4_profile()
    assert t4.label == "Colab T4" and t4.precision == "fp16" and not t4.native_bf16
    # a T4 has 14.76 GiB; PyTorch may reserve 14.34 of it (its CUDA context and DeepSpeed's sit outside the allocator)
    assert t4.gpu_total_bytes == 15_843_721_216 and t4.vram_budget_bytes == int(14.34 * 2**30) and t4.cpu_cores == 2
    # Colab's meter says 12.7 GB and means GiB (13.6e9 bytes); 1.4 GiB of it is Colab's own
    assert t4.ram_total_bytes == int(12.7 * 2**30) and t4.ram_budget_bytes == int(12.7 * 2**30) - int(1.4 * 2**30)


def _fake_cgroups(monkeypatch, tmp_path, files: dict[str, str], mounts: dict[str, str], own: dict[str, str]):
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    monkeypatch.setattr(hardware, "_cgroup_mounts", lambda: {k: str(tmp_path / v) for k, v in mounts.items()})
    monkeypatch.setattr(hardware, "_own_cgroups", lambda: own)


def test_cgroup_v2_limits_are_read_and_the_tightest_ancestor_wins(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, {
        "v2/memory.max": "max", "v2/cpu.max": "max 100000",
        "v2/outer/memory.max": "8000000000", "v2/outer/cpu.max": "300000 100000",
        "v2/outer/nb/memory.max": "12000000000", "v2/outer/nb/cpu.max": "150000 100000"},
        {"v2": "v2"}, {"v2": "/outer/nb"})
    assert hardware.cgroup_memory_limit() == (8_000_000_000, "cgroup v2")
    assert hardware.cgroup_cpu_limit() == 1.5
    assert hardware.ram_limit() == (8_000_000_000, "cgroup v2")
    assert hardware.usable_cpus() == min(2, len(__import__("os").sched_getaffinity(0)))


def test_cgroup_v1_limits_are_read(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, {
        "mem/memory.limit_in_bytes": "9223372036854771712",
        "mem/kaggle/memory.limit_in_bytes": "17179869184",
        "cpu/kaggle/cpu.cfs_quota_us": "400000", "cpu/kaggle/cpu.cfs_period_us": "100000",
        "cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
        {"memory": "mem", "cpu": "cpu"}, {"memory": "/kaggle", "cpu": "/kaggle"})
    assert hardware.cgroup_memory_limit() == (17179869184, "cgroup v1")
    assert hardware.cgroup_cpu_limit() == 4.0


def test_no_cgroup_limit_means_the_machine(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, {"v2/memory.max": "max"}, {"v2": "v2"}, {"v2": "/"})
    assert hardware.cgroup_memory_limit() == (None, "")
    assert hardware.ram_limit()[1] == "physical"


def test_detect_runtime_uses_the_cgroup_limit(monkeypatch, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    _fake_cgroups(monkeypatch, tmp_path, {"v2/nb/memory.max": str(3 * 10**9)}, {"v2": "v2"}, {"v2": "/nb"})
    rt = detect_runtime()
    assert rt.ram_total_bytes == 3 * 10**9 and rt.ram_budget_bytes == 3 * 10**9 and rt.ram_limit == "cgroup v2"
    assert "(cgroup v2 limit)" in str(rt)


def test_colab_profile_switches_on_t4_budget_and_colab_branches(monkeypatch):
    monkeypatch.setenv(hardware.COLAB_PROFILE_ENV, "1")
    monkeypatch.setenv(hardware.EMULATION_ENV, "cgroup v2")
    assert hardware.colab_profile_requested() and hardware.emulation_mechanism() == "cgroup v2"
    assert not hardware.in_colab()  # the Hub and pip are not there: the profile is not real Colab
    monkeypatch.delenv(hardware.EMULATION_ENV)
    assert hardware.emulation_mechanism() == "none"
    monkeypatch.setenv(hardware.COLAB_PROFILE_ENV, "0")
    assert hardware.emulation_mechanism() == ""


def test_emulation_labels_say_what_was_enforced():
    h200 = fake_runtime(gpu_name="NVIDIA H200", compute_capability=(9, 0), t4_budget=True, is_colab=True,
                        ram_total_bytes=12_133_282_611, emulation="cgroup v2")
    assert h200.label == "H200 in Colab T4 emulation (14.34 GiB VRAM, 12.1 GB RAM enforced, 2 CPUs)"
    watched = fake_runtime(gpu_name="NVIDIA H200", t4_budget=True, emulation="watchdog")
    assert "held by a watchdog" in watched.label and "T4)" not in watched.label
    assert "not enforced" in fake_runtime(gpu_name="NVIDIA H200", t4_budget=True, emulation="none").label


def test_nvme_folder_follows_the_emulation(monkeypatch, tmp_path):
    monkeypatch.setenv(hardware.NVME_DIR_ENV, str(tmp_path))
    assert hardware.default_nvme_path() == str(tmp_path)
    monkeypatch.delenv(hardware.NVME_DIR_ENV)
    assert hardware.default_nvme_path("/x").endswith("/x/build/nvme")


def test_smoke_size_shrinks_colab_defaults_and_keeps_what_the_learner_set(cpu, t4, capsys):
    from helpers.hardware import smoke_size

    ns = {"MICRO_BATCH": 4, "STEPS": 99}
    now = smoke_size(ns, cpu, MICRO_BATCH=(4, 2), STEPS=(120, 40))
    assert now == {"MICRO_BATCH": 2, "STEPS": 99} and ns["MICRO_BATCH"] == 2
    out = capsys.readouterr().out
    assert "CPU smoke size: MICRO_BATCH 2 (Colab value 4)" in out
    assert "kept as you set them: STEPS 99 (yours; the smoke size would be 40)" in out
    ns = {"MICRO_BATCH": 4}
    assert smoke_size(ns, t4, MICRO_BATCH=(4, 2)) == {"MICRO_BATCH": 4}  # a GPU keeps the Colab size
    with pytest.raises(NameError, match="run the parameters cell first"):
        smoke_size({}, cpu, MICRO_BATCH=(4, 2))


BAD_PARAMETERS = [  # issue 41 item 2: (name, bad value, defaults (Colab, CPU)) as the notebooks pass them
    ("STEPS", 0, (60, 40)), ("HIDDEN", 0, (2048, 256)), ("LOGITS_TILE", 0, (1024, 256)),
    ("LOGITS_TILE", -256, (1024, 256)), ("TRY_LENGTHS", (), ((4096, 16384, 65536), (512, 2048))),
    ("MEASURE_LENGTHS", (), ((1024, 2048, 4096, 8192), (256, 512, 1024))),
    ("MEASURE_LENGTHS", (256.0, 512.0), ((1024, 2048, 4096, 8192), (256, 512, 1024))), ("SEQ_LEN", "512", (512, 64)),
    ("SEQ_LEN", 64.5, (512, 64)), ("STEPS", True, (60, 40)), ("LR", 0, (1e-3, 3e-3)), ("LR", "1e-3", (1e-3, 3e-3)),
    ("WALL_MODEL", "", ("gpt2-large", "gpt2-tiny")), ("CHECKPOINTING", "no", (True, False)),
    ("AUX_SWEEP", (-0.1,), ((0.0, 0.01, 0.1), (0.0, 0.01))), ("LADDER_RUNGS", [], (["a:gpt2-xl"], ["a:gpt2-tiny"])),
]


@pytest.mark.parametrize("name,bad,defaults", BAD_PARAMETERS)
def test_smoke_size_refuses_a_parameter_not_of_its_defaults_kind_with_a_fix_that_passes(cpu, t4, name, bad,
                                                                                         defaults):
    """Issue 41 item 2: STEPS = 0, LOGITS_TILE = 0, TRY_LENGTHS = (), SEQ_LEN = '512' failed minutes later; now the
    parameters' cell refuses them on any runtime, naming the parameter and its value, before changing anything."""
    import ast

    from helpers.hardware import smoke_size

    for runtime in (cpu, t4):
        ns = {name: bad, "MICRO_BATCH": 4}
        with pytest.raises(ValueError, match=rf"^{name} = ") as info:
            smoke_size(ns, runtime, MICRO_BATCH=(4, 2), **{name: defaults})
        assert repr(bad) in str(info.value) and ns == {name: bad, "MICRO_BATCH": 4}  # nothing shrunk
        fix = ast.literal_eval(re.search(rf"Fix: {name} = (.+?)(?: \(its Colab value\))? in the parameters",
                                         str(info.value)).group(1))
        ns[name] = fix
        smoke_size(ns, runtime, MICRO_BATCH=(4, 2), **{name: defaults})  # the fix passes


def test_smoke_size_accepts_what_the_notebooks_pass(cpu):
    from helpers.hardware import smoke_size

    ns = {"AUX_SWEEP": (0, 0.5), "LR": 1, "LENGTHS": [512, 1024], "RUNGS": ["x:gpt2"], "SEQ_LEN": "512"}
    smoke_size(ns, cpu, AUX_SWEEP=((0.0, 0.01, 0.1), (0.0, 0.01)), LR=(1e-3, 3e-3), LENGTHS=((1, 2), (3,)),
               RUNGS=(["a:b"], ["c:d"]))
    assert smoke_size(ns, cpu, SEQ_LEN=("gpt2", "gpt2-tiny")) == {"SEQ_LEN": "512"}  # a string where one is meant


def test_the_colab_profile_without_a_gpu_has_colab_s_budgets_and_says_so(monkeypatch, tmp_path):
    """Issue 23 item 11: DS_COURSE_COLAB=1 on a CPU machine kept the machine's RAM, is_colab False, and a disk budget
    (60 GB) that plan's (the folder's 76.8 GB free) disagreed with."""
    import collections
    import shutil

    import torch

    from helpers.planner import PlanHost, plan

    if torch.cuda.is_available():
        pytest.skip("CPU-only expectations")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(int(200e9), int(123.2e9), int(76.8e9)))
    monkeypatch.setenv(hardware.COLAB_PROFILE_ENV, "1")
    monkeypatch.delenv(hardware.EMULATION_ENV, raising=False)
    monkeypatch.delenv(hardware.T4_BUDGET_ENV, raising=False)
    rt = detect_runtime()
    assert not rt.has_gpu and rt.is_colab and rt.emulation == "none"  # the notebooks take their Colab branches
    assert rt.ram_budget_bytes == min(rt.ram_total_bytes, hardware.COLAB_RAM_BUDGET_BYTES)
    assert rt.disk_free_bytes == hardware.COLAB_NVME_BUDGET_BYTES
    assert not rt.t4_budget and rt.vram_budget_bytes == 0 and rt.precision == "fp32"
    text = str(rt)
    assert "Colab profile without a GPU" in text and "no T4 VRAM budget" in text
    assert "VRAM capped" not in text and "T4 budget mode asked for" not in text  # no promise it does not keep
    nvme = plan("gpt2-tiny", 3, offload_optimizer="nvme", runtime=rt,
                host=PlanHost(nvme_path=str(tmp_path), ram_in_use=0))
    assert nvme.report.disk_budget == rt.disk_free_bytes  # the runtime and plan agree
    assert nvme.report.ram_budget == rt.ram_budget_bytes
    # off the profile: the machine's own numbers, as before
    monkeypatch.setenv(hardware.COLAB_PROFILE_ENV, "0")
    here = detect_runtime()
    assert not here.is_colab and here.disk_free_bytes == int(76.8e9) and here.ram_budget_bytes == here.ram_total_bytes
    assert plan("gpt2-tiny", 3, offload_optimizer="nvme", runtime=here,
                host=PlanHost(nvme_path=str(tmp_path), ram_in_use=0)).report.disk_budget == int(76.8e9)


@pytest.mark.parametrize("capability, kernels_left_on", [((9, 0), False), ((7, 5), True)])
def test_t4_budget_gives_attention_the_kernels_a_t4_has(monkeypatch, capability, kernels_left_on):
    """On a GPU standing in for a T4, SDPA must not use FlashAttention or cuDNN attention (a T4 has neither: its
    memory-efficient kernel keeps other temporaries); on a real T4 (7.5) there is nothing to switch off."""
    from types import SimpleNamespace

    import torch

    from helpers.hardware import T4_VRAM_GIB, apply_t4_budget

    fractions = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(major=capability[0], minor=capability[1], total_memory=140 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: fractions.append(f))
    before = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        cap = apply_t4_budget(0)
        assert cap == int(T4_VRAM_GIB * 2**30) and fractions == [cap / (140 * 2**30)]
        assert torch.backends.cuda.flash_sdp_enabled() is kernels_left_on
        assert torch.backends.cuda.cudnn_sdp_enabled() is kernels_left_on
        assert torch.backends.cuda.mem_efficient_sdp_enabled()  # the T4's own kernel stays
    finally:
        torch.backends.cuda.enable_flash_sdp(before[0])
        torch.backends.cuda.enable_cudnn_sdp(before[1])
