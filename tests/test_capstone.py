"""helpers.capstone and notebooks/programs/train_your_model.py (notebook 07, issue 40 item 3): the standalone script
imports no helpers, the notebook writes it word for word, it trains smoke-sized on CPU and its checkpoints load, and
bad input is refused before anything runs, each fix passing the same check."""
import ast
import dataclasses
import json

import nbformat
import pytest

import helpers
from conftest import ROOT, load_script

SCRIPT = ROOT / "notebooks" / "programs" / "train_your_model.py"
NB07 = next(p for folder in ("notebooks", "notebooks/drafts") for p in (ROOT / folder).glob("07_*.ipynb"))


def test_the_script_imports_only_torch_transformers_datasets_and_deepspeed():
    modules = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            modules.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.add((node.module or "").split(".")[0])
    assert modules <= {"__future__", "argparse", "json", "os", "socket", "time", "pathlib", "torch", "transformers",
                       "datasets", "deepspeed"}, modules
    text = SCRIPT.read_text()
    for api in ("HfDeepSpeedConfig(config)", "deepspeed.initialize(", "engine.backward(loss)", "engine.step()",
                "engine.save_checkpoint(", "convert_zero_checkpoint_to_fp32_state_dict(", "gradient_checkpointing_enable"):
        assert api in text, api
    assert text.index("HfDeepSpeedConfig(config)") < text.index("AutoModelForCausalLM.from_pretrained(")


def test_the_notebook_writes_the_script_word_for_word():
    cells = [c.source for c in nbformat.read(NB07, as_version=4).cells
             if c.cell_type == "code" and c.source.startswith("%%writefile")]
    assert len(cells) == 1 and cells[0].splitlines()[0] == "%%writefile {WORK}/train.py"
    assert cells[0].split("\n", 1)[1] + "\n" == SCRIPT.read_text(), "copy notebooks/programs/train_your_model.py in"


def test_bad_parameters_are_refused_with_a_fix_that_passes():
    good = dict(seq_len=512, steps=30, micro_batch=4)
    helpers.check_capstone_inputs("gpt2-medium", **good)
    for model_id, changes, fix in (("", {}, None), ("gpt2-medium", {"seq_len": 0}, {"seq_len": 512}),
                                   ("gpt2-medium", {"steps": 2.5}, {"steps": 30}),
                                   ("gpt2-medium", {"micro_batch": -1}, {"micro_batch": 4})):
        with pytest.raises(helpers.ConfigError, match="Fix: "):
            helpers.check_capstone_inputs(model_id, **(good | changes))
        if fix:
            helpers.check_capstone_inputs(model_id, **(good | fix))


def test_a_model_too_big_for_a_t4_and_a_too_long_block_are_refused_before_anything_is_built(tmp_path):
    t4 = helpers.colab_t4_profile()
    with pytest.raises(helpers.ConfigError, match=r"any course config, NVMe offload included.*Fix: MODEL_ID = "
                                                  r"'gpt2-xl'") as refused:
        helpers.pick_plan("gpt2-6.7b", t4, seq_len=512, micro_batch=4, nvme_path="/content/nvme")
    assert not list(tmp_path.iterdir())
    kind, plan = helpers.pick_plan("gpt2-xl", t4, seq_len=512, micro_batch=4, nvme_path="/content/nvme")
    assert plan.report.fits and "nvme" in kind and "offload_optimizer" in plan.config["zero_optimization"]
    assert "gpt2-xl" in str(refused.value)
    with pytest.raises(helpers.ConfigError, match="Fix: SEQ_LEN = 1024"):
        helpers.pick_plan("gpt2-medium", t4, seq_len=2048, micro_batch=4)
    kind, plan = helpers.pick_plan("gpt2-medium", t4, seq_len=1024, micro_batch=4)
    assert plan.report.fits
    kind, plan = helpers.pick_plan("gpt2-medium", t4, seq_len=512, micro_batch=4)
    assert kind == "zero2" and plan.report.fits  # the Colab default trains without offload


