"""Bad inputs are refused before anything expensive runs, with a fix that itself passes the check (issue 13)."""
import ast
import collections
import os
import re
import shutil
import time

import pytest

from conftest import fake_runtime
from helpers.config import (SETTING_NAMES, ConfigError, ConfigSettings, _split_arguments, build_ds_config,
                            check_nvme_path, nvme_buffer_size_for, offload_config)
from helpers.memory import estimate_activations, estimate_model_states
from helpers.models import model_shape
from helpers.planner import BudgetError, PlanHost, plan, preflight

GPT2_EMBEDDING = 50257 * 768  # GPT-2 124M's largest tensor

FRESH = PlanHost(ram_in_use=0)  # plan's host: nothing else in RAM (a fresh runtime)


def suggested(message: str, name: str):
    """The value the message's 'Fix:' suggests for `name` (a Python literal)."""
    fix = message.split("Fix:", 1)[1]
    m = re.search(rf"\b{name}=('[^']*'|[-+]?[0-9_]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)", fix)
    assert m, f"no {name}=... in the fix of: {message}"
    return ast.literal_eval(m.group(1))


def build(**flat):
    """build_ds_config with each ConfigSettings field given by its own name passed in settings=ConfigSettings(...)."""
    return build_ds_config(**_split_arguments(flat))


def names_the_setting(message: str, name: str) -> bool:
    """The fix names a ConfigSettings field as settings=ConfigSettings(name=...), a keyword as name=..."""
    fix = message.split("Fix:", 1)[1]
    return f"settings=ConfigSettings({name}=" in fix if name in SETTING_NAMES else f"ConfigSettings({name}=" not in fix


# ---- item 7: build_ds_config's numbers and names


@pytest.mark.parametrize("name, bad", [
    ("stage", 2.0), ("lr", "1e-4"), ("lr", -1e-4), ("lr", float("nan")), ("gradient_clipping", -1.0),
    ("warmup_steps", -5), ("warmup_steps", 2.5), ("initial_scale_power", -1), ("weight_decay", "0.01"),
    ("offload_optimizer", "CPU"), ("offload_optimizer", "gpu"), ("prefetch_bucket_size", -1),
])
def test_bad_numbers_and_names_are_refused_and_the_fix_passes(name, bad):
    kwargs = {"stage": 2, "precision": "fp32", name: bad}
    with pytest.raises(ConfigError, match=rf"{name} must be .*\(got .*\)\..*Fix: ") as err:
        build(**kwargs)
    assert names_the_setting(str(err.value), name)
    fix = suggested(str(err.value), name)
    config = build(**{**kwargs, name: fix})
    assert type(fix) is not str or name.startswith("offload")  # a number comes back as a number
    if name == "stage":
        assert fix == 2 and config["zero_optimization"]["stage"] == 2
        assert '"stage": 2,' in __import__("json").dumps(config["zero_optimization"])  # written as 2, not 2.0


def test_stage_true_is_still_refused():
    with pytest.raises(ConfigError, match=r"got True\).*Fix: pass stage=0..3"):
        build_ds_config(True, precision="fp32")


def test_a_string_learning_rate_gets_its_number_back():
    with pytest.raises(ConfigError, match=r"lr must be a positive number \(got '1e-4', a str\)\. "
                                          r"Fix: settings=ConfigSettings\(lr=0.0001\) \(a number, not a string\)"):
        build_ds_config(2, precision="fp32", settings=ConfigSettings(lr="1e-4"))


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
                          nvme_path="/nonexistent-nvme",
                          settings=ConfigSettings(check_paths=False))
    with pytest.raises(BudgetError, match=r"disk: needs") as err:
        preflight(cfg, 2_000_000_000, small_disk, largest_layer_params=10**8, ram_in_use=0)
    assert hint not in str(err.value)
    # RAM over budget but the model is built under zero.Init at stage 3: no copy counted, no hint
    with pytest.raises(BudgetError, match="CPU RAM") as err:
        preflight(build_ds_config(3, runtime=t4, offload_optimizer="cpu", offload_param="cpu"), 2_650_000_000, t4,
                  largest_layer_params=130_000_000, ram_in_use=int(1e9), zero_init=True)
    assert hint not in str(err.value)


# ---- item 6: NVMe settings that only DeepSpeed's asserts (or a C++ abort) would catch


def nvme_param_config(tmp_path, **settings):
    return build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                           nvme_path=str(tmp_path), settings=ConfigSettings(**settings))


