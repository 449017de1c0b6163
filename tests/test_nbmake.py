"""nbmake, the runner the course names (issue 27): scripts/test.sh runs `pytest --nbmake` over every notebook after
the tests, and the Colab T4 emulation (scripts/gpu_check.py) runs each notebook with `pytest --nbmake` started inside
its enclosure. Here: that enclosure path, on CPU, for a passing notebook and for a failing one."""
import json

import nbformat
import pytest

import colab_emulation as emu  # scripts/ is on pytest's pythonpath (pyproject.toml)
from conftest import ROOT

MECHANISM, WHY = emu.probe()
needs_cgroup = pytest.mark.skipif(not MECHANISM.startswith("cgroup"), reason=f"cgroups not writable here: {WHY}")


def test_the_test_command_runs_every_notebook_through_nbmake():
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "pytest --nbmake --nbmake-timeout=1800" in script and "notebooks/[0-9][0-9]_*.ipynb" in script
    from run_notebooks import kernel_env

    assert kernel_env()["DS_COURSE_SAVED_RUN"] == "1"  # the learner-habits kernel saves text progress bars
    # issue 39: the nbmake pass is the learner-habits run (each notebook executes twice, not three times), in the same
    # pytest run as the tests, over every core
    run = next(ln for ln in script.splitlines() if "pytest --nbmake" in ln and not ln.startswith("#"))
    assert "-p tests.learner_habits" in run and '"${WORKERS[@]}"' in run and "-n " in script
    # every notebook, and the drafts awaiting their GPU run (issue 40), before the tests
    assert "NOTEBOOKS=(notebooks/[0-9][0-9]_*.ipynb notebooks/drafts/[0-9][0-9]_*.ipynb)" in script
    assert '"${NOTEBOOKS[@]}" tests' in run or '"${NOTEBOOKS[@]}" tests' in script
    assert "test_notebook_survives_interrupts_and_reruns" not in (ROOT / "tests" / "test_notebooks_twice.py").read_text()


@pytest.mark.slow
@needs_cgroup
def test_nbmake_inside_the_enclosure_runs_a_notebook_and_keeps_its_outputs(tmp_path):
    figures = tmp_path / "figures.json"
    path = ROOT / "notebooks" / "00_setup_and_ds_report.ipynb"
    result = emu.run_notebook(path, out_dir=tmp_path / "out", figures_file=figures, runner="nbmake",
                              limits=emu.ColabLimits(ram_bytes=int(3e9)))
    assert result["passed"], result["error"]
    assert result["runner"].startswith("nbmake ") and result["enclosure"]["oom_kills"] == 0
    assert 0.3 < result["enclosure"]["peak_ram_gb"] <= 3.0  # the kernel nbmake started was inside the group
    executed = nbformat.read(tmp_path / "out" / path.name, as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert len(outputs) > 10
    assert json.loads(figures.read_text())["runtime"]  # the notebook's figures reached gpu_check's file
    assert not emu.leftover_groups()


@pytest.mark.slow
@needs_cgroup
def test_a_failing_notebook_fails_with_nbmakes_report_of_the_cell(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("raise ValueError('the cell that fails')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "99_fails.ipynb"
    nbformat.write(nb, path)
    result = emu.run_notebook(path, out_dir=tmp_path / "out", runner="nbmake",
                              limits=emu.ColabLimits(ram_bytes=int(2e9)))
    assert not result["passed"]
    assert "ValueError" in result["error"] and "the cell that fails" in result["error"]
    assert "1 failed" in result["error"]
    with pytest.raises(ValueError, match="one plain pass"):
        emu.run_notebook(path, runner="nbmake", habits=True)


def test_merging_a_new_run_keeps_each_earlier_entrys_card_and_date():
    """A notebook re-run on another card replaces only its own entry: the others keep the card and date they ran on
    (the README names the card beside each time)."""
    import gpu_check

    report = {"gpu": "NVIDIA H200", "date": "2026-12-04", "notebooks": {"02_x.ipynb": {"passed": True}}}
    part = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-06",
            "notebooks": {"01_x.ipynb": {"passed": True, "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-06"}}}
    merged = gpu_check.merge(report, [part])
    assert merged["notebooks"]["02_x.ipynb"]["gpu"] == "NVIDIA H200"
    assert merged["notebooks"]["02_x.ipynb"]["date"] == "2026-12-04"
    assert merged["notebooks"]["01_x.ipynb"]["gpu"] == merged["gpu"] == "NVIDIA H100 80GB HBM3"


def test_the_readme_table_is_rewritten_from_a_merged_report():
    """After a GPU run, `gpu_check.py --merge parts/*.json --readme README.md` rewrites each row's T4 minutes, time,
    peak RAM and card from the report; the committed README already is what the committed report gives."""
    import copy

    import gpu_check

    readme = (ROOT / "README.md").read_text()
    report = json.loads((ROOT / "reports" / "gpu_check.json").read_text())
    assert gpu_check.readme_rows(readme, report) == readme
    changed = copy.deepcopy(report)
    entry = changed["notebooks"]["02_zero3_offload_nvme.ipynb"]
    entry.update(wall_seconds=301.4, peak_ram_gb=9.96, gpu="NVIDIA H100 80GB HBM3", t4_estimate={"low_s": 400, "high_s": 700})
    row = next(line for line in gpu_check.readme_rows(readme, changed).splitlines() if "(notebooks/02_" in line)
    assert row.endswith("| 7-12 min + disk | [301 s, peak RAM 10.0 GB](reports/executed/02_zero3_offload_nvme.ipynb) on an H100 |")


def test_a_notebook_that_recorded_no_runtime_gets_the_label_it_printed_under_this_budget(tmp_path):
    """gpu_check's entry names the runtime from record_figure("runtime", ...), else from the label the executed copy
    printed for this card and budget (06 also quotes its report's older labels: those are not its runtime)."""
    import gpu_check

    from helpers.hardware import T4_VRAM_GIB

    own = f"H100 80GB HBM3 in Colab T4 emulation ({T4_VRAM_GIB:g} GiB VRAM, 12.1 GB RAM enforced, 2 CPUs)"
    quoted = "H100 80GB HBM3 in Colab T4 emulation (15 GiB VRAM, 12.1 GB RAM enforced, 2 CPUs)"
    nb = tmp_path / "06_x.ipynb"
    nb.write_text(json.dumps({"cells": [{"outputs": [{"text": f"report measured on {quoted}\\n"}]},
                                        {"outputs": [{"text": f"runtime: {own}\\n"}]}]}))
    assert gpu_check.printed_runtime(nb, "NVIDIA H100 80GB HBM3") == own
    assert gpu_check.printed_runtime(nb, "NVIDIA H200") == "not recorded"
    assert gpu_check.printed_runtime(tmp_path / "missing.ipynb", "NVIDIA H100 80GB HBM3") == "not recorded"
