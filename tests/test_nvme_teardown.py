"""ZeRO-3 with parameters on NVMe: repeated runs in one process keep RAM (issue 13, item 4) and disk (issue 23,
item 1) flat.

DeepSpeed 0.19.8's parameter swapper takes buffer_count x buffer_size page-locked elements from a process-wide
allocator and never gives them back; `helpers.runtime.release_nvme_swappers` (called by `teardown`) does. Without it
each run here leaves 8 x 10M x 2 bytes = 0.16 GB (measured without it: 0.67 -> 0.83 -> 0.99 GB RSS after 3 runs).

DeepSpeed never deletes its swap files either, and names them by parameter ids that grow with every model built in
the process: each gpt2-tiny all-NVMe run added ~10 MB to the folder (measured before the fix: 11.7 -> 21.3 -> 30.9 MB
after 3 runs; a 110 MB folder filled up and run 10 aborted the process in DeepSpeed's C++ reader). `destroy_engine`
now deletes an engine's files, `train_run` also those of a run stopped before its engine existed.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch


def _aio_available() -> str | None:
    """None if DeepSpeed's async_io op can be built here, else why not."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except Exception as exc:  # pragma: no cover - deepspeed is a requirement
        return f"deepspeed.ops.op_builder not importable: {exc}"
    if not AsyncIOBuilder().is_compatible():
        return "DeepSpeed async_io is not compatible here (libaio missing): NVMe offload unavailable"
    return None


def _locked_bytes() -> int | None:
    """Page-locked (mlock) bytes of this process, from /proc (None where it cannot be read)."""
    try:
        m = re.search(r"Locked:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


AIO_MISSING = _aio_available()


@pytest.mark.slow
@pytest.mark.skipif(AIO_MISSING is not None, reason=str(AIO_MISSING))
def test_repeated_nvme_param_offload_runs_keep_rss_flat(tmp_path, clean_dist_env):
    import helpers
    from helpers.runtime import release_host_memory

    runtime, config, blocks, cfg = _tiny_nvme_run_setup(tmp_path)
    leak_per_run = 8 * cfg["zero_optimization"]["offload_param"]["buffer_size"] * 2  # 8 x 10M x 2 bytes = 0.16 GB
    rss, locked = [], []
    for i in range(3):
        r = helpers.train_run(f"nvme {i}", lambda: helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0), blocks,
                              runtime=runtime, ds_config=cfg, steps=2,
                              measure=helpers.train.MeasureSettings(untimed_steps=1, progress=False))
        assert not r.error, r.error
        rss.append(release_host_memory())
        locked.append(_locked_bytes())
    # the first run loads ops and fills caches once; compare the runs after it
    growth = rss[-1] - rss[0]
    assert growth < leak_per_run / 4, (
        f"RSS after each run {[round(x / 1e9, 3) for x in rss]} GB grew {growth / 1e9:.3f} GB over two runs "
        f"(a leaked swapper is {leak_per_run / 1e9:.2f} GB per run)")
    if locked[0] is not None:  # exact: page-locked memory left after a teardown
        assert locked[-1] - locked[0] < leak_per_run / 4, f"page-locked bytes after each run: {locked}"


def test_release_nvme_swappers_is_a_no_op_without_nvme_offload():
    from helpers.runtime import release_nvme_swappers

    assert release_nvme_swappers(None) == 0
    assert release_nvme_swappers(torch.nn.Linear(4, 4)) == 0


