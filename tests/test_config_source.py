"""configs/*.json are the source of the course's named configs (helpers.config: `_arguments_of`, `_file_source`).

tests/data/named_configs_snapshot.json holds what course_config / offload_config gave for every named config (no
runtime: the Colab T4 fp16 of configs/; a CPU runtime; the Colab T4 profile) when NAMED_CONFIGS' literal keyword
arguments were the source. It was written by `_snapshot` below from that code, before the files became the source,
and is compared, not regenerated: a change that alters any config the notebooks get fails here. Regenerate it
(`python tests/test_config_source.py`) only for a deliberate change of the course's configs, and say so.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, fake_runtime
from helpers import colab_t4_profile
from helpers.config import (_BUILD_DEFAULTS, COURSE_CONFIGS, NAMED_CONFIGS, OFFLOAD_KINDS, ConfigError, _arguments_of,
                            _split_arguments, build_ds_config, course_config, offload_config, trainer_ds_config,
                            write_course_configs)

SNAPSHOT = ROOT / "tests" / "data" / "named_configs_snapshot.json"
NVME = "<nvme>"  # the NVMe folder's path in the snapshot (a temporary folder when it is taken)
# GPT-2 124M: its largest tensor (the 50257 x 768 embedding) sizes NVMe parameter buffers; n_params only sizes the
# free-space check, not the config
LARGEST_PARAM, N_PARAMS = 38_597_376, 10_000_000


def _cpu():
    return fake_runtime(device="cpu", gpu_name=None, compute_capability=None, gpu_total_bytes=0,
                        vram_budget_bytes=0, ram_total_bytes=int(24e9), ram_budget_bytes=int(24e9),
                        gpu_count=0, is_colab=False, precision="fp32")


def _snapshot(nvme_dir: Path) -> dict[str, dict]:
    """{"<call>": the config it gives} for every named config and offload kind, `nvme_dir` written as NVME."""
    runtimes = {"cpu": _cpu(), "t4": colab_t4_profile()}
    out: dict[str, dict] = {}
    for name, named in NAMED_CONFIGS.items():
        path = {"nvme_path": "/nvme"} if named.uses_nvme and "nvme_path" not in named.kwargs else {}
        out[f"course_config({name!r})"] = course_config(name, **path)
        for label, runtime in runtimes.items():
            out[f"course_config({name!r}, {label})"] = course_config(name, runtime, **path)
    for label, runtime in runtimes.items():
        out[f"course_config('zero2', {label}, micro_batch_size=8, lr=3e-4)"] = course_config(
            "zero2", runtime, micro_batch_size=8, lr=3e-4)
        for kind in OFFLOAD_KINDS:
            out[f"offload_config({kind!r}, {label})"] = offload_config(
                kind, runtime, largest_param=LARGEST_PARAM, n_params=N_PARAMS, nvme_path=str(nvme_dir))
    return json.loads(json.dumps(out).replace(json.dumps(str(nvme_dir))[1:-1], NVME))


def test_every_named_config_is_what_it_was_before_the_files_became_the_source(tmp_path):
    """Byte for byte (key order and JSON types included) what the notebooks got from NAMED_CONFIGS' literals."""
    expected = json.loads(SNAPSHOT.read_text())
    got = _snapshot(tmp_path)
    assert list(got) == list(expected)
    for call, config in got.items():
        assert json.dumps(config, indent=2) == json.dumps(expected[call], indent=2), call


# ---- the files are the source: the round trip

@pytest.mark.parametrize("name", COURSE_CONFIGS)
def test_build_ds_config_writes_each_source_file_exactly_from_the_arguments_read_back(name):
    path = ROOT / "configs" / f"{name}.json"
    text = path.read_text()
    args = _arguments_of(json.loads(text), str(path))
    assert args["precision"] == "fp16"  # the Colab T4 target
    assert json.dumps(build_ds_config(**_split_arguments({**args, "check_paths": False})), indent=2) + "\n" == text
    source = NAMED_CONFIGS[name].source
    assert source.settings == ()  # the course's files set nothing beyond build_ds_config's arguments
    assert dict(source.kwargs) == {k: v for k, v in args.items() if k == "stage" or (
        k != "precision" and v != _BUILD_DEFAULTS[k])}


def test_only_entries_without_a_file_give_their_arguments_in_named_configs():
    for name, named in NAMED_CONFIGS.items():
        assert (named.source is not None) == named.in_configs_dir == (not named.given), name
    assert all(NAMED_CONFIGS[k].offload for k in OFFLOAD_KINDS)  # the ladder's DeepSpeed columns all offload


