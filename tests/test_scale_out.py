"""helpers.scale_out, helpers.launch and the scale-out programs in notebooks/programs/ (notebook 05): what each of
2 CPU ranks holds under ZeRO 0-3, a 2-stage pipeline that matches the unsplit model, AutoTP ranks holding half of
each split layer, launch commands, hostfiles, the pipeline schedule, the committed report."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, load_script
from helpers import launch, scale_out
from helpers.launch import PROGRAMS, run_ranks

pytestmark = pytest.mark.usefixtures("clean_dist_env")
SHAPE = scale_out.SCALE_OUT_SHAPES["cpu"]
SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "mlp.up.weight", "mlp.down.weight")
# notebook 05 as a learner runs it: the draft while there is one (notebooks/drafts/, issue 40), the notebook once promoted
NB05 = next(p for p in (ROOT / "notebooks" / d / "05_scaling_out.ipynb" for d in ("drafts", ".")) if p.exists())


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    return scale_out.corpus_blocks(tmp_path_factory.mktemp("scale_out"), SHAPE["vocab"], SHAPE["seq_len"], texts=300)


def psi() -> int:
    from helpers.gpt import build_gpt

    return sum(p.numel() for p in build_gpt(scale_out.gpt_config(**SHAPE)).parameters())


@pytest.mark.slow
def test_benchmark_on_two_cpu_ranks_each_rank_holds_its_share(tmp_path):
    """One deepspeed-launcher run of notebooks/programs/scale_out_train.py at N=2 through the benchmark."""
    out = tmp_path / "scale_out.json"
    proc = subprocess.run([sys.executable, "benchmarks/scale_out.py", "--out", str(out), "--device", "cpu",
                           "--ranks", "2", "--steps", "2", "--no-pipeline-tp", "--work-dir", str(tmp_path / "w")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "CPU gloo ranks" in report["runtime"] and report["backend"] == "gloo" and report["ranks"] == [2]
    assert report["commands"][0].startswith("deepspeed --num_accelerators 2 ")
    port = re.search(r"--master_port (\d+)", report["commands"][0]).group(1)
    # DeepSpeed's CPU all-reduce files of this launch (69 MB each; DeepSpeed never removes them) are gone
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    rows = {r["stage"]: r for r in report["rows"]}
    n = psi()
    assert set(rows) == {0, 1, 2, 3} and all(r["n_params"] == n and r["ranks"] == 2 for r in rows.values())
    full, half = 4 * n, 4 * n / 2  # fp32 bytes of the model, and of one rank's share
    bucket = 4 * rows[2]["bucket_elements"]

    def near(value, expected, slack=0.0):  # partitions are padded and cut at parameter boundaries
        return expected <= value <= expected * 1.02 + slack

    # ZeRO-0: every rank holds everything
    assert rows[0]["params"] == full and rows[0]["grads_peak"] == full and near(rows[0]["optimizer"], 2 * full)
    # ZeRO-1: optimizer states (fp32 master + 2 moments) halved, all gradients still at the peak, params whole
    assert rows[1]["params"] == full and near(rows[1]["optimizer"], 3 * half, 64)
    assert rows[1]["optimizer_master"] == pytest.approx(half, rel=0.01)
    assert rows[1]["grads_peak"] >= full
    # ZeRO-2: the gradient peak drops to about the partition + one bucket + what arrives before it is reduced
    assert rows[2]["grads_peak"] < 0.8 * rows[1]["grads_peak"]
    assert rows[2]["grads_peak"] >= half + bucket and near(rows[2]["optimizer"], 3 * half, 64)
    # ZeRO-3: parameters halved too; its fp32 master partition is a copy even in fp32 (as the estimator counts):
    # DeepSpeed 0.19.8 would share it only where a torch.device equals a device name string, which never holds
    assert near(rows[3]["params"], half, 64) and rows[3]["optimizer_master"] == pytest.approx(half, rel=0.01)
    assert near(rows[3]["optimizer"], 3 * half, 64) and near(rows[3]["grads_held"], half + bucket, 64)
    # what each rank sent per step, counted by deepspeed.comm's comms logger (message bytes): the gradients once
    # (all-reduce at stages 0-2, reduce-scatter at 3); stages 1-3 also gather parameters; the config is the run's
    sent = {s: r["comm_bytes_per_step"] for s, r in rows.items()}
    assert sent[0]["all_reduce"] >= full and "all_gather_into_tensor" not in sent[0]
    assert sent[3]["reduce_scatter_tensor"] == full and sent[3]["all_gather_into_tensor"] > 0
    assert all(sent[s]["all_gather_into_tensor"] >= half for s in (1, 2))
    assert [r["config"]["zero_optimization"]["stage"] for r in rows.values()] == [0, 1, 2, 3]
    for r in rows.values():
        assert r["model_states"] == r["params"] + r["grads_peak"] + r["optimizer"]
        assert r["estimate"] == sum(scale_out.estimate_parts(n, r["stage"], 2, "fp32").values())
        assert r["losses"] == pytest.approx(rows[0]["losses"], abs=1e-4)  # same math at every stage
    assert out.with_suffix(".md").read_text().startswith("# Scaling out: model states per rank (CPU gloo ranks")


@pytest.mark.slow
def test_pipeline_loss_matches_the_unsplit_model(tmp_path, blocks):
    ranks = run_ranks(PROGRAMS / "pipeline_train.py", 2, tmp_path / "pipe", launcher="torchrun",
                      args=["--blocks", str(blocks), "--steps", "3", "--micro-batches", "4"])
    r0, r1 = ranks
    assert (r0["stage_id"], r1["stage_id"]) == (0, 1) and r0["pipeline_losses"] == r1["pipeline_losses"]
    assert r0["max_loss_gap"] < 1e-5, (r0["pipeline_losses"], r0["plain_losses"])
    assert r0["plain_losses"][-1] < r0["plain_losses"][0]
    assert r0["layer_names"].count("BlockLayer") == r1["layer_names"].count("BlockLayer") == SHAPE["layers"] // 2
    assert r0["layer_names"][0] == r1["layer_names"][-1] == "TokenEmbedding"  # tied: one copy on each end
    assert r0["params_local"] + r1["params_local"] == r0["params_total"] + SHAPE["vocab"] * SHAPE["hidden"]
    assert r0["params"] == 4 * r0["params_local"]


@pytest.mark.slow
def test_autotp_ranks_hold_half_of_each_split_layer(tmp_path, blocks):
    """Given --tp-config (as notebook 05 runs it), the ranks train with the file's section: here one pattern written
    differently from autotp_config's, matching the same layers."""
    section = scale_out.autotp_config(2)
    section["partition_config"]["layer_specs"][1]["patterns"] = [r".*mlp\.up\.weight$"]
    assert section != scale_out.autotp_config(2)
    (tmp_path / "tp.json").write_text(json.dumps({"tensor_parallel": section}))
    ranks = run_ranks(PROGRAMS / "tp_train.py", 2, tmp_path / "tp", launcher="torchrun",
                      args=["--blocks", str(blocks), "--steps", "3", "--tp-config", str(tmp_path / "tp.json")])
    for r in ranks:
        assert r["mode"] == "training" and "training_error" not in r and r["tensor_parallel"] == section
        assert sorted(r["split"]) == sorted(f"blocks.{i}.{name}" for i in range(SHAPE["layers"]) for name in SPLIT)
        for s in r["split"].values():
            assert [2 * a == b for a, b in zip(s["local"], s["full"]) if a != b] == [True]
        halved = sum(_numel(s["full"]) // 2 for s in r["split"].values())
        assert r["params_local"] == r["params_total"] - halved
        assert r["params"] == 4 * r["params_local"] and r["max_loss_gap"] < 1e-5
    assert ranks[0]["tp_losses"] == ranks[1]["tp_losses"]


@pytest.mark.slow
def test_autotp_inference_fallback_splits_too(tmp_path, blocks):
    r = run_ranks(PROGRAMS / "tp_train.py", 2, tmp_path / "tpi", launcher="torchrun",
                  args=["--blocks", str(blocks), "--steps", "1", "--mode", "inference"])[0]
    assert r["mode"] == "inference" and len(r["split"]) == len(SPLIT) * SHAPE["layers"]
    assert r["params_local"] < r["params_total"] and len(r["tp_losses"]) == 1


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def test_launch_commands_for_each_launcher():
    program = PROGRAMS / "scale_out_train.py"
    argv = launch.launch_argv(program, 4, launcher="deepspeed", device="cuda", port=29501, args=["--out", "x"])
    assert argv[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert launch.shown(argv) == ("deepspeed --num_gpus 4 --master_port 29501 notebooks/programs/scale_out_train.py "
                                  "--out x")
    cpu = launch.shown(launch.launch_argv(program, 2, device="cpu", port=1234))
    assert cpu == "deepspeed --num_accelerators 2 --master_port 1234 notebooks/programs/scale_out_train.py"
    tr = launch.shown(launch.launch_argv(program, 2, launcher="torchrun", port=1234))
    assert tr == "torchrun --nproc_per_node 2 --master_port 1234 notebooks/programs/scale_out_train.py"
    acc = launch.launch_argv(program, 2, launcher="accelerate", port=1234)
    assert acc[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert launch.shown(acc) == ("accelerate launch --multi_gpu --num_processes 2 --main_process_port 1234 "
                                 "notebooks/programs/scale_out_train.py")
    with pytest.raises(ValueError, match="launcher"):
        launch.launch_argv(program, 2, launcher="mpirun")
    with pytest.raises(ValueError, match="positive integer"):
        launch.launch_argv(program, 0)
    cmds = launch.launch_commands(program, 2, args=["--out", "x"])
    assert set(cmds) == {"deepspeed", "torchrun", "accelerate"}
    assert all(c.endswith(" 29500 notebooks/programs/scale_out_train.py --out x") for c in cmds.values())


def test_function_source_shows_one_function_of_a_program():
    text = launch.function_source(PROGRAMS / "scale_out_train.py", "train_stage")
    assert text.startswith("def train_stage(") and "engine.backward(loss)" in text and "def main(" not in text
    with pytest.raises(ValueError, match="no function"):
        launch.function_source(PROGRAMS / "scale_out_train.py", "missing")


def test_hostfile_round_trip_agrees_with_deepspeeds_parser():
    from deepspeed.launcher.runner import _parse_hostfile

    hosts = {"worker-1": 4, "worker-2": 8}
    text = launch.hostfile_text(hosts)
    assert text == "worker-1 slots=4\nworker-2 slots=8\n"
    assert launch.parse_hostfile("# two nodes\n\n" + text) == hosts == dict(_parse_hostfile(text.splitlines()))
    for bad in ("worker-1 4\n", "worker-1 slots=four\n", "worker-1 slots=4\nworker-1 slots=2\n"):
        with pytest.raises(ValueError, match="hostfile line"):
            launch.parse_hostfile(bad)
    with pytest.raises(ValueError, match="slot"):
        launch.hostfile_text({"worker-1": 0})
    cmds = launch.multi_node_commands("train.py", "ds.json", hosts)
    ds = cmds["deepspeed launcher (hostfile, ssh to each node)"]
    assert ds.startswith("deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 4 ") and ds.endswith(
        "train.py --deepspeed_config ds.json")
    assert any("--num_processes 8" in c for c in cmds.values())


@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (2, 4), (4, 8)])
def test_pipeline_schedule_bubble_is_deepspeeds(stages, micro_batches):
    sched = scale_out.pipeline_schedule(stages, micro_batches)
    assert sched.ticks == 2 * (micro_batches + stages - 1)
    for row in sched.grid:  # every stage runs each micro-batch forward once and backward once, forward first
        assert sorted(c for c in row if c) == sorted([f"F{m}" for m in range(micro_batches)]
                                                     + [f"B{m}" for m in range(micro_batches)])
        assert all(row.index(f"F{m}") < row.index(f"B{m}") for m in range(micro_batches))
    assert sched.idle_fraction == pytest.approx(sched.bubble_formula)
    assert sched.table().splitlines()[1].startswith("stage 0  F0")


def test_topology_puts_tensor_slices_on_neighbouring_ranks():
    lines = scale_out.topology_table(pp=2, tp=2, dp=2).splitlines()[1:]
    coords = [tuple(map(int, line.split()[1:])) for line in lines]
    assert len(coords) == 8 and coords[1] == (0, 0, 1) and coords[4] == (1, 0, 0)


def test_autotp_patterns_name_the_course_gpts_layers():
    from helpers.gpt import build_gpt

    names = [n for n, _ in build_gpt(scale_out.gpt_config(**SHAPE)).named_parameters()]
    specs = scale_out.autotp_config(2)["partition_config"]["layer_specs"]
    matched = {n for spec in specs for pat in spec["patterns"] for n in names if re.match(pat, n)}
    assert matched == {n for n in names if n.endswith(("qkv.weight", "up.weight", "out.weight", "down.weight"))}


def _notebook_05_tp_config() -> dict:
    """The literal `tp_config = {...}` of notebook 05's cell that runs tp_train.py."""
    import ast

    import nbformat

    for cell in nbformat.read(NB05, as_version=4).cells:
        if cell.cell_type == "code" and "tp_train.py" in cell.source:
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["tp_config"]:
                    return ast.literal_eval(node.value)
    raise AssertionError(f"{NB05.relative_to(ROOT)}: no literal tp_config = {{...}} in the cell that runs tp_train.py")


def test_notebook_05s_tensor_parallel_section_is_autotp_config_and_tp_train_reads_it_from_the_file(tmp_path):
    """The section the page prints is the one that runs: notebook 05 writes it to a file for tp_train.py --tp-config,
    and it is autotp_config(2), what tp_train.py uses without the option (the benchmark, the promoted notebook)."""
    literal = _notebook_05_tp_config()
    assert set(literal) == {"tensor_parallel"} and literal["tensor_parallel"] == scale_out.autotp_config(2)
    tp_train = load_script(PROGRAMS / "tp_train.py", "tp_train")
    path = tmp_path / "tp_config.json"
    other = json.loads(json.dumps(literal))
    other["tensor_parallel"]["partition_config"]["layer_specs"].pop()
    path.write_text(json.dumps(other, indent=1))
    assert tp_train.tensor_parallel_section(path, 2) == other["tensor_parallel"] != scale_out.autotp_config(2)
    assert tp_train.tensor_parallel_section(None, 2) == scale_out.autotp_config(2)
    with pytest.raises(ValueError, match="autotp_size 2 but 4 ranks"):
        tp_train.tensor_parallel_section(path, 4)


def test_estimates_and_ratios_from_rows():
    rows = [{"stage": 3, "world": w, "n_params": 1000, "precision": "fp32", "model_states": m}
            for w, m in ((1, 16_000), (4, 4_400))]
    got = scale_out.with_estimates(rows)
    assert [r["estimate"] for r in got] == [20_000, 5_000]  # fp32: 4 + 4 + (4 master + 8 Adam) bytes, /N
    assert got[1]["ratio_to_1_over_n"] == 1.1 and got[0]["ratio_to_1_over_n"] == 1.0


def test_committed_report_is_consistent():
    path = ROOT / "reports" / "scale_out.json"
    if not path.exists():
        pytest.skip("reports/scale_out.json not committed yet")
    bench = load_script(ROOT / "benchmarks" / "scale_out.py", "bench_scale_out")
    report = json.loads(path.read_text())
    assert ("CPU gloo ranks" in report["runtime"]) == (report["device"] == "cpu")
    assert {(r["stage"], r["world"]) for r in report["rows"]} == {(s, n) for s in range(4) for n in report["ranks"]}
    assert report["target"] == bench.target_check(report["rows"])
    assert path.with_suffix(".md").read_text() == bench.markdown(report)


def test_committed_reports_hold_what_notebook_05_reads():
    """Notebook 05's section 7 lists every reports/scale_out*.json and shows the GPU ones: the keys it reads are there,
    and its opening promises no GPU report beyond what it finds."""
    import nbformat

    reports = sorted((ROOT / "reports").glob("scale_out*.json"))
    if not reports:
        pytest.skip("no reports/scale_out*.json committed yet")
    for path in reports:
        b = json.loads(path.read_text())
        assert {"runtime", "date", "deepspeed", "precision", "n_params", "ranks", "device", "rows", "target"} <= set(b)
        assert {r["world"] for r in b["rows"]} == set(b["ranks"])
        if b["device"] == "cuda":
            assert all(r["max_peak_gpu_bytes"] > 0 for r in b["rows"]), path.name
    nb = nbformat.read(ROOT / "notebooks" / "05_scaling_out.ipynb", as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert "the committed GPU benchmark report is read at the end" not in text
    assert 'glob("scale_out*.json")' in text and 'b.get("device") == "cuda"' in text


def _rows(ns=(1, 4), n_params=1000):
    """Synthetic rows as helpers.with_estimates returns them (fp32): ZeRO-k partitions its parts over N."""
    rows = []
    for s in range(4):
        for n in ns:
            params = 4 * n_params // (n if s == 3 else 1)
            grads = 4 * n_params // (n if s >= 2 else 1)
            optimizer = (8 if s == 0 else 12) * n_params // (n if s >= 1 else 1)
            rows.append({"stage": s, "world": n, "n_params": n_params, "precision": "fp32", "params": params,
                         "grads_peak": grads, "grads_held": grads, "optimizer": optimizer,
                         "optimizer_master": 0 if s == 0 else 4 * n_params // n, "model_states": params + grads + optimizer,
                         "losses": [2.0, 1.5], "comm_bytes_per_step": {"all_reduce": 4 * n_params} if s < 3 else
                         {"reduce_scatter_tensor": 4 * n_params, "all_gather_into_tensor": 8 * n_params}})
    return scale_out.with_estimates(rows)


def test_zero_findings_are_computed_from_the_rows_and_name_the_master_copy():
    lines = scale_out.zero_findings(_rows())
    assert lines[0] == "ZeRO-0: model states per rank 0.02 MB at N=1 -> 0.02 MB at N=4 (x1.00; 1/N would be x0.25)"
    assert lines[3].startswith("ZeRO-3: model states per rank 0.02 MB at N=1 -> 0.01 MB at N=4 (x0.25;")
    # N=1: ZeRO-1 adds 4 bytes per parameter (the fp32 master copy) to ZeRO-0's 16: +25 %, as the estimate says
    assert "At N=1 ZeRO-1 holds +25% of ZeRO-0's model states" in lines[4] and "= 1.00 x the fp32 parameters'" in lines[4]
    assert "the estimate says +25%" in lines[4]
    assert lines[-1].startswith("Largest loss difference of ZeRO-1/2/3 to ZeRO-0 at the same N: 0.0e+00 (the same model")
    assert not any("At N=1" in line for line in scale_out.zero_findings(_rows(ns=(2, 4))))


def test_comm_table_lists_each_collective_per_stage_and_n():
    table = scale_out.comm_table(_rows())
    lines = table.splitlines()
    assert "all_gather" in lines[1] and "reduce_scatter" in lines[1] and "all_reduce" in lines[1]
    assert lines[3].split() == ["0", "1", "0.000", "0.004", "0.000", "0.000"]  # N=1: nothing crosses a link
    assert lines[4].split() == ["0", "4", "0.000", "0.004", "0.000", "0.006"]  # ring all-reduce: 2 x 3/4
    assert lines[-1].split() == ["3", "4", "0.008", "0.000", "0.004", "0.027"]  # 3 x 0.008 + 3/4 x 0.004
    old = [{k: v for k, v in r.items() if k != "comm_bytes_per_step"} for r in _rows()]
    assert scale_out.comm_table(old).startswith("no communication recorded")
