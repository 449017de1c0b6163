import os
from pathlib import Path
import socket
import weakref

import pytest
import torch

from helpers.runtime import DIST_ENV_VARS, free_port, gpu_allocated_bytes, reset_peak_stats, setup_single_process, teardown


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_setup_single_process_sets_the_five_variables(monkeypatch):
    import torch.distributed as dist

    for k in DIST_ENV_VARS:
        monkeypatch.setenv(k, "7")  # registered, so monkeypatch restores the environment afterwards
    if dist.is_initialized():
        assert setup_single_process()["MASTER_PORT"] == "7"  # the existing group keeps its port
    env = setup_single_process(port=None if not dist.is_initialized() else 23456)
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0" and env["LOCAL_RANK"] == "0"
    assert 0 < int(env["MASTER_PORT"]) < 65536 and os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert setup_single_process(port=12345)["MASTER_PORT"] == "12345"


def _train_one_engine(monkeypatch, hidden=64, steps=2, stage=2):
    import deepspeed

    from helpers.config import ConfigSettings, build_ds_config

    for k in DIST_ENV_VARS:  # restored after the test, so notebooks run later get no stale port
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    setup_single_process()
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden))
    dtype = torch.float16 if torch.cuda.is_available() else torch.float32
    cfg = build_ds_config(stage, precision="fp16" if torch.cuda.is_available() else "fp32", micro_batch_size=4,
                          settings=ConfigSettings(scheduler=None))
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(steps):
        x = torch.randn(4, hidden).to(engine.device, dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    return engine, optimizer, model


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_teardown_releases_the_engine_cpu_analogue(monkeypatch, stage):
    # 3 steps: from the second step on, ZeRO-3's parameter coordinator caches per sub-module in a class-wide
    # lru_cache, one of the two DeepSpeed globals that kept every ZeRO-3 engine alive before teardown cleared them
    ns = dict(zip(("engine", "optimizer", "model"), _train_one_engine(monkeypatch, steps=3, stage=stage)))
    ns["keep"] = 1
    refs = [weakref.ref(ns["engine"]), weakref.ref(ns["optimizer"].optimizer), weakref.ref(ns["model"])]
    teardown(ns, "engine", "optimizer", "model", "never_defined")
    assert ns == {"keep": 1}
    assert [r() for r in refs] == [None, None, None]  # engine, torch optimizer and model are gone


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_teardown_brings_gpu_memory_back_to_baseline(monkeypatch):
    reset_peak_stats()  # includes warm_up_cuda: cuBLAS workspaces belong to the baseline
    baseline = gpu_allocated_bytes()
    ns = dict(zip(("engine", "optimizer", "model"), _train_one_engine(monkeypatch, hidden=2048, steps=5)))
    assert gpu_allocated_bytes() > baseline + 2**20
    after = teardown(ns, "engine", "optimizer", "model")
    assert after <= baseline, (baseline, after)


@pytest.mark.slow
def test_mmap_large_allocations_gives_freed_ram_back():
    """In a fresh process: what ran before in pytest's own process (profilers, engines, other tests' heaps) must not
    decide the answer (CI once kept 226 MB after the free in the shared process; alone it gives all of it back)."""
    from conftest import last_line_of_fresh_process

    code = """
import psutil, torch
from helpers.runtime import mmap_large_allocations
assert mmap_large_allocations(1 << 20)
rss = psutil.Process().memory_info().rss
blocks = [torch.ones(2 * 2**20) for _ in range(32)]  # 32 x 8 MiB, each above the 1 MiB threshold
grown = psutil.Process().memory_info().rss - rss
del blocks
kept = psutil.Process().memory_info().rss - rss
print(grown, kept)
"""
    grown, kept = map(int, last_line_of_fresh_process(code).split())
    assert grown > 200 * 2**20 and kept < 32 * 2**20, (grown, kept)  # unmapped on free, not kept by the heap


@pytest.mark.slow
def test_release_host_memory_gives_freed_heap_back():
    """In a fresh process, like the mmap test above: the heap pytest's own process has grown is not what is tested."""
    from conftest import last_line_of_fresh_process

    code = """
import psutil, torch
from helpers.runtime import release_host_memory
rss = release_host_memory()
# 4096 x 64 KiB: heap blocks (below glibc's mmap threshold), keeping a small tensor between each pair so
# the freed space is not only at the heap's top (which glibc would trim by itself)
blocks = [(torch.ones(16 * 1024), torch.ones(16)) for _ in range(4096)]
grown = psutil.Process().memory_info().rss - rss
keep = [small for _, small in blocks]
del blocks
kept = release_host_memory() - rss
print(grown, kept)
"""
    grown, kept = map(int, last_line_of_fresh_process(code).split())
    assert grown > 200 * 2**20 and kept < 48 * 2**20, (grown, kept)


def test_release_zero3_globals_drops_sub_modules_an_interrupted_forward_left():
    """ZeRO-3 pushes each sub-module on FWD_MODULE_STACK before its forward and pops it after: an interrupt in between
    (a learner's stop button) leaves it there, holding the model, its engine and optimizer (notebook 01, issue 13)."""
    import torch
    from deepspeed.runtime.zero import parameter_offload

    from helpers.runtime import release_zero3_globals

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    other = torch.nn.Linear(2, 2)
    saved = list(parameter_offload.FWD_MODULE_STACK)
    try:
        parameter_offload.FWD_MODULE_STACK[:] = [other, model, model[1], model[1][0]]
        release_zero3_globals(model)
        assert parameter_offload.FWD_MODULE_STACK == [other]
    finally:
        parameter_offload.FWD_MODULE_STACK[:] = saved


@pytest.mark.slow
def test_clean_slate_resets_accelerate_only_when_asked(monkeypatch):
    """hf=False leaves Accelerate's and transformers' global state alone (notebooks 00-03 never asked for it)."""
    import transformers.integrations.deepspeed  # noqa: F401 - loaded, as in every notebook that builds HF models

    from helpers.runtime import clean_slate

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    clean_slate({})
    assert os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    assert "Accelerate's and transformers' global state" in clean_slate({}, hf=True)
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ


def test_clean_slate_frees_an_engine_whose_zero3_optimizer_build_was_interrupted(monkeypatch):
    # A learner's stop button landing in the ZeRO-3 optimizer's constructor, while it registers gradient hooks
    # (CI saw it in notebook 02): the engine never got its optimizer, so engine.destroy() cannot remove the hooks,
    # and they kept the engine alive for the rest of the kernel.
    import deepspeed
    import deepspeed.runtime.zero.stage3 as stage3

    from helpers.config import ConfigSettings, build_ds_config
    from helpers.runtime import clean_slate, live_engines

    for k in DIST_ENV_VARS:
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    setup_single_process()
    real, calls = stage3.register_grad_hook, []

    def register_then_interrupt(param, hook):
        calls.append(param)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(param, hook)

    monkeypatch.setattr(stage3, "register_grad_hook", register_then_interrupt)
    cfg = build_ds_config(3, precision="fp32", micro_batch_size=4, settings=ConfigSettings(scheduler=None))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    clean_slate({})  # an engine an earlier test of this worker left (test order varies with pytest-xdist)
    assert not live_engines()
    with pytest.raises(KeyboardInterrupt):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    del model
    assert len(live_engines()) == 1  # held by the interrupted frames and by the hooks
    cleaned = clean_slate({})
    assert "1 DeepSpeed engine(s) no variable names (from an earlier cell or an interrupted run)" in cleaned
    assert live_engines() == []


def _this_installation() -> str:
    """The include flags torch writes into an op's build.ninja for this venv's torch and deepspeed."""
    from importlib.util import find_spec

    from torch.utils.cpp_extension import include_paths

    csrc = Path(find_spec("deepspeed").submodule_search_locations[0]) / "ops" / "csrc" / "includes"
    return f"cflags = -I{csrc} -isystem {include_paths()[0]}"


def _fake_cached_op(folder: Path, cflags: str) -> None:
    folder.mkdir()
    (folder / f"{folder.name}.so").write_bytes(b"")
    (folder / "build.ninja").write_text(f"ninja_required_version = 1.3\n{cflags}\n")


def test_an_op_build_is_announced_before_it_starts_and_a_cached_op_is_not(monkeypatch, tmp_path, capsys):
    import torch.utils.cpp_extension as cpp
    from deepspeed.ops.op_builder.builder import OpBuilder

    from helpers.runtime import announce_op_builds

    built = []
    monkeypatch.setattr(OpBuilder, "jit_load", lambda self, verbose=True: built.append(self.name) or self.name)
    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    _fake_cached_op(tmp_path / "cached_op", _this_installation())
    (tmp_path / "new_op").mkdir()
    assert announce_op_builds()
    op = type("FakeBuilder", (), {"name": "new_op"})()
    assert OpBuilder.jit_load(op) == "new_op"
    out = capsys.readouterr().out
    assert out.index("compiling DeepSpeed's new_op op") < out.index("compiled new_op in")
    op.name = "cached_op"
    assert OpBuilder.jit_load(op) == "cached_op" and capsys.readouterr().out == ""
    assert built == ["new_op", "cached_op"]
    import helpers.runtime as rt

    assert rt.COMPILED_OPS[-1:] == ["new_op"]  # what a measured child reports (helpers.fresh_process)


def test_an_op_another_installation_compiled_into_the_shared_cache_counts_as_not_built(monkeypatch, tmp_path):
    """The CI failure of stop 29: ~/.cache/torch_extensions held async_io compiled by another checkout's venv; build_ops
    called it cached, and the first child that loaded it recompiled it inside its 3 GB memory group (OOM-killed).
    A library whose build.ninja names another torch/deepspeed is rebuilt by build_ops, outside any measured run."""
    import torch.utils.cpp_extension as cpp

    import helpers.runtime as rt

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    _fake_cached_op(tmp_path / "ours", _this_installation())
    other = _this_installation().replace(str(Path(cpp.__file__).parents[2]), "/elsewhere/.venv/lib/site-packages")
    assert other != _this_installation()
    _fake_cached_op(tmp_path / "theirs", other)
    (tmp_path / "unfinished").mkdir()  # a build that never linked: no .so
    (tmp_path / "unfinished" / "build.ninja").write_text(_this_installation())
    assert rt._op_cached("ours")
    assert not rt._op_cached("theirs") and not rt._op_cached("unfinished") and not rt._op_cached("absent")


def test_an_op_older_than_its_sources_counts_as_not_built(monkeypatch, tmp_path):
    """A fresh-clone run's failure: a venv made again at the same path leaves build.ninja naming this installation,
    but the library is older than its freshly installed sources, so torch's loader (ninja) recompiled the op inside
    notebook 02's 3 GB group. build_ops must call it not built, and build it outside."""
    import os

    import torch.utils.cpp_extension as cpp

    import helpers.runtime as rt

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    source = tmp_path / "op.cpp"
    source.write_text("source")
    _fake_cached_op(tmp_path / "ours", f"{_this_installation()}\nbuild op.o: compile {source}")
    assert rt._op_cached("ours")
    later = (tmp_path / "ours" / "ours.so").stat().st_mtime + 10
    os.utime(source, (later, later))  # the source installed again after the library was built
    assert not rt._op_cached("ours")


def test_build_ops_refuses_an_unknown_op_with_the_names_it_knows():
    from helpers.runtime import OP_BUILDERS, build_ops

    with pytest.raises(ValueError, match="unknown DeepSpeed op 'cpu_adamw'") as err:
        build_ops("cpu_adamw")
    assert all(name in str(err.value) for name in OP_BUILDERS)


@pytest.mark.slow
def test_build_ops_builds_once_and_a_child_after_it_compiles_nothing(tmp_path, capsys):
    """Issue 22 item 3: the ops a notebook needs are compiled before its first measured child, in their own process;
    the child's record (RunResult.extras['compiled_ops']) then names none, so its RAM peak is the config's own."""
    import helpers

    first = helpers.runtime.build_ops("cpu_adam")
    assert first["cpu_adam"] == "cached" or first["cpu_adam"].startswith("built in")
    capsys.readouterr()
    again = helpers.runtime.build_ops("cpu_adam")  # on CPU with DeepSpeed's own CPU ops (helpers.runtime.CPU_COMPANION_OPS)
    assert again["cpu_adam"] == "cached" and set(again.values()) == {"cached"} and capsys.readouterr().out == ""
    rt = helpers.detect_runtime()
    ds = helpers.load_text_dataset("local")
    helpers.train_tokenizer(ds["train"]["text"][:400], tmp_path / "tok")
    cfg = helpers.config.offload_config("zero2_offload_cpu", rt, micro_batch_size=2, lr=1e-3, warmup_steps=1)
    fp = helpers.fresh_process
    r = fp.train_in_fresh_process(fp.FreshRunSpec("zero2 offload", cfg, "gpt2-tiny", tokenizer_dir=tmp_path / "tok",
                                                  steps=3, seq_len=32, max_blocks=16, progress=False))
    assert not r.error, r.error
    assert "compiled_ops" not in r.extras and "compiled DeepSpeed's" not in capsys.readouterr().out
    assert len(r.step_seconds) == 2  # 3 steps, the first untimed: the spread of tokens/s (helpers.train.compare_speed)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path, capsys):
    import os
    import time

    from helpers.runtime import remove_stale_build_lock

    (tmp_path / "build.ninja").write_text("")
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not remove_stale_build_lock(tmp_path)  # files just written: a build may be running
    old = time.time() - 3600
    for f in tmp_path.iterdir():
        os.utime(f, (old, old))
    assert remove_stale_build_lock(tmp_path) and not lock.exists()
    assert "stale build lock" in capsys.readouterr().out
    assert not remove_stale_build_lock(tmp_path)  # nothing left to remove


def test_clean_slate_checks_what_the_cell_needs_before_it_drops_anything(monkeypatch):
    """Issue 40: one call at the top of a training cell. A missing name is refused with the cell to run, and the
    cell's old results are still there; with everything present it forgets them and, when asked, sets the five
    distributed variables for one process."""
    from helpers.runtime import clean_slate

    for k in DIST_ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    namespace = {"losses": [1.0], "model_path": "x"}
    with pytest.raises(NameError, match="train_blocks not defined.*Fix: run sections 1-3 first"):
        clean_slate(namespace, "losses", needs=("model_path", "train_blocks"), where="sections 1-3",
                    single_process=True)
    assert namespace["losses"] == [1.0] and "RANK" not in os.environ
    namespace["train_blocks"] = []
    clean_slate(namespace, "losses", needs=("model_path", "train_blocks"), single_process=True)
    assert "losses" not in namespace and os.environ["WORLD_SIZE"] == "1" and os.environ["MASTER_PORT"]


def test_a_world_of_one_gets_one_nccl_channel_and_launched_ranks_do_not_inherit_it(monkeypatch):
    """setup_single_process sets NCCL_MAX_NCHANNELS=1 (DeepSpeed's addition outside the allocator 0.990 -> 0.252 GiB
    on an H200) unless the learner set it; child_env drops it for launched ranks only where the course set it."""
    from helpers.runtime import DIST_ENV_VARS, child_env, setup_single_process

    for key in (*DIST_ENV_VARS, "NCCL_MAX_NCHANNELS", "DS_COURSE_SET_NCCL_MAX_NCHANNELS"):
        monkeypatch.delenv(key, raising=False)
    setup_single_process()
    assert os.environ["NCCL_MAX_NCHANNELS"] == "1"
    env = child_env()
    assert "NCCL_MAX_NCHANNELS" not in env and not set(DIST_ENV_VARS) & set(env)
    assert "DS_COURSE_SET_NCCL_MAX_NCHANNELS" not in env
    monkeypatch.delenv("DS_COURSE_SET_NCCL_MAX_NCHANNELS")
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "8")  # the learner's own: kept, in the kernel and in launched ranks
    setup_single_process()
    assert os.environ["NCCL_MAX_NCHANNELS"] == "8" and child_env()["NCCL_MAX_NCHANNELS"] == "8"


