"""helpers.OffloadRuns (notebook 02): the complete configs it runs, and the RAM account whose rows add up to the verdict
it prints (issue 52 item 3), computed at the sizes it is given (the Colab what-if never at a CPU run's smoke size)."""
import re

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
    assert "GiB of GPU memory, budget 14.44 GiB" in table  # the VRAM budget printed from helpers.T4_VRAM_GIB


def test_the_colab_what_if_uses_the_sizes_it_is_given_not_the_runs(runs, tmp_path):
    smoke = helpers.OffloadRuns(fake_runtime(), tmp_path, nvme_path=tmp_path / "nvme", seq_len=32, micro_batch=2,
                                steps=4, lr=1e-3)
    colab = helpers.colab_t4_profile()
    at_colab_size = smoke.ram_account(colab, "gpt2-large", seq_len=512, micro_batch=2, ram_in_use=int(2e9))
    assert at_colab_size == runs.ram_account(colab, "gpt2-large", ram_in_use=int(2e9))


def test_each_config_is_complete_deepspeed_json_with_its_own_nvme_folder(runs, tmp_path):
    shape = helpers.model_shape("gpt2-large")
    for name, kind in runs.configs.items():
        cfg = runs.config(name, "gpt2-large")
        helpers.validate_ds_config(cfg)
        assert cfg["fp16"]["initial_scale_power"] == 12 and cfg["train_micro_batch_size_per_gpu"] == 2
        zero = cfg["zero_optimization"]
        for block in ("offload_optimizer", "offload_param"):
            if zero.get(block, {}).get("device") == "nvme":
                assert zero[block]["nvme_path"] == str(tmp_path / "nvme" / kind)
                assert "aio" in cfg
    full = runs.config("ZeRO-3, params+optimizer on NVMe", "gpt2-large")["zero_optimization"]["offload_param"]
    assert full["buffer_size"] >= shape.largest_layer_params
    with pytest.raises(ValueError, match="no offload config"):
        runs.config("ZeRO-4", "gpt2-large")


def test_nothing_ran_says_so(runs):
    assert runs.compare().startswith("no config trained here")