def test_no_nvme_swap_buffers(tmp_path):
    with pytest.raises(ConfigError, match=r"nvme_buffer_count must be an integer >= 1 \(got 0\).*No swap buffers"
                                          r".*Fix: settings=ConfigSettings\(nvme_buffer_count=8\)") as err:
        nvme_param_config(tmp_path, nvme_buffer_count=0)
    config = nvme_param_config(tmp_path, nvme_buffer_count=suggested(str(err.value), "nvme_buffer_count"))
    assert config["zero_optimization"]["offload_param"]["buffer_count"] == 8


@pytest.mark.parametrize("size", [1, 1_000_000])
def test_a_swap_buffer_smaller_than_the_largest_tensor(tmp_path, size):
    with pytest.raises(ConfigError, match=r"nvme_buffer_size must hold the model's largest tensor "
                                          r"\(38,597,376 elements\).*More elements") as err:
        nvme_param_config(tmp_path, nvme_buffer_size=size, largest_param=GPT2_EMBEDDING)
    assert names_the_setting(str(err.value), "nvme_buffer_size")
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
                          settings=ConfigSettings(check_paths=False, nvme_buffer_size=1_000_000))
    with pytest.raises(ConfigError, match="nvme_buffer_size must hold the model's largest tensor") as err:
        preflight(cfg, 124_439_808, roomy, largest_layer_params=GPT2_EMBEDDING, ram_in_use=0)
    assert names_the_setting(str(err.value), "nvme_buffer_size")
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = suggested(str(err.value), "nvme_buffer_size")
    assert preflight(cfg, 124_439_808, roomy, largest_layer_params=GPT2_EMBEDDING, ram_in_use=0).fits
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 0
    with pytest.raises(ConfigError, match="nvme_buffer_count must be an integer >= 1"):
        preflight(cfg, 124_439_808, roomy, largest_layer_params=GPT2_EMBEDDING, ram_in_use=0)


def test_plan_sizes_nvme_buffers_for_the_model(t4, tmp_path):
    p = plan("gpt2-6.7b", 3, offload_optimizer="nvme", offload_param="nvme", runtime=t4,
             host=PlanHost(nvme_path=str(tmp_path)))
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
    build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(ten_mb_disk),
                    settings=ConfigSettings(n_params=100_000))
    with pytest.raises(ConfigError, match=r"has 0.0 GB free but this config needs about 0.1 GB"):
        build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(ten_mb_disk),
                        settings=ConfigSettings(n_params=3_300_000))


def test_preflight_checks_the_nvme_folder_of_the_config(ten_mb_disk):
    roomy = fake_runtime(ram_total_bytes=int(500e9), ram_budget_bytes=int(500e9), disk_free_bytes=int(100e9))
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme",
                          nvme_path=str(ten_mb_disk),
                          settings=ConfigSettings(check_paths=False))
    with pytest.raises(BudgetError, match=r"disk: needs ~0.06 GB, 0.01 GB free"):
        preflight(cfg, 3_300_000, roomy, largest_layer_params=GPT2_EMBEDDING // 12, ram_in_use=0)


def _disk_with(monkeypatch, folder, free):
    """`folder` on a disk with `free` bytes free (shutil.disk_usage answers so for it)."""
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free)
                        if os.path.realpath(path).startswith(os.path.realpath(folder)) else real(path))


@pytest.mark.slow
def test_train_run_checks_the_disk_a_config_built_without_n_params_needs_before_initialize(tmp_path, monkeypatch,
                                                                                           cpu):
    """Issue 41 item 1: an NVMe config built without n_params passed only the free-space floor, and DeepSpeed filled
    the disk and aborted the kernel. train_run knows the parameter count once the model exists: it refuses before
    deepspeed.initialize, naming a model size that fits, and leaves nothing behind."""
    import torch

    import helpers.config
    from helpers.train import MeasureSettings, _check_nvme_need, train_run

    cfg = build_ds_config(3, precision="fp32", offload_optimizer="nvme", nvme_path=str(tmp_path))  # no n_params
    monkeypatch.setattr(helpers.config, "NVME_MIN_FREE_BYTES", 10**5)  # the floor passes: the disk is "big enough"
    _disk_with(monkeypatch, tmp_path, 10**6)  # 1 MB free; 200k parameters write ~3.2 MB of optimizer states
    built = []

    def factory():
        built.append(torch.nn.Sequential(torch.nn.Embedding(2000, 100)))
        return built[-1]

    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)  # initialize must not be reached
    blocks = [{"input_ids": torch.zeros(8, dtype=torch.long)} for _ in range(4)]
    with pytest.raises(ConfigError, match=r"has 0.00 GB free, but my-model \(0.2M parameters\) writes about 0.00 GB "
                                          r"there .* Refused before DeepSpeed started. Fix: point nvme_path") as err:
        train_run("nvme", factory, blocks, runtime=cpu, ds_config=cfg, steps=2, model_name="my-model",
                  measure=MeasureSettings(progress=False))
    assert len(built) == 1 and sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"train without NVMe offload"):  # under 1M parameters: no smaller size
        _check_nvme_need(cfg, 200_000)
    # a model the fix's size names fits the same disk
    big = 100_000_000
    _disk_with(monkeypatch, tmp_path, 10**9)
    with pytest.raises(ConfigError, match=r"at most ~(\d+)M parameters") as err:
        _check_nvme_need(cfg, big)
    fits = int(re.search(r"at most ~(\d+)M", str(err.value)).group(1)) * 1_000_000
    _check_nvme_need(cfg, fits)