@pytest.mark.slow
@pytest.mark.skipif(AIO_MISSING is not None, reason=str(AIO_MISSING))
def test_tearing_down_one_nvme_run_leaves_another_live_engine_working(tmp_path, clean_dist_env):
    import deepspeed

    import helpers
    from helpers.checkpoints import release_zero3
    from helpers.runtime import setup_single_process, teardown

    runtime = helpers.detect_runtime()
    vocab = 8192  # the embedding (8192 x 64 bf16 = 1 MiB, DeepSpeed's minimum) goes through the swap buffers
    config = helpers.gpt2_config("gpt2-tiny", vocab_size=vocab, n_positions=32)
    largest = helpers.model_shape(config).largest_layer_params

    def nvme_config(folder: str, **run) -> dict:  # each swapper empties its own folder when it is made: one per engine
        (tmp_path / folder).mkdir(exist_ok=True)
        return helpers.config.offload_config("zero3_nvme_all", runtime, largest_param=largest, micro_batch_size=2,
                                      nvme_path=str(tmp_path / folder), **run)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 32), generator=gen)
    blocks = [{"input_ids": row} for row in torch.randint(0, vocab, (8, 32), generator=gen)]
    setup_single_process()
    cfg = nvme_config("live")
    model, keep_alive = helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0)
    ns = {}
    ns["engine"], ns["optimizer"], _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               config=cfg)
    del model, keep_alive

    def step() -> float:
        loss = ns["engine"](input_ids=ids, labels=ids).loss
        ns["engine"].backward(loss)
        ns["engine"].step()
        return float(loss.detach())

    first = step()
    run = dict(lr=3e-4, warmup_steps=1)
    r = helpers.train_run("other", lambda: helpers.checkpoints.build_zero3_model(nvme_config("other", **run), config=config, seed=1),
                          blocks, runtime=runtime, ds_config=nvme_config("other", **run), steps=2,
                          measure=helpers.train.MeasureSettings(untimed_steps=1, progress=False))
    assert not r.error, r.error
    later = [step() for _ in range(2)]  # the live engine still swaps its parameters in and out
    assert all(torch.isfinite(torch.tensor(later))) and later[-1] < first + 0.5, (first, later)
    teardown(ns, "engine", "optimizer")
    release_zero3()


def _tiny_nvme_run_setup(folder):
    """gpt2-tiny, all on NVMe in `folder`: runtime, model config, 8 blocks of 32 tokens, DeepSpeed config."""
    import helpers

    runtime = helpers.detect_runtime()
    vocab, seq_len = 8192, 32  # the embedding (8192 x 64 bf16 = 1 MiB) is the one tensor big enough to go to NVMe
    config = helpers.gpt2_config("gpt2-tiny", vocab_size=vocab, n_positions=seq_len)
    gen = torch.Generator().manual_seed(0)
    blocks = [{"input_ids": torch.randint(0, vocab, (seq_len,), generator=gen)} for _ in range(8)]
    largest = helpers.model_shape(config).largest_layer_params
    cfg = helpers.config.offload_config("zero3_nvme_all", runtime, largest_param=largest, nvme_path=str(folder),
                                 micro_batch_size=2, lr=3e-4, warmup_steps=1)
    return runtime, config, blocks, cfg


@pytest.mark.slow
@pytest.mark.skipif(AIO_MISSING is not None, reason=str(AIO_MISSING))
def test_repeated_nvme_runs_keep_the_folder_flat_and_report_their_own_disk_use(tmp_path, clean_dist_env):
    """Issue 23 item 1: five ZeRO-3 all-NVMe runs of one config on one folder, then one interrupted after a step:
    the folder is as empty after each as before the first, and each run's disk_gb is its own use, not a total."""
    import helpers
    from helpers.memory import folder_bytes
    from helpers.runtime import live_engines

    folder = tmp_path / "nvme"
    folder.mkdir()
    (folder / "notes.txt").write_text("a learner's file stays")
    runtime, config, blocks, cfg = _tiny_nvme_run_setup(folder)
    start = folder_bytes(folder)
    engines_before = {id(e) for e in live_engines()}  # an earlier test's leak is not this test's (CI's full order)
    sizes, disk = [], []
    for i in range(5):
        r = helpers.train_run(f"nvme {i}", lambda: helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0), blocks,
                              runtime=runtime, ds_config=cfg, steps=2,
                              measure=helpers.train.MeasureSettings(untimed_steps=1, progress=False))
        assert not r.error, r.error
        sizes.append(folder_bytes(folder))
        disk.append(r.disk_gb)
    assert sizes == [start] * 5, f"folder bytes after each run {sizes} (before: {start})"
    assert (folder / "notes.txt").exists()
    # the run's own use (the folder's config is measured without nvme_path=): the same for every run
    assert disk[0] > 0.001 and max(disk) - min(disk) <= 0.002, disk

    def stop(step, loss):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        helpers.train_run("interrupted", lambda: helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0), blocks,
                          runtime=runtime, ds_config=cfg, steps=4,
                          measure=helpers.train.MeasureSettings(progress=False, on_step=stop))
    assert folder_bytes(folder) == start and [e for e in live_engines() if id(e) not in engines_before] == []
    leftovers = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    assert leftovers == ["notes.txt"], leftovers


