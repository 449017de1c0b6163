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
    assert h200.label == "H200 capped to T4 budget"
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
    assert "15.0 GiB" in text and "12.7 GB" in text and "fp16" in text


def test_colab_t4_profile_is_the_free_colab_budget():
    from helpers.hardware import colab_t4_profile

    t4 = colab_t4_profile()
    assert t4.label == "Colab T4" and t4.precision == "fp16" and not t4.native_bf16
    assert t4.vram_budget_bytes == 15 * 2**30 and t4.ram_budget_bytes == int(12.7e9)