def test_an_unknown_model_id_is_refused_offline_and_its_fix_is_a_stand_in(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(helpers.ConfigError, match="Fix: MODEL_ID = 'gpt2-medium'"):
        helpers.capstone_model("no-such-org/no-such-model")
    with pytest.raises(helpers.ConfigError, match="neither a folder nor a Hugging Face model id"):
        helpers.capstone_model("not a model id!")
    source = helpers.capstone_model("gpt2-medium")
    assert source.stand_in and source.weights.startswith("stand-in")
    assert helpers.capstone_data("Salesforce/wikitext:wikitext-2-raw-v1")[0] == str(helpers.data.LOCAL_CORPUS)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_the_script_trains_smoke_sized_on_cpu_and_both_checkpoints_load(tmp_path, monkeypatch, stage):
    """The notebook's own path, CPU-sized: the plan's config (ZeRO-2 here; ZeRO-3, the HfDeepSpeedConfig branch, the
    course's zero3 config), train.py in a fresh process (fp32, gloo), the loss logged per step, DeepSpeed's checkpoint
    and the zero_to_fp32 folder that from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    runtime = helpers.detect_runtime()
    if runtime.has_gpu:
        pytest.skip("the CPU smoke run (a GPU machine runs the notebook itself)")
    source = helpers.capstone_model("gpt2-tiny")
    kind, plan = helpers.pick_plan("gpt2-tiny", runtime, seq_len=32, micro_batch=2)
    assert kind == "zero2"
    config = plan.config if stage == 2 else helpers.course_config("zero3", runtime, micro_batch_size=2)
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    run = helpers.run_script(SCRIPT, ["--model", source.path(tmp_path), "--deepspeed", str(tmp_path / "ds_config.json"),
                                      "--data", str(helpers.data.LOCAL_CORPUS), "--seq-len", "32", "--steps", "3",
                                      "--out", str(out), "--consolidate"], out=out, steps=3)
    assert run.trained, run.tail
    assert len(run.losses) == 3 and run.peak_rss_bytes > 0 and run.checkpoint_bytes > 0
    # the kernel and the script were sampled together: more than the script alone, by about this kernel's RSS
    assert run.peak_with_kernel_bytes > run.peak_rss_bytes and run.peak_ram_bytes == run.peak_with_kernel_bytes
    assert [json.loads(line)["step"] for line in (out / "loss.jsonl").read_text().splitlines()] == [1, 2, 3]
    # the RAM peak by the phase train.py announced: the phases it passed through, in order, each its own peak (a phase
    # shorter than the 0.2 s between samples, a tiny model's 3 steps or its checkpoint, may have none)
    phases = list(run.peak_ram_by_phase)
    order = ["starting"] + [phase for _, phase in helpers.capstone.SCRIPT_PHASES]
    assert "zero_to_fp32" in phases and phases == sorted(phases, key=order.index), phases
    assert max(run.peak_ram_by_phase.values()) == run.peak_with_kernel_bytes
    assert "the RAM reached its peak in " in run.report(plan, runtime)
    assert (out / "checkpoint" / "final").is_dir() and "did not train" not in run.report(plan, runtime)
    model = AutoModelForCausalLM.from_pretrained(out / "fp32")
    assert sum(p.numel() for p in model.parameters()) == plan.shape.n_params


def test_in_t4_budget_mode_on_a_bigger_gpu_the_script_runs_capped_with_its_own_argv(tmp_path):
    """The emulation caps the notebook's allocator; train.py imports no helpers, so run_script starts it under a
    wrapper that calls the same helpers.hardware.apply_t4_budget (this checkout's). The wrapper must run the script as __main__ with the script's own argv, and is
    used only where the budget is below the GPU (a real T4, or no budget, runs `python script` as printed)."""
    import dataclasses
    import subprocess
    import sys

    from helpers.capstone import _script_command

    base = helpers.detect_runtime()
    bigger = dataclasses.replace(base, device="cuda", t4_budget=True, gpu_total_bytes=80 * 2**30,
                                 vram_budget_bytes=int(14.34 * 2**30))
    script = tmp_path / "show.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print(repr(sys.argv))\n    raise SystemExit(3)\n")
    assert _script_command(script, ["--a", "1"]) == [sys.executable, str(script), "--a", "1"]
    assert _script_command(script, ["--a", "1"], dataclasses.replace(bigger, gpu_total_bytes=bigger.vram_budget_bytes)
                           ) == [sys.executable, str(script), "--a", "1"]
    command = _script_command(script, ["--a", "1"], bigger)
    assert command[1] == "-c" and "apply_t4_budget(0)" in command[2] and command[3] == str(ROOT)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == repr([str(script), "--a", "1"])


def test_an_nvme_run_swaps_in_this_kernels_own_folder_and_leaves_another_kernels_files(tmp_path, monkeypatch):
    """Issue 41 item 7, notebook 07's part: every kernel of a checkout plans with helpers.default_nvme_path(), and
    DeepSpeed empties its rank folder when it starts. run_script runs the config from a copy that swaps under
    <NVMe folder>/pid-<this pid>/capstone, removed after the run; the learner's config, another kernel's folder and
    files in the shared folder stay. The script gets the kernel's environment less its world-of-one variables and
    the course's one-rank NCCL setting (helpers.runtime.child_env)."""
    import os

    base = tmp_path / "nvme"
    other = base / f"pid-{os.getppid()}" / "capstone" / "zero_stage_3" / "optimizer" / "rank0" / "0_1.tensor.swp"
    shared = base / "zero_stage_3" / "optimizer" / "rank0" / "0_1.tensor.swp"
    for f in (other, shared):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"\0" * 4096)
    config = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(base)},
                                    "offload_param": {"device": "cpu"}}}
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(config))
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys, time\nfrom pathlib import Path\n"
        "config = sys.argv[sys.argv.index('--deepspeed') + 1]\nout = Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "nvme = json.loads(Path(config).read_text())['zero_optimization']['offload_optimizer']['nvme_path']\n"
        "swap = Path(nvme) / 'zero_stage_3' / 'optimizer' / 'rank0'\nswap.mkdir(parents=True)\n"
        "(swap / '0_1.tensor.swp').write_bytes(bytes(2**20))\nout.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'loss.jsonl').write_text(json.dumps({'loss': 1.0, 'seconds': 0.1, 'peak_gpu_bytes': 0}) + '\\n')\n"
        "print(json.dumps({'config': config, 'nvme': nvme, 'env': [os.environ.get(k) for k in "
        "('MASTER_PORT', 'NCCL_MAX_NCHANNELS')]}))\ntime.sleep(1)\n")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "1")
    monkeypatch.setenv("DS_COURSE_SET_NCCL_MAX_NCHANNELS", "1")
    args = ["--deepspeed", str(config_path), "--out", str(tmp_path / "out")]
    run = helpers.run_script(script, args, out=tmp_path / "out", steps=1, nvme_path=str(base))
    assert run.trained, run.tail
    seen = json.loads(next(line for line in run.tail if line.startswith("{")))
    own = base / f"pid-{os.getpid()}" / "capstone"
    assert seen["nvme"] == str(own) and seen["config"] == str(own / "ds_config.json")
    assert seen["env"] == [None, None]
    assert run.peak_disk_bytes >= 2**20  # the run's own swap file, counted while it ran
    assert not own.parent.exists() and other.exists() and shared.exists()
    assert json.loads(config_path.read_text()) == config and args[1] == str(config_path)
    plain = dict(config, zero_optimization={"stage": 2})
    config_path.write_text(json.dumps(plain))  # no NVMe offload: the config runs as it is
    from helpers.capstone import _own_nvme_run

    assert _own_nvme_run(args, str(base)) == (args, None) and not own.parent.exists()


