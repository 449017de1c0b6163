"""What a learner does to a notebook, checked (issue 7 and issue 39).

Every notebook runs once in the test command, through nbmake with the learner-habits plugin (tests/learner_habits.py):
top to bottom with each heavy cell interrupted after 3 s and run again, a second pass in the same kernel, no DeepSpeed
engine alive at the end, outputs that read clean. Here: the plugin itself on small notebooks (it must fail what it
should), the hygiene check, and notebook 02 in a RAM too small for its wall model.
"""
import subprocess
import sys

import nbformat
import pytest

import colab_emulation as emu  # scripts/ is on pytest's pythonpath (pyproject.toml)
from conftest import ROOT
from learner_habits import RAM_LIMIT_BYTES, build_ops_outside
from run_notebooks import hygiene_problems

MECHANISM, WHY = emu.probe()


def test_the_hygiene_check_finds_what_reads_wrong():
    cell = nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook(cells=[
        cell("helpers.plot_losses([1])", outputs=[]),
        cell("helpers.record_figure('x', 1)", outputs=[nbformat.v4.new_output("execute_result", {"text/plain": "1"})]),
        cell("for s in tqdm(range(40)): pass", outputs=[nbformat.v4.new_output(
            "display_data", {"application/vnd.jupyter.widget-view+json": {}, "text/plain": "  0%|   | 0/40"})]),
        cell("print(t)", outputs=[nbformat.v4.new_output("stream", name="stdout", text="target >= 0.9: NOT met")]),
        cell("if gpu:\n    helpers.plot_losses([1])", outputs=[]),  # inside an if: may not run here
        cell("helpers.plot_losses([1])", outputs=[nbformat.v4.new_output("display_data", {"image/png": "iVBOR"})]),
        cell("{'RANK': 0}", outputs=[nbformat.v4.new_output("execute_result", {"text/plain": "{'RANK': 0}"})]),
    ])
    assert [p.split(":")[0] for p in hygiene_problems(nb)] == ["cell 0", "cell 1", "cell 2", "cell 3"]


@pytest.mark.slow
def test_the_plugin_runs_nbmake_as_a_learner_and_fails_what_reads_wrong(tmp_path):
    """`pytest --nbmake -p tests.learner_habits` on two small notebooks: a heavy cell (a 6 s loop) is interrupted
    after 3 s and run again, then again in the second pass, and the notebook passes; a notebook that leaves a
    helper's return value as a stray Out[] passes plain nbmake and fails with the plugin, which names the cell."""
    cell = nbformat.v4.new_code_cell
    heavy = cell("import time\nfor _ in range(60):\n    time.sleep(0.1)\nruns = globals().get('runs', 0) + 1\n"
                 "print('heavy done', runs)", metadata={"tags": ["heavy"]})
    good = nbformat.v4.new_notebook(cells=[cell("import helpers"), heavy, cell("print('after', runs)")])
    stray = nbformat.v4.new_notebook(cells=[*good.cells, cell("helpers.runtime.live_engines()")])  # Out[]: []
    for name, nb in (("good.ipynb", good), ("stray.ipynb", stray)):
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, tmp_path / name)
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbmake", "-p", "no:cacheprovider",
                            str(tmp_path / "stray.ipynb")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stdout[-2000:]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "--nbmake", "-p", "tests.learner_habits",
                          "-p", "no:cacheprovider", str(tmp_path / "good.ipynb"), str(tmp_path / "stray.ipynb")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert "1 failed, 1 passed" in text, text[-3000:]
    assert "good.ipynb:" in text and "interrupted after 3.0 s" in text and "run again" in text, text[-3000:]
    assert "live DeepSpeed engines: 0" in text
    assert "cell 3: stray Out[] value" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not MECHANISM.startswith("cgroup"), reason=f"cgroups not writable here: {WHY}")
def test_02_teaches_on_what_fits_when_the_ram_is_too_small_for_its_wall_model(tmp_path):
    """Issue 22: in a memory cgroup too small for every offload config of the wall model (a laptop, a container),
    notebook 02 said so correctly and then crashed (`max()` of nothing). Here the wall model is gpt2 (124M: each
    offload config needs >= 2.7 GB beside the kernel on CPU) in the 3 GB group: the notebook must pass top to bottom
    on the largest GPT-2 that fits, with no process killed."""
    build_ops_outside()
    nb = nbformat.read(ROOT / "notebooks" / "02_zero3_offload_nvme.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert 'WALL_MODEL = "gpt2-large"' in params.source
    params.source = params.source.replace('WALL_MODEL = "gpt2-large"', 'WALL_MODEL = "gpt2"')
    work = ROOT / "build" / "test-02-small-ram"  # inside the checkout: the bootstrap cell finds helpers/ above it
    work.mkdir(parents=True, exist_ok=True)
    path = work / "02_zero3_offload_nvme.ipynb"
    nbformat.write(nb, path)
    limit = RAM_LIMIT_BYTES["02_zero3_offload_nvme.ipynb"]
    result = emu.run_notebook(path, out_dir=tmp_path, limits=emu.ColabLimits(ram_bytes=limit))
    enc = result["enclosure"]
    assert result["passed"], result["error"][-3000:]
    assert enc["oom_kills"] == 0 and enc["peak_ram_gb"] <= limit / 1e9, enc
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     for c in nbformat.read(tmp_path / path.name, as_version=4).cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert "No offload config trains gpt2 within this runtime's RAM" in text  # helpers.OffloadRuns.choose_model
    assert "the lesson continues with gpt2-tiny" in text
    assert "trained it (loss" in text  # the summary: at least one offload config trained the model that fits
    assert "compiled DeepSpeed's" not in text  # no measured child compiled an op (helpers.runtime.build_ops ran first)
    assert not emu.leftover_groups()