@pytest.mark.slow
def test_a_fresh_process_run_is_refused_before_its_child_starts_when_the_disk_is_too_small(tmp_path, monkeypatch, t4):
    import subprocess

    from helpers.fresh_process import FreshRunSpec, train_in_fresh_process

    cfg = offload_config("zero3_nvme_optimizer_gpu_params", t4, nvme_path=str(tmp_path), check_paths=False)
    _disk_with(monkeypatch, tmp_path, int(1.1e9))  # above the 1 GB floor, below gpt2's ~2 GB of optimizer files
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("no child may start"))
    with pytest.raises(ConfigError, match=r"gpt2 \(124.4M parameters\) writes about 1.99 GB there"):
        train_in_fresh_process(FreshRunSpec("nvme", cfg, "gpt2", tokenizer_dir=tmp_path))


def test_an_nvme_path_that_is_a_file(tmp_path):
    a_file = tmp_path / "nvme"
    a_file.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"is a file, not a folder.*Fix: pick a folder, e.g. nvme_path=") as err:
        build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(a_file))
    assert "does not exist" not in str(err.value)
    folder = suggested(str(err.value), "nvme_path")
    os.makedirs(folder, exist_ok=True)  # what the message says to do first
    assert check_nvme_path(folder) == __import__("pathlib").Path(folder)


# ---- issue 23 item 3: sequences longer than the model's positions


def test_plan_refuses_a_sequence_longer_than_the_model_s_positions_and_the_fix_fits(t4):
    with pytest.raises(ConfigError, match=r"seq_len=2048 is longer than gpt2-medium takes: it has 1024 positions.*"
                                          r"IndexError.*Fix: seq_len=1024") as err:
        plan("gpt2-medium", seq_len=2048, runtime=t4)
    fixed = plan("gpt2-medium", seq_len=suggested(str(err.value), "seq_len"), runtime=t4, host=FRESH)
    assert not fixed.error and fixed.report.fits
    assert model_shape("gpt2-medium").n_positions == 1024 and model_shape("1.3B").n_positions == 1024


def test_the_planner_s_seq_len_menu_offers_only_what_the_models_take(t4, monkeypatch):
    from helpers.models import GPT2_CONTEXT, GPT2_LADDER
    from helpers.planner_ui import planner_widget

    monkeypatch.delenv("DS_COURSE_SAVED_RUN", raising=False)
    ui = planner_widget(t4, model="gpt2")
    menus = [c for box in ui.children if hasattr(box, "children") for c in box.children
             if getattr(c, "description", "") == "seq len"]
    assert len(menus) == 1 and max(menus[0].options) == GPT2_CONTEXT
    assert all(model_shape(m).n_positions >= max(menus[0].options) for m in GPT2_LADDER)


def tiny_blocks(seq_len, n=8):
    import datasets

    from helpers.data import as_tensors

    return datasets.Dataset.from_dict({"input_ids": [[i % 50 for i in range(seq_len)]] * n}).with_transform(as_tensors)


@pytest.mark.slow
def test_train_run_refuses_blocks_longer_than_the_model_s_positions_before_a_step(cpu, clean_dist_env,
                                                                                  monkeypatch):
    from transformers import AutoModelForCausalLM

    from helpers.models import gpt2_config
    from helpers.train import MeasureSettings, train_run

    config = build_ds_config(0, precision="fp32", micro_batch_size=2, settings=ConfigSettings(scheduler=None))
    built = []

    def factory():
        built.append(1)
        return AutoModelForCausalLM.from_config(gpt2_config("gpt2-tiny", n_positions=64, vocab_size=64))

    kw = dict(runtime=cpu, ds_config=config, plain_pytorch=True, steps=1,
              measure=MeasureSettings(progress=False, untimed_steps=0))
    # the built model says its positions: refused before deepspeed.initialize and the first step
    with pytest.raises(ConfigError, match=r"blocks hold 128 tokens, longer than the model gpt2-tiny takes: it has 64 "
                                          r"positions.*IndexError.*Fix: seq_len=64") as err:
        train_run("long", factory, tiny_blocks(128), model_name="gpt2-tiny", **kw)
    assert built == [1]
    import deepspeed

    def no_engine(*args, **kwargs):
        raise AssertionError("deepspeed.initialize ran")

    with monkeypatch.context() as m:  # a DeepSpeed run: refused before its engine is built
        m.setattr(deepspeed, "initialize", no_engine)
        with pytest.raises(ConfigError, match=r"blocks hold 128 tokens.*Fix: seq_len=64"):
            train_run("long", factory, tiny_blocks(128), **{**kw, "plain_pytorch": False})
    fixed = train_run("fixed", factory, tiny_blocks(suggested(str(err.value), "seq_len")), **kw)
    assert len(fixed.losses) == 1 and fixed.seq_len == 64


