"""Every notebook survives what learners do, in one kernel (engines torn down, memory back to baseline).

The one CI run of every notebook (a plain nbmake run would repeat its first pass). Each runs the way a learner
does: top to bottom, its heavy cells (tagged `heavy`: training, launching) interrupted after 3 s and run again, then each heavy cell is run again on
its own with the cells that read its results (a second pass through the notebook), and at the end no DeepSpeed
engine may be alive.
"""
import pytest

from conftest import ROOT
from run_notebooks import execute_with_habits  # scripts/ is on pytest's pythonpath (pyproject.toml)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_survives_interrupts_and_reruns(path):
    result = execute_with_habits(path)
    assert result["passed"], result["error"] + "\n" + "\n".join(result["log"])
    assert result["log"][-1] == "live DeepSpeed engines: 0"
    assert any("run again" in line for line in result["log"])