def test_the_run_report_judges_the_ram_of_this_kernel_and_the_script_together():
    """Notebook 07 printed train.py's 5.12 GB RSS beside a plan of 3.46 GB that counts this kernel's RSS (2.04 GB) and
    the model copy, and judged the budget on the script alone. The report now names what each number holds, puts the
    kernel and the script, sampled together, beside the plan, and judges that sum: a script under the budget beside a
    kernel that takes it over is over."""
    from conftest import fake_runtime

    GB = 1e9
    runtime = fake_runtime()
    kind, plan = helpers.pick_plan("gpt2-tiny", runtime, seq_len=32, micro_batch=2, ram_in_use=int(2 * GB))
    base = dict(returncode=0, seconds=10.0, losses=[10.9, 9.0, 8.0, 7.0], step_seconds=[1.0] * 4,
                peak_rss_bytes=int(5.12 * GB), peak_gpu_bytes=int(2**30), peak_disk_bytes=0, checkpoint_bytes=0,
                tail=[], peak_main_rss_bytes=int(5.12 * GB))
    within = helpers.capstone.ScriptRun(**base, peak_with_kernel_bytes=int(7.16 * GB)).report(plan, runtime)
    assert "peak RAM (RSS) of this kernel and the script together: 7.16 GB (train.py 5.12 GB)" in within
    assert "the script's own Python, torch and CUDA libraries are not in it" in within
    assert within.endswith("are within the budgets")
    over = helpers.capstone.ScriptRun(**base, peak_with_kernel_bytes=int(12.5 * GB)).report(plan, runtime)
    assert over.endswith("went over a budget") and runtime.ram_budget_bytes < 12.5 * GB
    alone = helpers.capstone.ScriptRun(**base).report(plan, runtime)  # not sampled together: the script alone
    assert "peak RAM (RSS): train.py 5.12 GB" in alone and alone.endswith("are within the budgets")


