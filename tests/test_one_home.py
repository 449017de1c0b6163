"""Issue 43 item 4, one home per setting: the NVMe path lives only in the DeepSpeed config and no module keeps NVMe
state between checks; the micro-batch has one conflict rule wherever a function takes a config and `micro_batch`."""
from __future__ import annotations

import collections
import os
import shutil

import pytest
import torch

import helpers.config
import helpers.planner
import helpers.train
from helpers.checks import ConfigError
from helpers.config import ConfigSettings, build_ds_config, check_nvme_path
from helpers.memory import estimate_run
from helpers.models import model_shape
from helpers.step_time import estimate_step_time
from helpers.train import (MeasureSettings, _check_nvme_need, _check_nvme_space, _nvme_folders, _nvme_need_by_folder,
                           train_run)

MODULES = (helpers.config, helpers.train, helpers.planner)


def _mutable_globals() -> dict[str, object]:
    """What every module-level dict, list and set of the modules that check NVMe folders holds (its repr)."""
    return {f"{m.__name__}.{k}": repr(v) for m in MODULES for k, v in vars(m).items()
            if isinstance(v, (dict, list, set)) and not k.startswith("__")}


def _small_disk(monkeypatch, folder, free: int) -> None:
    """`folder` on a disk with `free` bytes free; every other path on the real disk."""
    real = shutil.disk_usage
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free)
                        if os.path.realpath(path).startswith(os.path.realpath(folder)) else real(path))


def _nvme_cfg(folder) -> dict:
    return build_ds_config(3, precision="fp32", offload_optimizer="nvme", nvme_path=str(folder),
                           settings=ConfigSettings(check_paths=False))


def test_nvme_checks_keep_no_state_and_each_run_checks_its_own_configs_folder(tmp_path, monkeypatch, cpu):
    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    _small_disk(monkeypatch, small, 10**7)  # 10 MB free; `big` is on the real disk
    before = _mutable_globals()
    # a check with a small estimate passes, and is remembered nowhere: not by the module, not for the next run
    assert check_nvme_path(small, bytes_needed=5 * 10**6) == small
    assert check_nvme_path(big) == big
    with pytest.raises(ConfigError, match="has only 10 MB free"):
        check_nvme_path(small)  # the earlier check of `small` (5 MB) changes nothing
    assert _mutable_globals() == before
    assert not hasattr(helpers.config, "NVME_NEEDS")

    # the folder a run checks is its own config's, nothing beside it
    cfg_small, cfg_big = _nvme_cfg(small), _nvme_cfg(big)
    assert _nvme_folders(cfg_small) == [os.path.realpath(small)]
    assert list(_nvme_need_by_folder(cfg_big, 200_000)) == [os.path.realpath(big)]
    _check_nvme_space(_nvme_folders(cfg_big))  # `small` being full does not touch a run on `big`
    _check_nvme_need(cfg_big, 200_000)
    with pytest.raises(ConfigError, match=r"has only 10 MB free.*Fix: point nvme_path at a disk with at least 1 GB "
                                          r"free\.$"):  # at a run's start only the floor: no model, no estimate yet
        _check_nvme_space(_nvme_folders(cfg_small))
    with pytest.raises(ConfigError, match=r"has 0.01 GB free, but this model \(10.0M parameters\) writes about"):
        _check_nvme_need(cfg_small, 10_000_000)  # from the estimate, at the point of the check
    _check_nvme_need(cfg_big, 10_000_000)  # the other folder's refusal left nothing behind
    assert _mutable_globals() == before

    # train_run refuses from its own config before building anything, and the refusal names that folder
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)
    blocks = [{"input_ids": torch.zeros(8, dtype=torch.long)} for _ in range(4)]
    with pytest.raises(ConfigError, match=f"{str(small)!r} has only 10 MB free"):
        train_run("small", lambda: pytest.fail("the model must not be built"), blocks, runtime=cpu,
                  ds_config=cfg_small, steps=2, measure=MeasureSettings(progress=False))
    assert "nvme_path" not in __import__("inspect").signature(train_run).parameters  # the config is its one home


def test_one_micro_batch_rule_for_every_function_that_takes_a_config_and_a_micro_batch():
    from helpers.limits import RuntimeLimits

    limits = RuntimeLimits(runtime="test GPU", cpus=2, has_gpu=True, disk_path="/nvme", disk_read_gbps=1.0,
                           disk_write_gbps=1.0, h2d_pinned_gbps=20.0, h2d_pageable_gbps=10.0, d2h_pinned_gbps=20.0,
                           d2h_pageable_gbps=10.0, cpu_adam_params_per_s=1e9, matmul_tflops=100.0,
                           matmul_dtype="fp16")
    shape = model_shape("gpt2")

    def run(cfg, mb):
        return estimate_run(cfg, shape, seq_len=128, precision="fp16", checkpointing=True,
                            micro_batch=mb).activation_bytes

    def step(cfg, mb):
        return estimate_step_time(cfg, shape, limits, seq_len=128, micro_batch=mb).tokens_per_micro_batch

    cfg = build_ds_config(2, precision="fp16", micro_batch_size=4)
    for name, estimate in (("estimate_run", run), ("estimate_step_time", step)):
        with pytest.raises(ConfigError, match=rf"{name}: micro_batch=8 but the config says "
                                              r"train_micro_batch_size_per_gpu=4\. Fix: leave micro_batch out"):
            estimate(cfg, 8)
        assert estimate(cfg, 4) == estimate(cfg, None)  # agreeing, or left out: the config's
        # the fix's other way passes too: the config built with the micro-batch asked for
        assert estimate(build_ds_config(2, precision="fp16", micro_batch_size=8), 8) == 2 * estimate(cfg, None)
        assert estimate(None, 4) > 0  # plain PyTorch: the argument is the micro-batch
        with pytest.raises(ConfigError, match=rf"{name}\(None, \.\.\.\) is plain PyTorch.*Fix: pass micro_batch="):
            estimate(None, None)