# ---- issue 23 item 7: save_model_from_config reuses a folder only when it holds what was asked


def saved_config(path):
    return __import__("json").loads((path / "config.json").read_text())


def test_a_saved_model_folder_is_rewritten_when_it_holds_another_model(tmp_path, capsys):
    from helpers.models import save_model_from_config

    path = tmp_path / "model"
    small = dict(vocab_size=256)
    save_model_from_config(path, "gpt2-tiny", **small)
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    save_model_from_config(path, "gpt2-tiny", **small)  # the same: reused
    assert weights.stat().st_mtime_ns == before and "rewriting" not in capsys.readouterr().out
    save_model_from_config(path, "gpt2", n_layer=1, **small)  # another size in the same folder
    assert saved_config(path)["n_embd"] == 768 and saved_config(path)["n_layer"] == 1
    assert "holds another model than 'gpt2'" in capsys.readouterr().out
    save_model_from_config(path, "gpt2-tiny", n_positions=128, **small)  # an override
    assert saved_config(path)["n_positions"] == 128 and saved_config(path)["n_embd"] == 64
    save_model_from_config(path, "gpt2-tiny", **small)  # back to the default positions
    assert saved_config(path)["n_positions"] == 1024
    first = weights.read_bytes()
    save_model_from_config(path, "gpt2-tiny", seed=1, **small)  # another seed: other weights
    assert weights.read_bytes() != first and saved_config(path)["ds_course_seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # rewritten atomically: no leftovers


@pytest.mark.parametrize("size, meant", [("124M", "gpt2"), ("350M", "gpt2-medium"), ("gpt2-small", "gpt2"),
                                         ("1.5B", "gpt2-xl"), ("gpt2-xxl", "gpt2-xl"), ("GPT2_Medium", "gpt2-medium"),
                                         ("", "gpt2"), (None, "gpt2")])
def test_save_model_from_config_suggests_a_size_it_takes(size, meant, tmp_path, monkeypatch):
    from helpers import models

    for rung in models.GPT2_LADDER:  # the did-you-mean compares sizes: each rung's shape, from its config, cached
        models._ladder_shape(rung)  # (so the test does not depend on what ran before it in this process)
    built = []
    monkeypatch.setattr(models, "gpt2_config", lambda *a, **k: built.append(a) or (_ for _ in ()).throw(
        AssertionError("built")))
    with pytest.raises(ValueError, match=r"unknown model size .*Fix: size=") as err:
        models.save_model_from_config(tmp_path / "m", size)
    assert not built
    fix = suggested(str(err.value), "size")
    if size not in ("", None):
        assert fix == meant
    assert fix in models.GPT2_LADDER  # the check that refused takes it
    assert "'350M'" not in str(err.value).split("Fix:")[1].split(";")[0]  # no size suggested where none is taken


@pytest.mark.parametrize("directory", ["", "  ", None, 123])
def test_save_model_from_config_refuses_a_folder_that_is_none(directory, tmp_path, monkeypatch):
    from helpers.models import model_folder_problem, save_model_from_config

    with pytest.raises(ValueError, match=r"directory must be a folder to save the model in.*Fix: directory=") as err:
        save_model_from_config(directory, "gpt2-tiny", vocab_size=256)
    monkeypatch.chdir(tmp_path)
    fix = suggested(str(err.value), "directory")
    assert model_folder_problem(save_model_from_config(fix, "gpt2-tiny", vocab_size=256)) is None


# ---- issue 23 item 9: settings accepted that failed later


@pytest.mark.parametrize("name, bad", [("steps_per_print", 0), ("steps_per_print", -1), ("steps_per_print", 2.5)])
def test_steps_per_print_must_be_positive(name, bad):
    with pytest.raises(ConfigError, match=rf"{name} must be a positive integer.*Fix: ") as err:
        build_ds_config(2, precision="fp32", settings=ConfigSettings(**{name: bad}))
    assert names_the_setting(str(err.value), name)
    fix = suggested(str(err.value), name)
    assert build_ds_config(2, precision="fp32", settings=ConfigSettings(**{name: fix}))[name] == fix


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.999, 0.1), (0.9, 1.5), ("0.9", 0.999), 0.9, None])
def test_betas_must_be_two_rates_below_one(betas):
    with pytest.raises(ConfigError, match=r"betas must be Adam's two decay rates.*"
                                          r"Fix: settings=ConfigSettings\(betas=\(0.9, 0.999\)\)") as err:
        build_ds_config(2, precision="fp32", settings=ConfigSettings(betas=betas))
    fix = ast.literal_eval(re.search(r"betas=(\([^)]*\))", str(err.value).split("Fix:")[1]).group(1))
    assert build_ds_config(2, precision="fp32",
                           settings=ConfigSettings(betas=fix))["optimizer"]["params"]["betas"] == [0.9, 0.999]
    from helpers.config import validate_ds_config

    validate_ds_config(build_ds_config(2, precision="fp32", settings=ConfigSettings(betas=fix)))