def test_import_reads_no_config_file():
    code = "import helpers, helpers.config as c; assert not c._SOURCES; c.NAMED_CONFIGS['zero2'].kwargs; print(len(c._SOURCES))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's helpers, whichever one is installed
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


# ---- a learner's edit of configs/ shows in what the notebooks get

@pytest.fixture
def configs(tmp_path, monkeypatch):
    """A copy of configs/ that helpers.config reads instead; edit(name, change) edits one of its files."""
    folder = tmp_path / "configs"
    shutil.copytree(ROOT / "configs", folder)
    monkeypatch.setattr("helpers.config.CONFIGS_DIR", folder)

    def edit(name, change):
        path = folder / f"{name}.json"
        config = json.loads(path.read_text())
        change(config)
        path.write_text(json.dumps(config, indent=2))
        return path

    edit.folder = folder
    return edit


def test_an_edited_bucket_size_and_learning_rate_show_in_course_config(configs):
    before = course_config("zero2")

    def change(c):
        c["zero_optimization"]["reduce_bucket_size"] = 20_000_000  # a fixed default of build_ds_config
        c["optimizer"]["params"]["lr"] = c["scheduler"]["params"]["warmup_max_lr"] = 3e-4  # an argument

    configs("zero2", change)
    for c in (course_config("zero2"), course_config("zero2", _cpu()), course_config("zero2", colab_t4_profile())):
        assert c["zero_optimization"]["reduce_bucket_size"] == 20_000_000
        assert c["optimizer"]["params"]["lr"] == c["scheduler"]["params"]["warmup_max_lr"] == 3e-4
    assert NAMED_CONFIGS["zero2"].kwargs == {"stage": 2, "lr": 3e-4}
    assert course_config("zero2", lr=1e-3)["scheduler"]["params"]["warmup_max_lr"] == 1e-3  # an override wins
    after = course_config("zero2")
    after["zero_optimization"]["reduce_bucket_size"] = 50_000_000
    after["optimizer"]["params"]["lr"] = after["scheduler"]["params"]["warmup_max_lr"] = 1e-4
    assert after == before  # nothing else moved
    trainer = json.loads(write_course_configs(configs.folder)[0].read_text())
    assert trainer["zero_optimization"]["reduce_bucket_size"] == 20_000_000 and trainer["optimizer"]["params"]["lr"] == "auto"


def test_keys_build_ds_config_does_not_write_are_carried_and_checked_by_deepspeed(configs, monkeypatch):
    from helpers import config as config_module

    def change(c):
        c["wall_clock_breakdown"] = True
        c["steps_per_print"] = 10
        c["train_micro_batch_size_per_gpu"] = 2
        c["zero_optimization"]["round_robin_gradients"] = True
        c["fp16"]["consecutive_hysteresis"] = True
        c["flops_profiler"] = {"enabled": False, "profile_step": 5}

    configs("zero2", change)
    checked = []
    real = config_module.validate_ds_config
    monkeypatch.setattr(config_module, "validate_ds_config", lambda c: checked.append(1) or real(c))
    c = course_config("zero2")
    assert c["wall_clock_breakdown"] is True and c["steps_per_print"] == 10 and c["train_micro_batch_size_per_gpu"] == 2
    assert c["zero_optimization"]["round_robin_gradients"] is True and c["fp16"]["consecutive_hysteresis"] is True
    assert c["flops_profiler"] == {"enabled": False, "profile_step": 5} and checked == [1]
    cpu = course_config("zero2", _cpu(), micro_batch_size=8)
    assert "fp16" not in cpu and cpu["flops_profiler"]["profile_step"] == 5  # fp16's settings leave with fp16
    assert cpu["train_micro_batch_size_per_gpu"] == 8  # the override wins over the file
    assert "round_robin_gradients" in course_config("zero2", stage=1)["zero_optimization"]
    checked.clear()
    course_config("zero3")  # a file that sets nothing more: build_ds_config's output, no DeepSpeed import
    assert checked == []


