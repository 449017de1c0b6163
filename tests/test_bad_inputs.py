"""Bad inputs are refused before anything expensive runs, with a fix that itself passes the check (issue 13)."""
import ast
import collections
import os
import re
import shutil
import time

import pytest

from conftest import fake_runtime
from helpers.config import ConfigError, build_ds_config, check_nvme_path, nvme_buffer_size_for, offload_config
from helpers.memory import estimate_activations, estimate_model_states
from helpers.models import model_shape
from helpers.planner import BudgetError, plan, preflight

GPT2_EMBEDDING = 50257 * 768  # GPT-2 124M's largest tensor


def suggested(message: str, name: str):
    """The value the message's 'Fix:' suggests for `name` (a Python literal)."""
    fix = message.split("Fix:", 1)[1]
    m = re.search(rf"\b{name}=('[^']*'|[-+]?[0-9_]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)", fix)
    assert m, f"no {name}=... in the fix of: {message}"
    return ast.literal_eval(m.group(1))


# ---- item 7: build_ds_config's numbers and names


@pytest.mark.parametrize("name, bad", [
    ("stage", 2.0), ("lr", "1e-4"), ("lr", -1e-4), ("lr", float("nan")), ("gradient_clipping", -1.0),
    ("warmup_steps", -5), ("warmup_steps", 2.5), ("initial_scale_power", -1), ("weight_decay", "0.01"),
    ("offload_optimizer", "CPU"), ("offload_optimizer", "gpu"), ("prefetch_bucket_size", -1),
])
def test_bad_numbers_and_names_are_refused_and_the_fix_passes(name, bad):
    kwargs = {"stage": 2, "precision": "fp32", name: bad}
    with pytest.raises(ConfigError, match=rf"{name} must be .*\(got .*\)\..*Fix: ") as err:
        build_ds_config(**kwargs)
    fix = suggested(str(err.value), name)
    config = build_ds_config(**{**kwargs, name: fix})
    assert type(fix) is not str or name.startswith("offload")  # a number comes back as a number
    if name == "stage":
        assert fix == 2 and config["zero_optimization"]["stage"] == 2
        assert '"stage": 2,' in __import__("json").dumps(config["zero_optimization"])  # written as 2, not 2.0


def test_stage_true_is_still_refused():
    with pytest.raises(ConfigError, match=r"got True\).*Fix: pass stage=0..3"):
        build_ds_config(True, precision="fp32")


def test_a_string_learning_rate_gets_its_number_back():
    with pytest.raises(ConfigError, match=r"lr must be a positive number \(got '1e-4', a str\)\. "
                                          r"Fix: lr=0.0001 \(a number, not a string\)"):
        build_ds_config(2, precision="fp32", lr="1e-4")


def test_the_offload_device_fix_keeps_the_meaning():
    with pytest.raises(ConfigError, match=r"Fix: offload_optimizer='cpu'\."):
        build_ds_config(2, precision="fp32", offload_optimizer="CPU")
    with pytest.raises(ConfigError, match=r"\(got 'gpu'\)\. Fix: offload_optimizer='none' \(keeps it on the GPU\)"):
        build_ds_config(2, precision="fp32", offload_optimizer="gpu")


# ---- item 7: the estimators and the planner


@pytest.mark.parametrize("bad, expected", [("CPU", "cpu"), ("Nvme", "nvme")])
def test_estimator_refuses_an_offload_device_it_would_misread(bad, expected):
    with pytest.raises(ConfigError, match=rf"offload_optimizer must be one of .*Fix: offload_optimizer='{expected}'"):
        estimate_model_states(10**6, 3, offload_optimizer=bad)
    with pytest.raises(ConfigError, match="offload_optimizer must be one of"):
        estimate_model_states(10**6, 2, offload_optimizer="gpu")
    fixed = estimate_model_states(10**6, 3, offload_optimizer=expected)
    assert (fixed.cpu if expected == "cpu" else fixed.nvme)["optimizer"] == 12 * 10**6


@pytest.mark.parametrize("n_params", [-5, 0, "124M", float("nan")])
def test_a_parameter_count_must_be_positive(n_params, t4):
    with pytest.raises(ConfigError, match="n_params must be a positive number") as err:
        estimate_model_states(n_params, 2)
    fix = suggested(str(err.value), "n_params")
    assert estimate_model_states(fix, 2).n_params == fix
    with pytest.raises(ConfigError, match="n_params must be a positive number"):
        preflight(build_ds_config(2, runtime=t4), n_params, t4, ram_in_use=0)
    assert preflight(build_ds_config(2, runtime=t4), fix, t4, ram_in_use=0).fits


def test_estimate_model_states_refuses_a_float_stage():
    with pytest.raises(ConfigError, match=r"\(got 2.0\)\. Fix: stage=2"):
        estimate_model_states(10**6, 2.0)


@pytest.mark.parametrize("field", ["batch", "seq_len", "hidden", "n_layers", "vocab"])
def test_activation_estimate_refuses_sizes_below_one(field):
    kwargs = dict(batch=2, seq_len=8, hidden=16, n_layers=3, vocab=100)
    with pytest.raises(ConfigError, match=rf"{field} must be a positive integer"):
        estimate_activations(**{**kwargs, field: 0})
    assert estimate_activations(**kwargs) > 0