@pytest.mark.parametrize("total, warmup", [(5, 10), (10, 10), (1, 0)])
def test_warmup_decay_must_decay_after_its_warmup(total, warmup):
    def decay(total_steps, warmup_steps):
        return ConfigSettings(scheduler="WarmupDecayLR", total_steps=total_steps, warmup_steps=warmup_steps)

    if total > warmup:
        build_ds_config(2, precision="fp32", settings=decay(total, warmup))
        return
    with pytest.raises(ConfigError, match=r"total_steps must be larger than warmup_steps.*Fix: settings="
                                          r"ConfigSettings\(scheduler='WarmupDecayLR', warmup_steps=") as err:
        build_ds_config(2, precision="fp32", settings=decay(total, warmup))
    message = str(err.value)
    # each way out is a whole ConfigSettings(...): evaluated as written, it passes
    fixes = re.findall(r"settings=(ConfigSettings\([^)]*\))", message.split("Fix:", 1)[1])
    assert len(fixes) == 2
    longer, shorter = (build_ds_config(2, precision="fp32", settings=eval(fix, {"ConfigSettings": ConfigSettings}))
                       for fix in fixes)
    assert longer["scheduler"]["params"]["warmup_num_steps"] == warmup
    assert shorter["scheduler"]["params"]["total_num_steps"] == total
    for cfg in (longer, shorter):
        params = cfg["scheduler"]["params"]
        assert params["total_num_steps"] > params["warmup_num_steps"]


@pytest.mark.parametrize("bad, meant", [("no", False), ("off", False), ("False", False), ("yes", True), (1, True),
                                        (0, False), ("maybe", None), (None, None)])
def test_activation_checkpointing_must_be_a_bool(bad, meant):
    with pytest.raises(ConfigError, match=r"activation_checkpointing must be True or False.*Fix: ") as err:
        build_ds_config(2, precision="fp32", settings=ConfigSettings(activation_checkpointing=bad))
    fix = str(err.value).split("Fix: ")[1]
    if meant is not None:
        assert fix.startswith(f"settings=ConfigSettings(activation_checkpointing={meant}).")
        on = "activation_checkpointing" in build_ds_config(2, precision="fp32",
                                                           settings=ConfigSettings(activation_checkpointing=meant))
        assert on is meant
    else:
        assert ("settings=ConfigSettings(activation_checkpointing=True) (on) or "
                "settings=ConfigSettings(activation_checkpointing=False) (off)") in fix


def test_a_home_relative_nvme_path_is_expanded_not_made_literally(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'.*/nvme' does not exist") as err:
        check_nvme_path("~/nvme")
    assert "'~" not in str(err.value)  # the fix does not create a folder named '~'
    made = re.search(r"os.makedirs\('([^']+)'", str(err.value)).group(1)
    os.makedirs(made, exist_ok=True)  # the fix
    assert made == str(tmp_path / "nvme") and not (tmp_path / "~").exists()
    assert check_nvme_path("~/nvme") == tmp_path / "nvme"
    cfg = build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path="~/nvme",
                          settings=ConfigSettings(n_params=1000))
    assert cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path / "nvme")


# ---- issue 23 item 10: no bare exceptions


def test_a_device_name_is_not_a_runtime(cpu):
    for call in (lambda rt: build_ds_config(2, runtime=rt), lambda rt: plan("gpt2", runtime=rt, host=FRESH),
                 lambda rt: offload_config("zero2_offload_cpu", rt)):
        with pytest.raises(ConfigError, match=r"needs runtime=helpers.detect_runtime\(\) \(got 'cpu', a str\)\. "
                                              r"A runtime is not a device name.*Fix: runtime=helpers.detect_runtime"):
            call("cpu")
    import helpers

    fixed = helpers.detect_runtime()  # the fix
    assert build_ds_config(2, runtime=fixed) and plan("gpt2-tiny", runtime=fixed, host=FRESH).report