def test_an_offload_files_edit_shows_in_offload_config(configs, tmp_path):
    def change(c):
        c["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
        c["zero_optimization"]["offload_param"]["pin_memory"] = True
        c["zero_optimization"]["stage3_max_reuse_distance"] = 0

    configs("zero3_offload_cpu", change)
    c = offload_config("zero3_offload_cpu", _cpu(), largest_param=LARGEST_PARAM, n_params=N_PARAMS)
    zero = c["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is zero["offload_param"]["pin_memory"] is True
    assert zero["stage3_max_reuse_distance"] == 0 and OFFLOAD_KINDS["zero3_offload_cpu"]["pin_memory"] is True
    configs("zero2_offload_cpu", lambda c: c.update(train_micro_batch_size_per_gpu=2))
    # the planner and the capstone still know the kinds, by stage and devices (`plan` takes no micro-batch from them)
    from helpers.planner import config_kind

    assert NAMED_CONFIGS["zero2_offload_cpu"].kwargs["micro_batch_size"] == 2
    assert NAMED_CONFIGS["zero2_offload_cpu"].placement == {"stage": 2, "offload_optimizer": "cpu"}
    assert config_kind(c) == "zero3_offload_cpu" and config_kind(course_config("zero2_offload_cpu")) == "zero2_offload_cpu"


def test_a_typo_the_file_carries_is_refused_by_deepspeeds_schema(configs):
    configs("zero2", lambda c: c["zero_optimization"].update(reduce_bucket_sise=5))
    with pytest.raises(ConfigError, match="(?s)DeepSpeed rejected this config.*reduce_bucket_sise.*carries what "
                       ".*zero2.json sets.*zero_optimization.reduce_bucket_sise.*git checkout -- configs/zero2.json"):
        course_config("zero2")


@pytest.mark.parametrize("name, change, says", [
    ("zero2", lambda c: c["zero_optimization"].update(stage=7), "ZeRO stage must be 0, 1, 2 or 3 \\(got 7\\).*stage is \"zero_optimization.stage\""),
    ("zero2", lambda c: c["optimizer"]["params"].update(lr=3e-4), '"scheduler.params.warmup_max_lr": 0.0001 disagrees'),
    ("zero3_offload_cpu", lambda c: c["zero_optimization"]["offload_param"].update(pin_memory=True),
     '"zero_optimization.offload_param.pin_memory": true disagrees'),
    ("zero2", lambda c: c["fp16"].update(enabled=False), "fp16 is there but not enabled"),
    ("zero2", lambda c: c.update(train_batch_size=7), '"train_batch_size": 7 is not micro-batch x accumulation'),
    ("zero2", lambda c: c.pop("zero_optimization"), 'has no "zero_optimization"'),
    ("zero2", lambda c: c.update(train_micro_batch_size_per_gpu="auto"), "micro_batch_size must be a positive"),
])
def test_a_file_the_inverse_cannot_express_is_refused_naming_the_file(configs, name, change, says):
    path = configs(name, change)
    with pytest.raises(ConfigError, match=says) as refused:
        course_config(name)
    assert str(path) in str(refused.value) and f"git checkout -- configs/{name}.json" in str(refused.value)


def test_a_broken_or_missing_file_or_folder_is_refused_with_the_fix(configs, monkeypatch, tmp_path):
    (configs.folder / "zero1.json").write_text('{"zero_optimization": {"stage": 1},}')
    with pytest.raises(ConfigError, match="zero1.json' is not valid JSON .*Fix: correct line 1"):
        course_config("zero1")
    (configs.folder / "zero3.json").unlink()
    with pytest.raises(ConfigError, match="cannot read .*zero3.json.*git checkout -- configs/zero3.json"):
        NAMED_CONFIGS["zero3"].kwargs
    monkeypatch.setattr("helpers.config.CONFIGS_DIR", tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="configs folder .*nowhere' is missing.*git checkout -- configs"):
        offload_config("zero2_offload_cpu", _cpu())
    assert course_config("zero3_nvme_all", nvme_path="/nvme")  # an entry without a file needs no folder


def test_trainer_files_follow_their_source(configs):
    assert trainer_ds_config(course_config("zero3"))["zero_optimization"]["stage"] == 3
    configs("zero3", lambda c: c["zero_optimization"].update(stage3_param_persistence_threshold=1000))
    written = {p.name: json.loads(p.read_text()) for p in write_course_configs()}
    assert sorted(written) == ["zero2_trainer.json", "zero3_trainer.json"]
    assert written["zero3_trainer.json"]["zero_optimization"]["stage3_param_persistence_threshold"] == 1000
    assert json.loads((configs.folder / "zero3.json").read_text())["zero_optimization"]["stage"] == 3  # untouched


if __name__ == "__main__":  # regenerate the snapshot (a deliberate change of the course's configs only)
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as folder:
        SNAPSHOT.write_text(json.dumps(_snapshot(Path(folder)), indent=1) + "\n")
    print("wrote", SNAPSHOT)
