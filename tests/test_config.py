import copy
import json
import os
import re
import shutil

import pytest

from conftest import ROOT
from helpers.config import (COURSE_CONFIGS, ConfigError, ConfigSettings, build_ds_config, check_nvme_path,
                            course_config, validate_ds_config, write_course_configs)


def test_stage2_fp16_contents(t4):
    c = build_ds_config(2, runtime=t4, micro_batch_size=8, grad_accum_steps=4)
    assert "train_batch_size" not in c and c["train_micro_batch_size_per_gpu"] == 8  # DeepSpeed derives it
    assert c["gradient_accumulation_steps"] == 4
    assert c["fp16"]["enabled"] is True and c["fp16"]["loss_scale"] == 0 and "bf16" not in c
    assert c["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in c["zero_optimization"]
    assert c["optimizer"]["type"] == "AdamW" and c["optimizer"]["params"]["torch_adam"] is True
    assert c["gradient_clipping"] == 1.0 and c["scheduler"]["type"] == "WarmupLR"


def test_precision_auto_follows_runtime(t4, a100, cpu):
    assert "fp16" in build_ds_config(1, runtime=t4)
    assert build_ds_config(1, runtime=a100)["bf16"] == {"enabled": True}
    c = build_ds_config(1, runtime=cpu)
    assert "fp16" not in c and "bf16" not in c


def test_world_size_multiplies_the_global_batch():
    assert build_ds_config(1, precision="fp32", micro_batch_size=2, grad_accum_steps=3,
                           settings=ConfigSettings(world_size=4))["train_batch_size"] == 24


def test_offload_sections(tmp_path):
    c = build_ds_config(2, precision="fp16", offload_optimizer="cpu")
    assert c["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "torch_adam" not in c["optimizer"]["params"]  # DeepSpeedCPUAdam does the offloaded step
    c = build_ds_config(3, precision="fp16", offload_optimizer="nvme", offload_param="nvme", nvme_path=str(tmp_path),
                        settings=ConfigSettings(nvme_buffer_count=16, nvme_buffer_size=2 * 10**8))
    z = c["zero_optimization"]
    assert z["offload_param"]["nvme_path"] == str(tmp_path) and z["offload_param"]["buffer_count"] == 16
    assert z["offload_param"]["buffer_size"] == 2 * 10**8 and z["offload_optimizer"]["device"] == "nvme"
    assert c["aio"]["block_size"] == 1_048_576
    assert z["stage3_gather_16bit_weights_on_model_save"] is True


def test_scheduler_and_checkpointing_options():
    c = build_ds_config(2, precision="fp32",
                        settings=ConfigSettings(scheduler="WarmupDecayLR", total_steps=100, warmup_steps=5,
                                                activation_checkpointing=True, gradient_clipping=None))
    assert c["scheduler"]["params"]["total_num_steps"] == 100 and "gradient_clipping" not in c
    assert "activation_checkpointing" in c
    assert "scheduler" not in build_ds_config(2, precision="fp32", settings=ConfigSettings(scheduler=None))


@pytest.mark.parametrize("name", sorted(COURSE_CONFIGS))
def test_every_course_config_passes_deepspeed_validation(name):
    validate_ds_config(course_config(name))


def test_deepspeed_validation_rejects_what_the_builder_cannot_see():
    c = build_ds_config(2, precision="fp32")
    c["train_batch_size"] = 7
    with pytest.raises(ConfigError, match="train_batch_size is not equal"):
        validate_ds_config(c)
    c = build_ds_config(2, precision="fp32")
    c["zero_optimization"]["no_such_option"] = 1
    with pytest.raises(ConfigError, match="no_such_option"):
        validate_ds_config(c)


# ---- one test per bad input, each checking that the message says the fix

def test_unknown_stage():
    with pytest.raises(ConfigError, match=r"ZeRO stage must be 0, 1, 2 or 3 \(got 4\).*Fix: pass stage=0..3"):
        build_ds_config(4, precision="fp32")


def test_param_offload_below_stage_3():
    with pytest.raises(ConfigError, match=r"Parameter offload needs ZeRO stage 3 \(got stage 2\).*Fix: stage=3"):
        build_ds_config(2, precision="fp16", offload_param="cpu")


def test_optimizer_offload_at_stage_0():
    with pytest.raises(ConfigError, match="Optimizer offload needs ZeRO stage 1, 2 or 3.*Fix: stage=2"):
        build_ds_config(0, precision="fp16", offload_optimizer="cpu")


def test_bf16_on_a_gpu_without_native_bf16(t4):
    with pytest.raises(ConfigError, match=r"Tesla T4 \(compute capability 7.5\) has no native bf16.*"
                                          r"Fix: precision='fp16'"):
        build_ds_config(2, precision="bf16", runtime=t4)


def test_bf16_in_t4_budget_mode(a100):
    import dataclasses

    with pytest.raises(ConfigError, match="T4 budget mode.*Fix: precision='fp16'"):
        build_ds_config(2, precision="bf16", runtime=dataclasses.replace(a100, t4_budget=True))


def test_fp16_on_cpu(cpu):
    with pytest.raises(ConfigError, match=r"fp16 is not supported by DeepSpeed on CPU.*Fix: precision='fp32'"):
        build_ds_config(2, precision="fp16", runtime=cpu)


def test_unknown_precision():
    with pytest.raises(ConfigError, match="precision must be one of"):
        build_ds_config(2, precision="int8")


def test_auto_precision_without_runtime():
    with pytest.raises(ConfigError, match="Fix: pass runtime=helpers.detect_runtime()"):
        build_ds_config(2)


def test_nvme_path_not_given():
    with pytest.raises(ConfigError, match="NVMe offload needs a folder.*Fix: nvme_path="):
        build_ds_config(3, precision="fp16", offload_param="nvme")


def test_nvme_path_missing(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=r"does not exist\. Fix: create it first"):
        build_ds_config(3, precision="fp16", offload_optimizer="nvme", nvme_path=str(missing))


def test_nvme_path_not_writable(tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    with pytest.raises(ConfigError, match="is not writable by this user. Fix: pick a folder you own"):
        build_ds_config(3, precision="fp16", offload_param="nvme", nvme_path=str(tmp_path))


def test_nvme_path_too_small(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match=r"GB free but this config needs.*Fix: free disk space"):
        build_ds_config(3, precision="fp16", offload_param="nvme", nvme_path=str(tmp_path),
                        settings=ConfigSettings(nvme_bytes_needed=free * 2))
    assert check_nvme_path(tmp_path, bytes_needed=1) == tmp_path


@pytest.mark.parametrize("field", ["micro_batch_size", "grad_accum_steps", "world_size"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_non_positive_batch_sizes(field, bad):
    fix = f"settings=ConfigSettings\\({field}=1\\)" if field == "world_size" else f"{field}=1"
    with pytest.raises(ConfigError, match=f"{field} must be a positive integer.*Fix: pass {fix} or more"):
        if field == "world_size":
            build_ds_config(2, precision="fp32", settings=ConfigSettings(world_size=bad))
        else:
            build_ds_config(2, precision="fp32", **{field: bad})


def test_unknown_offload_device():
    with pytest.raises(ConfigError, match=r"offload_optimizer must be one of \('none', 'cpu', 'nvme'\)"):
        build_ds_config(2, precision="fp32", offload_optimizer="gpu")


def test_unknown_course_config():
    with pytest.raises(ConfigError, match="unknown course config 'zero9'"):
        course_config("zero9")


def test_course_config_adapts_precision_to_the_runtime(cpu):
    c = course_config("zero2", cpu)
    assert "fp16" not in c and c["zero_optimization"]["stage"] == 2
    assert course_config("zero2")["fp16"]["enabled"] is True


def test_configs_folder_is_the_sources_and_the_trainer_files_derived_from_them(tmp_path):
    """configs/<name>.json are sources (tests/test_config_source.py); the *_trainer.json are derived and committed."""
    committed = sorted(p.name for p in (ROOT / "configs").glob("*.json"))
    written = write_course_configs(tmp_path)
    assert sorted(p.name for p in written) == ["zero2_trainer.json", "zero3_trainer.json"]
    assert committed == sorted([f"{name}.json" for name in COURSE_CONFIGS] + [p.name for p in written])
    for path in written:
        assert (ROOT / "configs" / path.name).read_text() == path.read_text(), "run: python -m helpers.config"


# ---- the one registry of named configs

def test_named_configs_are_the_one_list_every_view_reads():
    from helpers.config import LADDER_CONFIGS, NAMED_CONFIGS, OFFLOAD_KINDS

    assert all(name == c.name for name, c in NAMED_CONFIGS.items())
    assert COURSE_CONFIGS == ("zero0", "zero1", "zero2", "zero3", "zero2_offload_cpu", "zero3_offload_cpu",
                              "zero3_nvme")
    # the ladder's columns, cheapest first: plain PyTorch, then the offload configs pre-flight falls back to
    assert LADDER_CONFIGS == ("plain", "zero2_offload_cpu", "zero3_offload_cpu", "zero3_nvme_optimizer_gpu_params",
                              "zero3_nvme_optimizer", "zero3_nvme_all")
    assert list(OFFLOAD_KINDS) == list(LADDER_CONFIGS[1:])
    assert [n for n, c in NAMED_CONFIGS.items() if c.plain] == ["plain"]
    assert len({c.label for c in NAMED_CONFIGS.values()}) == len(NAMED_CONFIGS), "labels tell configs apart"
    # the labels notebook 02 and reports/gpu_check.json key their rows by
    assert NAMED_CONFIGS["zero3_nvme_optimizer_gpu_params"].label == "ZeRO-3, params on GPU, optimizer on NVMe"
    assert NAMED_CONFIGS["zero3_nvme_all"].label == "ZeRO-3, params+optimizer on NVMe"
    with pytest.raises(TypeError):
        NAMED_CONFIGS["zero2"].kwargs["stage"] = 3  # a shared entry cannot be changed by one caller


@pytest.mark.parametrize("name", ["plain", "zero2", "zero3_offload_cpu", "zero3_nvme_optimizer_gpu_params",
                                  "zero3_nvme_all"])
def test_course_config_builds_every_named_config_as_its_kwargs_say(name, cpu):
    from helpers.config import NAMED_CONFIGS

    named = NAMED_CONFIGS[name]
    c = validate_ds_config(course_config(name, nvme_path="/nvme"))
    zero = c["zero_optimization"]
    assert zero["stage"] == named.kwargs["stage"]
    assert zero.get("offload_optimizer", {}).get("device", "none") == named.devices[0]
    assert zero.get("offload_param", {}).get("device", "none") == named.devices[1]
    assert ("aio" in c) == named.uses_nvme and c["fp16"]["enabled"] is True
    assert "fp16" not in course_config(name, cpu, nvme_path="/nvme")  # precision follows the runtime


def test_offload_config_refuses_a_name_that_is_not_an_offload_config(t4):
    from helpers.config import offload_config

    with pytest.raises(ConfigError, match="unknown offload config 'zero2'"):
        offload_config("zero2", t4)


# ---- the configs/ files run on any number of GPUs (issue 52): no train_batch_size written for one GPU

class _DataParallelStandIn:
    """The one thing DeepSpeedConfig asks a model-parallel unit (mpu) for here: the data-parallel world size."""

    def __init__(self, world):
        self.world = world

    def get_data_parallel_world_size(self):
        return self.world


def deepspeed_batch_check(config, world, monkeypatch):
    """DeepSpeed 0.19.8's own DeepSpeedConfig as on `world` data-parallel ranks: _configure_train_batch_size derives
    the batch sizes a config leaves out, then _batch_assertion checks train_batch_size = micro x accumulation x world."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    # without a process group DeepSpeedConfig takes world 1 whatever the mpu says: give it a rank
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *args, **kwargs: 0)
    return DeepSpeedConfig(copy.deepcopy(config), mpu=_DataParallelStandIn(world))


def trainer_filled(config, world, monkeypatch, tmp_path, micro_batch=4, steps=10):
    """What transformers' Trainer hands DeepSpeed on `world` GPUs: HfTrainerDeepSpeedConfig filled from
    TrainingArguments (world size patched); its ValueError lists every concrete value that disagrees."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from helpers.runtime import reset_hf_deepspeed_state

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: world))
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=micro_batch,
                             max_steps=steps, warmup_steps=1, report_to="none")
    try:
        hf = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, None, steps)
        return hf.config
    finally:
        reset_hf_deepspeed_state()  # the config object registers itself globally


@pytest.mark.parametrize("world", [1, 2, 8])
def test_every_configs_file_passes_deepspeeds_batch_check_on_any_number_of_gpus(world, monkeypatch, tmp_path):
    files = sorted((ROOT / "configs").glob("*.json"))
    assert [p.name for p in files if p.stem.endswith("_trainer")] == ["zero2_trainer.json", "zero3_trainer.json"]
    for path in files:
        config = json.loads(path.read_text())
        if path.stem.endswith("_trainer"):  # Trainer's form: DeepSpeed gets it once Trainer has filled the "auto"s
            assert config["train_batch_size"] == "auto", path.name
            config = trainer_filled(config, world, monkeypatch, tmp_path)
            assert config["train_batch_size"] == world * config["train_micro_batch_size_per_gpu"], path.name
        else:
            assert "train_batch_size" not in config, path.name  # DeepSpeed derives it for the world it runs in
        ds = deepspeed_batch_check(config, world, monkeypatch)
        assert ds.world_size == world, path.name
        assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * world


def test_the_batch_check_sees_the_world_size(monkeypatch):
    """The stand-in really sets DeepSpeed's world: a train_batch_size written for one GPU (configs/ before issue 52)
    passes on one and fails on two; build_ds_config writes it only when told the world size."""
    config = build_ds_config(2, precision="fp32", micro_batch_size=4, settings=ConfigSettings(world_size=1))
    assert config["train_batch_size"] == 4
    assert deepspeed_batch_check(config, 1, monkeypatch).train_batch_size == 4
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_batch_check(config, 2, monkeypatch)
    assert deepspeed_batch_check(build_ds_config(2, precision="fp32"), 2, monkeypatch).train_batch_size == 8


def test_the_trainer_file_notebook_04_passes_is_accepted_by_trainer_on_two_gpus(monkeypatch, tmp_path):
    """Section 8 of notebook 04 hands a configs/<name>_trainer.json to the launched Trainer program, as it is: with
    the notebook's micro-batch on 2 GPUs transformers fills it without a mismatch (the concrete file with its old
    train_batch_size of 4 was refused there: 4 vs 8)."""
    import nbformat

    path = next(p for p in (ROOT / "notebooks" / "drafts" / "04_hf_trainer_and_accelerate.ipynb",
                            ROOT / "notebooks" / "04_hf_trainer_and_accelerate.ipynb") if p.exists())
    code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    micro_batch = int(re.search(r"^MICRO_BATCH = (\d+)", code, re.MULTILINE).group(1))
    passed = re.findall(r'"configs" / "(\w+\.json)"', code)
    trainer_files = [name for name in passed if name.endswith("_trainer.json")]
    assert trainer_files, f"{path.name} passes no configs/*_trainer.json to its launch commands: {passed}"
    assert re.search(r'"--deepspeed", trainer_file', code), "the commands must pass the Trainer file"
    for name in trainer_files:
        filled = trainer_filled(json.loads((ROOT / "configs" / name).read_text()), 2, monkeypatch, tmp_path,
                                micro_batch=micro_batch)
        assert filled["train_batch_size"] == 2 * micro_batch
        assert deepspeed_batch_check(filled, 2, monkeypatch).train_batch_size == 2 * micro_batch
    old = {**json.loads((ROOT / "configs" / trainer_files[0]).read_text()), "train_batch_size": micro_batch}
    with pytest.raises(ValueError, match="train_batch_size"):
        trainer_filled(old, 2, monkeypatch, tmp_path, micro_batch=micro_batch)


def test_every_key_of_the_course_configs_has_a_one_line_meaning(tmp_path):
    """Issue 52 item 7: notebook 01 shows configs/zero2.json key by key (helpers.explain_config); every key any of the
    course's configs uses (configs/*.json, and build_ds_config's options: offload, NVMe, bf16, checkpointing,
    WarmupDecayLR) has its line, and an unknown key points to DeepSpeed's reference instead of passing unnoticed."""
    from helpers.config import CONFIG_KEYS, CONFIG_REFERENCE, NAMED_CONFIGS, _leaves, course_config, explain_config

    configs = [json.loads(p.read_text()) for p in sorted((ROOT / "configs").glob("*.json"))]
    assert len(configs) >= 7
    for name in NAMED_CONFIGS:
        configs.append(course_config(name, None, nvme_path=str(tmp_path), activation_checkpointing=True))
    configs.append(course_config("zero2", None, precision="bf16", scheduler="WarmupDecayLR", total_steps=100))
    missing = sorted({k for c in configs for k, _ in _leaves(c)} - set(CONFIG_KEYS))
    assert missing == [], missing
    text = explain_config(configs[0])
    assert "not one of the course's keys" not in text and CONFIG_REFERENCE in text
    shown = explain_config(json.loads((ROOT / "configs" / "zero2.json").read_text()))
    for key in ("overlap_comm = false", "contiguous_gradients = true", "reduce_bucket_size = 50000000",
                "allgather_bucket_size", "initial_scale_power = 16", "hysteresis = 2", "warmup_num_steps"):
        assert key in shown, key
    assert "made_up = 1" in explain_config({"zero_optimization": {"made_up": 1}})
    assert f"not one of the course's keys: see {CONFIG_REFERENCE}" in explain_config({"made_up": 1})