@pytest.mark.parametrize("model, fix_match", [(None, "got None, a NoneType"), (float("nan"), r"got nan"),
                                              (float("inf"), "got inf"), ([1], "a list")])
def test_plan_refuses_a_model_that_is_none_of_its_kinds(model, fix_match, t4):
    with pytest.raises(ValueError, match=rf"{fix_match}.*Fix: model=") as err:
        plan(model, runtime=t4)
    assert not plan(suggested(str(err.value), "model"), runtime=t4, host=FRESH).error


def test_plan_refuses_a_folder_without_a_saved_model(tmp_path, t4):
    with pytest.raises(ValueError, match=r"is a folder without a config.json, not a saved model\. Fix: model='gpt2'"):
        plan(str(tmp_path), runtime=t4)


@pytest.mark.parametrize("bad", [123, 1.5, b"/tmp", ["/tmp"]])
def test_check_nvme_path_refuses_what_is_not_a_path(bad, tmp_path, monkeypatch):
    from helpers.hardware import NVME_DIR_ENV

    monkeypatch.setenv(NVME_DIR_ENV, str(tmp_path / "nvme"))
    with pytest.raises(ConfigError, match=r"nvme_path must be a folder's path, a str .*Fix: nvme_path=") as err:
        check_nvme_path(bad)
    fix = suggested(str(err.value), "nvme_path")
    os.makedirs(fix, exist_ok=True)  # what the message says to do first
    assert check_nvme_path(fix) == tmp_path / "nvme"


@pytest.mark.parametrize("bad, expected", [("40M", 40_000_000), (-1, 0), (2.5, 0), ("big", 0)])
def test_offload_config_refuses_a_largest_param_that_is_not_a_count(bad, expected, t4):
    with pytest.raises(ConfigError, match=r"largest_param must be a non-negative integer.*Fix: largest_param=") as err:
        offload_config("zero2_offload_cpu", t4, largest_param=bad)
    fix = suggested(str(err.value), "largest_param")
    assert fix == expected
    offload_config("zero2_offload_cpu", t4, largest_param=fix)
    if fix:
        offload_config("zero3_nvme_all", t4, largest_param=fix, nvme_path="/x", check_paths=False)


@pytest.mark.parametrize("steps", [2.5, 0, -1, "10", True])
def test_train_run_steps_must_be_a_positive_integer(steps, cpu, clean_dist_env):
    from helpers.train import MeasureSettings, train_run

    built = []
    config = build_ds_config(0, precision="fp32", micro_batch_size=2, settings=ConfigSettings(scheduler=None))
    with pytest.raises(ConfigError, match=r"steps must be a positive integer.*Fix: steps=") as err:
        train_run("x", lambda: built.append(1), tiny_blocks(8), runtime=cpu, ds_config=config, plain_pytorch=True,
                  steps=steps, measure=MeasureSettings(progress=False))
    assert not built
    assert suggested(str(err.value), "steps") >= 1


def test_record_figure_keeps_numpy_and_torch_numbers(tmp_path, monkeypatch):
    import json

    import numpy
    import torch

    from helpers.records import FIGURES_ENV, record_figure, recorded_figures

    target = tmp_path / "figures.json"
    monkeypatch.setenv(FIGURES_ENV, str(target))
    record_figure("np", numpy.float32(1.5))
    record_figure("t", torch.tensor(2.5))
    record_figure("mixed", {"a": numpy.int64(3), "b": [torch.tensor(1.0), numpy.arange(2)]})
    assert json.loads(target.read_text()) == {"np": 1.5, "t": 2.5, "mixed": {"a": 3, "b": [1.0, [0, 1]]}}
    assert type(recorded_figures()["np"]) is float
    with pytest.raises(TypeError, match=r"record_figure\(.bad., \.\.\.\) keeps numbers.*Fix: record_figure"):
        record_figure("bad", object())
    with pytest.raises(ValueError, match="a figure's name must be a non-empty str"):
        record_figure("", 1.0)


@pytest.mark.parametrize("bad", [-1, float("nan"), "1e9"])
def test_ram_in_use_must_be_a_byte_count(bad, t4):
    with pytest.raises(ConfigError, match=r"ram_in_use must be a non-negative number.*Fix: ram_in_use=") as err:
        plan("gpt2", runtime=t4, host=PlanHost(ram_in_use=bad))
    fix = suggested(str(err.value), "ram_in_use")
    assert plan("gpt2", runtime=t4, host=PlanHost(ram_in_use=fix)).report.fits
    with pytest.raises(ConfigError, match="ram_in_use must be a non-negative number"):
        preflight(build_ds_config(2, runtime=t4), 10**6, t4, ram_in_use=bad)