@pytest.mark.slow
@pytest.mark.skipif(AIO_MISSING is not None, reason=str(AIO_MISSING))
def test_teardown_of_a_notebooks_own_nvme_engine_removes_its_swap_files(tmp_path, clean_dist_env):
    """`teardown(globals(), "engine", ...)` (notebook 02 builds engines itself): the engine's swap files go with it.
    DeepSpeed's folders: zero_stage_3/<dtype>params/rank0 (parameters), zero_stage_3/optimizer/rank0 (optimizer)."""
    import deepspeed

    import helpers
    from helpers.checkpoints import release_zero3
    from helpers.runtime import nvme_swap_paths, setup_single_process, teardown

    runtime, config, blocks, cfg = _tiny_nvme_run_setup(tmp_path)
    setup_single_process()
    model, keep_alive = helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0)
    ns = {}
    ns["engine"], ns["optimizer"], _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               config=cfg)
    del model, keep_alive
    ids = torch.stack([b["input_ids"] for b in blocks[:2]])
    loss = ns["engine"](input_ids=ids, labels=ids).loss
    ns["engine"].backward(loss)
    ns["engine"].step()
    del loss
    paths = nvme_swap_paths(ns["engine"])
    folders = {str(Path(p).parent.relative_to(tmp_path)) for p in paths}
    assert {"zero_stage_3/optimizer/rank0"} <= folders and any(f.endswith("params/rank0") for f in folders), folders
    assert all(Path(p).exists() for p in paths)
    teardown(ns, "engine", "optimizer")
    release_zero3()
    assert [p for p in tmp_path.rglob("*.tensor.swp")] == []


@pytest.mark.slow
def test_a_run_is_refused_before_it_starts_when_leftovers_fill_the_folder(tmp_path, monkeypatch):
    """The free-space check runs before every run, not only when the config is built, and names the swap files
    earlier runs left (with the line that removes them), which are then removed by that line."""
    import shutil
    from collections import namedtuple

    import helpers
    from helpers.checks import ConfigError

    runtime, config, blocks, cfg = _tiny_nvme_run_setup(tmp_path)  # built (and checked) while the disk had room
    left = tmp_path / "zero_stage_3" / "optimizer" / "rank0"
    left.mkdir(parents=True)
    for name in ("0_27.tensor.swp", "exp_avg-0_27.tensor.swp", "0_27_gradient_0_524288.tensor.swp"):
        (left / name).write_bytes(b"\0" * 2**20)
    (tmp_path / "mine.txt").write_text("kept")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("helpers.config.shutil.disk_usage", lambda p: usage(10**8, 10**8 - 10**6, 10**6))
    with pytest.raises(ConfigError) as info:
        helpers.train_run("full", lambda: pytest.fail("the model must not be built"), blocks, runtime=runtime,
                          ds_config=cfg, steps=2, measure=helpers.train.MeasureSettings(progress=False))
    message = str(info.value)
    assert "3 DeepSpeed swap files that earlier runs left" in message, message
    assert f"helpers.runtime.remove_nvme_leftovers({str(tmp_path)!r})" in message, message
    freed = helpers.runtime.remove_nvme_leftovers(str(tmp_path))
    assert freed >= 3 * 2**20 and list(tmp_path.rglob("*.tensor.swp")) == [] and (tmp_path / "mine.txt").exists()
    monkeypatch.setattr("helpers.config.shutil.disk_usage", shutil.disk_usage)