def test_preflight_without_a_config_or_runtime(t4):
    with pytest.raises(ConfigError, match=r"preflight needs a DeepSpeed config dict \(got None\)\. "
                                          r"Fix: preflight\(helpers.build_ds_config"):
        preflight(None, 10**6, t4)
    with pytest.raises(ConfigError, match=r"Fix: runtime=helpers.detect_runtime\(\)"):
        preflight(build_ds_config(2, runtime=t4), 10**6, None)


@pytest.mark.parametrize("size", ["0B", 0, -5, "0.0001"])
def test_plan_refuses_a_size_that_is_not_a_positive_count(size, t4):
    with pytest.raises(ValueError, match="a model size must be a positive parameter count") as err:
        plan(size, 2, runtime=t4)
    assert plan(suggested(str(err.value), "model"), 2, runtime=t4).report.fits


@pytest.mark.parametrize("seq_len", [0, -512])
def test_plan_refuses_a_sequence_length_below_one(seq_len, t4):
    with pytest.raises(ConfigError, match="seq_len must be a positive integer") as err:
        plan("gpt2", 2, seq_len=seq_len, runtime=t4)
    fixed = plan("gpt2", 2, seq_len=suggested(str(err.value), "seq_len"), runtime=t4)
    assert fixed.activation_bytes > plan("gpt2", 2, seq_len=1, runtime=t4).activation_bytes


@pytest.mark.parametrize("name, guess", [("gpt2-xxl", "gpt2-xl"), ("gpt2-mediun", "gpt2-medium"),
                                         ("GPT2-Large", "gpt2-large"), ("", None), ("  ", None)])
def test_an_unknown_course_model_name_never_reaches_the_hub(name, guess, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"unknown model size .*did you mean '[^']+'\?") as err:
        model_shape(name)
    assert time.perf_counter() - start < 1.0
    fix = suggested(str(err.value), "model")
    if guess:
        assert fix == guess
    assert model_shape(fix).name == fix


# ---- item 7: the "fp32 model built on CPU" hint only where it explains a RAM overflow


def test_the_model_copy_hint_comes_only_with_a_ram_problem_it_explains(t4):
    hint = "fp32 model built on CPU"
    # RAM over budget, model copy counted (stage 3, not built under zero.Init): the hint and its zero.Init advice
    with pytest.raises(BudgetError, match="CPU RAM") as err:
        preflight(build_ds_config(3, runtime=t4, offload_optimizer="cpu", offload_param="cpu"), 1_557_611_200, t4,
                  largest_layer_params=80_000_000, ram_in_use=int(1e9))
    assert hint in str(err.value) and "deepspeed.zero.Init / HfDeepSpeedConfig" in str(err.value)
    # GPU only: plenty of RAM, too little VRAM
    big_ram = fake_runtime(ram_total_bytes=int(500e9), ram_budget_bytes=int(500e9))
    with pytest.raises(BudgetError) as err:
        preflight(build_ds_config(2, runtime=big_ram), 1_557_611_200, big_ram, ram_in_use=0)
    assert all(p.startswith("GPU") for p in err.value.args[0].split(": ", 1)[1].split(". Fix")[0].split("; "))
    assert hint not in str(err.value)
    # disk only
    small_disk = fake_runtime(disk_free_bytes=int(5e9), ram_budget_bytes=int(500e9))
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                          nvme_path="/nonexistent-nvme", check_paths=False)
    with pytest.raises(BudgetError, match=r"disk: needs") as err:
        preflight(cfg, 2_000_000_000, small_disk, largest_layer_params=10**8, ram_in_use=0)
    assert hint not in str(err.value)
    # RAM over budget but the model is built under zero.Init at stage 3: no copy counted, no hint
    with pytest.raises(BudgetError, match="CPU RAM") as err:
        preflight(build_ds_config(3, runtime=t4, offload_optimizer="cpu", offload_param="cpu"), 2_650_000_000, t4,
                  largest_layer_params=130_000_000, ram_in_use=int(1e9), zero_init=True)
    assert hint not in str(err.value)


# ---- item 6: NVMe settings that only DeepSpeed's asserts (or a C++ abort) would catch


def nvme_param_config(tmp_path, **kw):
    return build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                           nvme_path=str(tmp_path), **kw)


def test_no_nvme_swap_buffers(tmp_path):
    with pytest.raises(ConfigError, match=r"nvme_buffer_count must be an integer >= 1 \(got 0\).*No swap buffers"
                                          r".*Fix: nvme_buffer_count=8") as err:
        nvme_param_config(tmp_path, nvme_buffer_count=0)
    config = nvme_param_config(tmp_path, nvme_buffer_count=suggested(str(err.value), "nvme_buffer_count"))
    assert config["zero_optimization"]["offload_param"]["buffer_count"] == 8