def test_the_run_names_the_phase_of_its_ram_peak():
    """Notebook 07's train.py peaked at 5.12 GB against a 3.46 GB plan without saying when: training, saving the
    checkpoint or consolidating it with zero_to_fp32 (which reads the optimizer states back). run_script keeps the peak
    of each phase train.py announces, and the report says where the peak came."""
    from conftest import fake_runtime

    from helpers.capstone import script_phase

    assert script_phase("step 3/30 loss 9.1") == "training" and script_phase("zero_to_fp32\n") == "zero_to_fp32"
    assert script_phase("[transformers] a warning") is None and script_phase("Processing zero checkpoint") is None
    GB = 1e9
    runtime = fake_runtime()
    kind, plan = helpers.pick_plan("gpt2-tiny", runtime, seq_len=32, micro_batch=2, ram_in_use=int(2 * GB))
    run = helpers.capstone.ScriptRun(
        returncode=0, seconds=10.0, losses=[10.9, 9.0, 8.0, 7.0], step_seconds=[1.0] * 4, peak_rss_bytes=int(5.12 * GB),
        peak_gpu_bytes=int(2**30), peak_disk_bytes=0, checkpoint_bytes=0, tail=[], peak_with_kernel_bytes=int(7.38 * GB),
        peak_ram_by_phase={"training": int(4.9 * GB), "save_checkpoint": int(5.5 * GB), "zero_to_fp32": int(7.38 * GB)})
    assert ("the RAM reached its peak in zero_to_fp32; by phase (GB): training 4.90, save_checkpoint 5.50, "
            "zero_to_fp32 7.38") in run.report(plan, runtime)
    flat = dataclasses.replace(run, peak_ram_by_phase={"training": int(7.37 * GB), "zero_to_fp32": int(7.38 * GB)})
    assert "the RAM reached its peak in training;" in flat.report(plan, runtime)  # RSS held, not a new peak


def _capstone_benchmark():
    return load_script(ROOT / "benchmarks" / "capstone.py", "bench_capstone")


def test_the_capstone_benchmark_refuses_a_run_it_did_not_prepare(tmp_path):
    bench = _capstone_benchmark()
    with pytest.raises(SystemExit, match="--prepare first"):
        bench.main(["--model", "gpt2-tiny", "--work-dir", str(tmp_path)])
    (tmp_path / "prepared.json").write_text(json.dumps({"model": "gpt2-xl", "folder": "x", "kind": "zero2"}))
    with pytest.raises(SystemExit, match="prepared for gpt2-xl"):
        bench.main(["--model", "gpt2-tiny", "--work-dir", str(tmp_path)])


@pytest.mark.slow
def test_the_capstone_benchmark_runs_train_py_and_reports_the_plan_beside_the_phases(tmp_path, monkeypatch):
    """benchmarks/capstone.py (the GPU step capstone_xl: section 6's XL plan run for real in the emulation), here at
    gpt2-tiny on CPU: prepared apart, run through run_script, its report the plan beside the measured peaks by phase."""
    if helpers.detect_runtime().has_gpu:
        pytest.skip("the CPU smoke run")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bench = _capstone_benchmark()
    common = ["--model", "gpt2-tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "3", "--work-dir",
              str(tmp_path / "work"), "--nvme-path", str(tmp_path / "nvme")]
    assert bench.main(["--prepare", *common]) == 0
    assert bench.main([*common, "--out", str(tmp_path / "capstone.json")]) == 0
    report = json.loads((tmp_path / "capstone.json").read_text())
    measured = report["measured"]
    assert report["config"] == "zero2" and measured["trained"] and len(measured["losses"]) == 3
    assert "zero_to_fp32" in measured["peak_ram_by_phase_gb"]
    assert measured["peak_with_driver_gb"] > measured["peak_script_rss_gb"] > 0 and report["plan"]["ram_gb"] > 0
    assert "the RAM reached its peak in" in report["text"] in (tmp_path / "capstone.md").read_text()
