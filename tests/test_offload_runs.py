"""helpers.OffloadRuns (notebook 02): the complete configs it runs, and the RAM account whose rows add up to the verdict
it prints (issue 52 item 3), computed at the sizes it is given (the Colab what-if never at a CPU run's smoke size)."""
import os
import re

from pathlib import Path

import pytest

import helpers
from conftest import fake_runtime

GB = 1e9


@pytest.fixture
def runs(tmp_path):
    return helpers.OffloadRuns(fake_runtime(), tmp_path, nvme_path=tmp_path / "nvme", seq_len=512, micro_batch=2,
                               steps=4, lr=3e-4)


def _columns(table: str) -> tuple[dict[str, list[float]], list[float], list[float], list[str]]:
    """rows -> values per column ('-' as 0), the total row, the limit row, the verdict row."""
    rows, total, limit, verdict = {}, [], [], []
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if line.startswith("total"):
            total = [float(x) for x in cells[1:]]
        elif line.startswith("must stay under"):
            limit = [float(x) for x in cells[1:]]
        elif line.startswith("verdict"):
            verdict = cells[1:]
        elif len(cells) == 6 and all(re.fullmatch(r"-|\d+\.\d\d", c) for c in cells[1:]) and \
                not line.startswith("on NVMe"):
            rows[cells[0]] = [0.0 if c == "-" else float(c) for c in cells[1:]]
    return rows, total, limit, verdict


def test_the_ram_account_adds_up_to_its_verdict_for_each_config(runs):
    table = runs.ram_account(helpers.colab_t4_profile(), "gpt2-large", ram_in_use=int(2.6e9))
    rows, total, limit, verdict = _columns(table)
    assert len(total) == len(limit) == len(verdict) == 5 and "this kernel + a fresh child" in rows
    for i in range(5):
        assert abs(sum(r[i] for r in rows.values()) - total[i]) <= 0.03, (i, table)
        assert verdict[i] == ("fits" if total[i] <= limit[i] else "refused"), (i, table)
    # on Colab: both CPU offloads are refused, the NVMe optimizer with the parameters on the GPU fits
    assert verdict[:3] == ["refused", "refused", "fits"], table
    # ZeRO-3's CPU column holds the fp16 parameters and more gradient bytes than ZeRO-2's
    assert rows["parameters"][1] > 0 == rows["parameters"][0]
    assert rows["gradients"][1] > rows["gradients"][0]
    assert "GiB of GPU memory, budget 14.34 GiB" in table  # the VRAM budget printed from helpers.T4_VRAM_GIB


def test_the_colab_what_if_uses_the_sizes_it_is_given_not_the_runs(runs, tmp_path):
    smoke = helpers.OffloadRuns(fake_runtime(), tmp_path, nvme_path=tmp_path / "nvme", seq_len=32, micro_batch=2,
                                steps=4, lr=1e-3)
    colab = helpers.colab_t4_profile()
    at_colab_size = smoke.ram_account(colab, "gpt2-large", seq_len=512, micro_batch=2, ram_in_use=int(2e9))
    assert at_colab_size == runs.ram_account(colab, "gpt2-large", ram_in_use=int(2e9))


def test_this_runtimes_account_is_not_printed_again_when_it_is_the_what_if_row_for_row(tmp_path, monkeypatch, capsys):
    """Notebook 02 section 1: in the Colab emulation (or on Colab) choose_model's account for this runtime is the Colab
    what-if printed just before, row for row: it says so in one line instead of a second identical table."""
    colab = helpers.colab_t4_profile()
    runs = helpers.OffloadRuns(colab, tmp_path, nvme_path=tmp_path / "nvme", seq_len=512, micro_batch=2, steps=4,
                               lr=3e-4)
    monkeypatch.setattr(runs, "ram_beside", lambda: int(2.6e9))
    what_if = runs.ram_account(colab, "gpt2-large", ram_in_use=int(2.6e9), title="what-if:")
    assert runs.choose_model("gpt2-large") == "gpt2-large"
    out = capsys.readouterr().out
    assert "the same account, row for row, as the one printed above" in out and "verdict" not in out, out
    # another runtime's account differs (a bigger GPU, more RAM): printed in full
    bigger = fake_runtime(gpu_name="NVIDIA A100-SXM4-40GB", gpu_total_bytes=int(40 * 2**30),
                          vram_budget_bytes=int(40 * 2**30), ram_total_bytes=int(80e9), ram_budget_bytes=int(80e9),
                          is_colab=False)
    other = helpers.OffloadRuns(bigger, tmp_path, nvme_path=tmp_path / "nvme", seq_len=512, micro_batch=2,
                                steps=4, lr=3e-4)
    monkeypatch.setattr(other, "ram_beside", lambda: int(2.6e9))
    other.ram_account(colab, "gpt2-large", ram_in_use=int(2.6e9))
    other.choose_model("gpt2-large")
    out = capsys.readouterr().out
    assert "row for row" not in out and "verdict" in out and what_if.split("\n", 1)[1] not in out