@pytest.mark.parametrize("size", [1, 1_000_000])
def test_a_swap_buffer_smaller_than_the_largest_tensor(tmp_path, size):
    with pytest.raises(ConfigError, match=r"nvme_buffer_size must hold the model's largest tensor "
                                          r"\(38,597,376 elements\).*More elements") as err:
        nvme_param_config(tmp_path, nvme_buffer_size=size, largest_param=GPT2_EMBEDDING)
    fix = suggested(str(err.value), "nvme_buffer_size")
    assert fix == nvme_buffer_size_for(GPT2_EMBEDDING)
    nvme_param_config(tmp_path, nvme_buffer_size=fix, largest_param=GPT2_EMBEDDING)


def test_a_swap_buffer_that_holds_no_swappable_tensor_even_without_the_model(tmp_path):
    with pytest.raises(ConfigError, match=r"smallest tensor DeepSpeed swaps to NVMe \(524,288 elements") as err:
        nvme_param_config(tmp_path, nvme_buffer_size=1)
    nvme_param_config(tmp_path, nvme_buffer_size=suggested(str(err.value), "nvme_buffer_size"))


def test_offload_config_sizes_buffers_that_pass_its_own_check(t4, cpu):
    for runtime in (t4, cpu):
        for largest in (1, GPT2_EMBEDDING, 206_000_000):
            cfg = offload_config("zero3_nvme_all", runtime, largest_param=largest, nvme_path="/x", check_paths=False)
            assert cfg["zero_optimization"]["offload_param"]["buffer_size"] >= largest


def test_preflight_checks_the_swap_buffers_against_the_model(t4):
    roomy = fake_runtime(ram_total_bytes=int(500e9), ram_budget_bytes=int(500e9))
    cfg = build_ds_config(3, runtime=t4, offload_optimizer="nvme", offload_param="nvme", nvme_path="/x",
                          check_paths=False, nvme_buffer_size=1_000_000)
    with pytest.raises(ConfigError, match="nvme_buffer_size must hold the model's largest tensor") as err:
        preflight(cfg, 124_439_808, roomy, largest_layer_params=GPT2_EMBEDDING, ram_in_use=0)
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = suggested(str(err.value), "nvme_buffer_size")
    assert preflight(cfg, 124_439_808, roomy, largest_layer_params=GPT2_EMBEDDING, ram_in_use=0).fits
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 0
    with pytest.raises(ConfigError, match="nvme_buffer_count must be an integer >= 1"):
        preflight(cfg, 124_439_808, roomy, largest_layer_params=GPT2_EMBEDDING, ram_in_use=0)


def test_plan_sizes_nvme_buffers_for_the_model(t4):
    p = plan("gpt2-6.7b", 3, offload_optimizer="nvme", offload_param="nvme", runtime=t4, nvme_path="/x")
    assert not p.error
    assert p.config["zero_optimization"]["offload_param"]["buffer_size"] >= model_shape("gpt2-6.7b").largest_layer_params


@pytest.fixture
def ten_mb_disk(tmp_path, monkeypatch):
    """tmp_path on a disk with 10 MB free (shutil.disk_usage answers so for it)."""
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")

    def fake(path):
        if os.path.realpath(path).startswith(os.path.realpath(tmp_path)):
            return usage(10**9, 10**9 - 10**7, 10**7)
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", fake)
    return tmp_path


def test_a_10_mb_nvme_folder_is_refused_even_without_an_estimate(ten_mb_disk):
    with pytest.raises(ConfigError, match=r"has only 10 MB free.*Fix: point nvme_path at a disk"):
        check_nvme_path(ten_mb_disk)
    with pytest.raises(ConfigError, match="has only 10 MB free"):
        build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(ten_mb_disk))
    # the fix for a model that really is small: its estimate, which fits
    assert check_nvme_path(ten_mb_disk, bytes_needed=5 * 10**6) == ten_mb_disk
    build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(ten_mb_disk), n_params=100_000)
    with pytest.raises(ConfigError, match=r"has 0.0 GB free but this config needs about 0.1 GB"):
        build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(ten_mb_disk),
                        n_params=3_300_000)


def test_preflight_checks_the_nvme_folder_of_the_config(ten_mb_disk):
    roomy = fake_runtime(ram_total_bytes=int(500e9), ram_budget_bytes=int(500e9), disk_free_bytes=int(100e9))
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                          nvme_path=str(ten_mb_disk), check_paths=False)
    with pytest.raises(BudgetError, match=r"disk: needs ~0.06 GB, 0.01 GB free"):
        preflight(cfg, 3_300_000, roomy, largest_layer_params=GPT2_EMBEDDING // 12, ram_in_use=0)


def test_an_nvme_path_that_is_a_file(tmp_path):
    a_file = tmp_path / "nvme"
    a_file.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"is a file, not a folder.*Fix: pick a folder, e.g. nvme_path=") as err:
        build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(a_file))
    assert "does not exist" not in str(err.value)
    folder = suggested(str(err.value), "nvme_path")
    os.makedirs(folder, exist_ok=True)  # what the message says to do first
    assert check_nvme_path(folder) == __import__("pathlib").Path(folder)