def test_a_kernel_that_ran_out_of_memory_once_starts_the_next_engine_with_no_allocator_retries(monkeypatch):
    """Notebook 02 (GPU run 2026-12-07): after its deliberate out-of-memory wall, each later ZeRO-3 engine warned "GPU
    memory is nearly full ... 1 time(s)" at its first step (a 124M model): DeepSpeed 0.19.8's stage-3 step compares
    the process's `num_alloc_retries` with a count every new engine starts at 0. reset_peak_stats (clean_slate runs
    it) and teardown zero PyTorch's accumulated counters, so DeepSpeed's check sees only the new engine's retries."""
    import helpers.runtime as rt

    stats = {"num_alloc_retries": 1}  # the wall's retry, before the allocator raised
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_accumulated_memory_stats", lambda *a, **k: stats.update(num_alloc_retries=0))
    monkeypatch.setattr(rt, "warm_up_cuda", lambda: None)
    monkeypatch.setattr(rt, "gpu_allocated_bytes", lambda: 0)
    monkeypatch.setattr(rt, "release_host_memory", lambda: None)

    def deepspeed_warns_at_first_step() -> bool:  # stage3.py's check with a fresh engine's n_caching_allocator_flushes
        n_caching_allocator_flushes = 0
        return stats["num_alloc_retries"] > n_caching_allocator_flushes

    assert deepspeed_warns_at_first_step()
    reset_peak_stats()
    assert not deepspeed_warns_at_first_step()
    stats["num_alloc_retries"] = 2  # a real flush under the next engine
    teardown({}, "engine")
    assert not deepspeed_warns_at_first_step()


def test_build_ops_reads_its_childs_lines_and_skips_blank_and_compiler_ones():
    """A fresh-clone run crashed in build_ops on a blank line of the build child's output (ValueError: not enough values
    to unpack, notebook 02, 2026-12-07): only "BUILT <Builder> <s>" and "SKIP <Builder>" lines count."""
    from helpers.runtime import _build_results

    lines = ["", "   ", "[1/3] c++ -MMD -c cpu_adam.cpp", "BUILT CPUAdamBuilder 53.4", "SKIP FusedAdamBuilder",
             "BUILT", "BUILT NoSuchBuilder 1.0", "warning: something"]
    assert _build_results(lines) == {"cpu_adam": "built in 53 s", "fused_adam": "not available here"}