def test_plan_says_a_named_nvme_folder_is_missing_with_the_fix(t4, tmp_path):
    missing = tmp_path / "nvme"
    nvme = dict(stage=3, offload_optimizer="nvme")
    p = plan("gpt2", runtime=t4, host=PlanHost(nvme_path=str(missing), ram_in_use=0), **nvme)
    assert p.report is None and "config refused" in str(p)
    assert f"NVMe offload folder {str(missing)!r} does not exist. Fix: create it first" in p.error
    os.makedirs(re.search(r"os.makedirs\('([^']+)'", p.error).group(1), exist_ok=True)  # the fix
    fixed = plan("gpt2", runtime=t4, host=PlanHost(nvme_path=str(missing), ram_in_use=0), **nvme)
    assert not fixed.error and fixed.report.fits
    # a what-if runtime stands for another machine: its folder is not looked for here
    from helpers.hardware import colab_t4_profile

    assert not plan("gpt2", runtime=colab_t4_profile(),
                    host=PlanHost(nvme_path="/content/nvme-elsewhere", ram_in_use=0), **nvme).error


@pytest.mark.slow
def test_a_run_s_precision_is_the_config_s(cpu, clean_dist_env):
    """bf16 (NVMe parameter offload runs bf16 on a fp32 CPU runtime) was recorded as the runtime's 'fp32'."""
    from transformers import AutoModelForCausalLM

    from helpers.models import gpt2_config
    from helpers.train import MeasureSettings, train_run

    def factory():
        return AutoModelForCausalLM.from_config(gpt2_config("gpt2-tiny", n_positions=64, vocab_size=64))

    config = build_ds_config(1, precision="bf16", micro_batch_size=2, settings=ConfigSettings(scheduler=None))
    kw = dict(runtime=cpu, steps=1, measure=MeasureSettings(progress=False, untimed_steps=0))
    assert cpu.precision == "fp32"
    assert train_run("bf16", factory, tiny_blocks(16), ds_config=config, **kw).precision == "bf16"
    assert train_run("plain", factory, tiny_blocks(16), ds_config=config, plain_pytorch=True, **kw).precision == "fp32"


@pytest.mark.parametrize("kwargs, fix", [
    (dict(steps=120, eval_every=20, compare_steps=3), dict(steps=120, eval_every=20, compare_steps=4)),
    (dict(steps=10, eval_every=20), dict(steps=10, eval_every=5)),
    (dict(steps=1, eval_every=20), dict(steps=40, eval_every=20)),
    (dict(steps=1, eval_every=0), dict(steps=2, eval_every=1)),
    (dict(steps="5"), dict(steps=5)),
])
def test_notebook_01s_step_counts_are_refused_with_a_fix_that_passes(kwargs, fix):
    """helpers.check_run_lengths (notebook 01's settings cell): every refusal names the fix, and the fix passes."""
    from helpers.checks import check_run_lengths

    with pytest.raises(ValueError, match="Fix:"):
        check_run_lengths(**kwargs)
    check_run_lengths(**fix)



@pytest.mark.parametrize("seq_len, max_positions, says", [
    (2048, 1024, "longer than the model's 1,024 positions"),  # passed cells 6-12, then torch's IndexError
    (0, 1024, "at least 2"), ("512", 1024, "(no quotes)"), (1, 1024, "at least 2"), (512.0, 1024, "(an int)"),
    (True, 1024, "at least 2"), (-3, None, "at least 2"), (600, 256, "positions"),
])
def test_notebook_01s_block_length_is_refused_up_front_with_a_fix_that_passes(seq_len, max_positions, says):
    """Issue 52: SEQ_LEN beyond GPT-2's 1,024 positions, 0, '512' or 1 failed late (in the fine-tune or the packing);
    check_run_lengths refuses them in the settings cell, and the SEQ_LEN its message names passes."""
    import re

    from helpers.checks import check_run_lengths

    with pytest.raises(ValueError, match="Fix: SEQ_LEN = ") as refused:
        check_run_lengths(steps=120, seq_len=seq_len, max_positions=max_positions)
    assert says in str(refused.value), str(refused.value)
    fix = int(re.search(r"Fix: SEQ_LEN = (\d+)", str(refused.value)).group(1))
    check_run_lengths(steps=120, seq_len=fix, max_positions=max_positions)
    check_run_lengths(steps=120, seq_len=1024, max_positions=1024)  # the longest GPT-2 takes
    check_run_lengths(steps=120, seq_len=4096, max_positions=0)  # positions not known: not checked

# ---- issue 41 item 3: silent wrong numbers


