"""Every notebook runs twice, top to bottom, in one kernel (engines torn down, memory back to baseline).

nbmake runs each notebook once (pytest --nbmake notebooks); this runs them twice in the same kernel.
"""
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from run_notebooks import execute  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_twice_in_one_kernel(path):
    result = execute(path, twice=True)
    assert result["passed"], result["error"]