def test_each_config_is_complete_deepspeed_json_with_its_own_nvme_folder(runs, tmp_path):
    shape = helpers.model_shape("gpt2-large")
    for name, kind in runs.configs.items():
        cfg = runs.config(name, "gpt2-large")
        helpers.validate_ds_config(cfg)
        assert cfg["fp16"]["initial_scale_power"] == 12 and cfg["train_micro_batch_size_per_gpu"] == 2
        zero = cfg["zero_optimization"]
        for block in ("offload_optimizer", "offload_param"):
            if zero.get(block, {}).get("device") == "nvme":
                assert zero[block]["nvme_path"] == str(tmp_path / "nvme" / f"pid-{os.getpid()}" / kind)
                assert "aio" in cfg
    full = runs.config("ZeRO-3, params+optimizer on NVMe", "gpt2-large")["zero_optimization"]["offload_param"]
    assert full["buffer_size"] >= shape.largest_layer_params
    with pytest.raises(ValueError, match="no offload config"):
        runs.config("ZeRO-4", "gpt2-large")


def test_nothing_ran_says_so(runs):
    assert runs.compare().startswith("no config trained here")


def test_a_tilde_nvme_path_is_the_home_folder_and_a_file_is_refused_with_a_folder_that_passes(tmp_path, monkeypatch):
    """Issue 41 item 2: NVME_PATH = '~/nvme' made a folder named '~' in notebooks/ while the config expanded '~'; a
    path that is a file gave a raw FileExistsError."""
    from helpers.checks import ConfigError

    monkeypatch.setenv("HOME", str(tmp_path))
    runs = helpers.OffloadRuns(fake_runtime(), tmp_path / "work", nvme_path="~/nvme", seq_len=32, micro_batch=2,
                               steps=4, lr=1e-3)
    assert runs.nvme_path == tmp_path / "nvme"
    cfg = runs.config("ZeRO-3, optimizer on NVMe", "gpt2-tiny")
    assert cfg["zero_optimization"]["offload_optimizer"]["nvme_path"].startswith(str(tmp_path / "nvme" / "pid-"))
    (tmp_path / "a-file").write_text("not a folder")
    for path in (tmp_path / "a-file", tmp_path / "a-file" / "nvme"):
        with pytest.raises(ConfigError, match=r"is a file, not a folder.*Fix: pick a folder, e.g. NVME_PATH='") as e:
            helpers.OffloadRuns(fake_runtime(), tmp_path, nvme_path=path, seq_len=32, micro_batch=2, steps=4, lr=1e-3)
        fix = re.search(r"NVME_PATH='([^']+)'", str(e.value)).group(1)
        os.makedirs(fix, exist_ok=True)  # what the message says to do first
        assert helpers.OffloadRuns(fake_runtime(), tmp_path, nvme_path=fix, seq_len=32, micro_batch=2, steps=4,
                                   lr=1e-3).nvme_path == Path(fix)


@pytest.mark.slow
def test_two_kernels_on_one_nvme_path_keep_their_own_swap_files(tmp_path, monkeypatch):
    """Issue 41 item 7: two kernels of notebook 02 on one checkout shared build/nvme/<config> and removed each
    other's swap files. Each process (two fake pids here) swaps under <NVMe path>/pid-<pid>/, removes only that,
    and the folder of a process that is gone is removed by the next one that runs."""
    import psutil

    import helpers.fresh_process as fp
    import helpers.runtime as rt
    from helpers.train import RunResult

    base = tmp_path / "nvme"
    alive = {1001, 1002}
    monkeypatch.setattr(psutil, "pid_exists", lambda pid: pid in alive)
    kernels = {}
    for pid in (1001, 1002):
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        kernels[pid] = helpers.OffloadRuns(fake_runtime(), tmp_path / str(pid), nvme_path=base, seq_len=32,
                                           micro_batch=2, steps=4, lr=1e-3)
    name = "ZeRO-3, optimizer on NVMe"
    monkeypatch.setattr(os, "getpid", lambda: 1001)
    a_cfg = kernels[1001].config(name, "gpt2-tiny")
    a_folder = Path(a_cfg["zero_optimization"]["offload_optimizer"]["nvme_path"])
    a_folder.mkdir(parents=True)
    a_file = a_folder / "zero_stage_3" / "optimizer" / "rank0" / "0_27.tensor.swp"
    a_file.parent.mkdir(parents=True)
    a_file.write_bytes(b"\0" * 4096)  # kernel A is mid-run
    seen = {}

    def child(spec):  # kernel B's child: writes its swap file, sees A's
        folder = Path(spec.ds_config["zero_optimization"]["offload_optimizer"]["nvme_path"])
        (folder / "0_1.tensor.swp").write_bytes(b"\0" * 4096)
        seen.update(nvme_path=folder, a_file=a_file.exists())  # the config is the one home of the NVMe path
        return RunResult(name=spec.name, model=spec.model, params=0, config=spec.name, precision="fp16", micro_batch=2,
                         grad_accum=1, seq_len=32, steps=4, checkpointing=True, runtime="fake", error="a fake child")

    monkeypatch.setattr(fp, "train_in_fresh_process", child)
    monkeypatch.setattr(rt, "release_host_memory", lambda: 0)  # this process's RSS (psutil reads the real pid)
    monkeypatch.setattr(os, "getpid", lambda: 1002)
    assert kernels[1002].train(name, "gpt2-tiny") is None  # the fake child "failed": nothing else to judge
    assert seen == {"nvme_path": base / "pid-1002" / kernels[1002].kind(name), "a_file": True}
    assert a_file.exists() and not (base / "pid-1002").exists()  # B removed only its own folder
    alive.discard(1001)  # kernel A is gone (killed mid-run): the next run here removes its folder
    kernels[1002].train(name, "gpt2-tiny")
    assert not (base / "pid-1001").exists() and list(base.iterdir()) == []