def test_evaluate_refuses_no_batches_and_no_blocks_and_uses_fewer_blocks_than_a_batch(cpu):
    """'validation 0.000' came from eval_batches=0 or fewer validation blocks than the micro-batch."""
    from transformers import AutoModelForCausalLM

    from helpers.models import gpt2_config
    from helpers.train import evaluate

    model = AutoModelForCausalLM.from_config(gpt2_config("gpt2-tiny", n_positions=64, vocab_size=64))
    with pytest.raises(ConfigError, match=r"eval_batches must be a positive integer \(got 0\).*Fix: eval_batches=4"):
        evaluate(model, tiny_blocks(16, 8), cpu, batches=0, batch_size=4)
    with pytest.raises(ValueError, match="no validation blocks.*Fix: "):
        evaluate(model, tiny_blocks(16, 0), cpu, batches=4, batch_size=4)
    loss = evaluate(model, tiny_blocks(16, 3), cpu, batches=4, batch_size=4)  # 3 blocks, micro-batch 4
    assert loss > 1.0  # a real loss of a random model over 64 tokens (ln 64 = 4.2), not 0.0


def test_a_t4_budget_that_is_not_a_bool_is_refused_with_a_fix_that_passes():
    """T4_BUDGET = 'no' was taken as True."""
    from helpers.hardware import t4_budget_requested

    for bad, fix in [("no", False), ("yes", True), (1, True), ("False", False)]:
        with pytest.raises(ValueError, match=rf"T4_BUDGET = {re.escape(repr(bad))}: .*Fix: T4_BUDGET = {fix}$"):
            t4_budget_requested(bad)
        assert t4_budget_requested(fix) is fix


@pytest.mark.slow
def test_a_run_shorter_than_its_warm_up_times_its_last_step_not_none(cpu, clean_dist_env):
    """train_run with untimed_steps >= steps reported 0 tokens/s; now it times the last step and says so."""
    from transformers import AutoModelForCausalLM

    from helpers.models import gpt2_config
    from helpers.train import MeasureSettings, train_run

    config = build_ds_config(0, precision="fp32", micro_batch_size=2, settings=ConfigSettings(scheduler=None))
    r = train_run("short", lambda: AutoModelForCausalLM.from_config(gpt2_config("gpt2-tiny", n_positions=64,
                                                                                vocab_size=64)),
                  tiny_blocks(32), runtime=cpu, ds_config=config, plain_pytorch=True, steps=2,
                  measure=MeasureSettings(untimed_steps=2, progress=False))
    assert r.tokens_per_s > 0 and r.extras["timed_steps"] == 1


# ---- issue 41 item 6's rest: benchmarks refuse up front


def _benchmark(name, monkeypatch):
    import importlib

    from conftest import ROOT, load_script

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = load_script(ROOT / "benchmarks" / f"{name}.py", f"bench_{name}")
    return module, importlib.import_module("_bench")  # imported here when the benchmark imports it only later


@pytest.mark.slow
def test_stages_refuses_a_seq_len_longer_than_the_model_takes_naming_the_longest_that_works(monkeypatch, capsys,
                                                                                             tmp_path):
    import helpers

    stages, bench = _benchmark("stages", monkeypatch)
    monkeypatch.setattr(helpers, "detect_runtime", lambda *a, **k: pytest.fail("nothing may run"))
    for argv, fix in ((["--seq-len", "100000"], "--seq-len 1024"), (["--seq-len", "0"], "--seq-len 512"),
                      (["--steps", "0"], "--steps 20")):
        with pytest.raises(SystemExit) as exit_:
            stages.main(["--sizes", "gpt2-tiny", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"Fix: {fix}" in err, err
    with pytest.raises(SystemExit):
        stages.main(["--sizes", "gpt2-tiny", "--seq-len", "100000"])
    assert "longer than gpt2-tiny takes (1024 positions" in capsys.readouterr().err
    # the fix passes the same check
    import argparse

    p = argparse.ArgumentParser()
    bench.add_run_options(p, out=tmp_path / "out.json", work_dir=tmp_path)
    bench.check_run_options(p, p.parse_args(["--seq-len", "1024"]), ["gpt2-tiny"])


def test_nvme_buffers_refuses_a_file_as_its_nvme_path_with_a_folder_that_passes(tmp_path, monkeypatch, capsys):
    import subprocess

    nvme_buffers, _ = _benchmark("nvme_buffers", monkeypatch)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("no setting may run"))
    a_file = tmp_path / "nvme"
    a_file.write_text("a file")
    with pytest.raises(SystemExit) as exit_:
        nvme_buffers.main(["--nvme-path", str(a_file)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "is a file, not a folder" in err, err
    fix = re.search(r"--nvme-path='([^']+)'", err).group(1)
    from helpers.config import _nvme_folder_to_make

    assert _nvme_folder_to_make(fix) == __import__("pathlib").Path(fix) and fix != str(a_file)
