"""The planner in a real browser (issue 16): scripts/browser_test.py under pytest.

Opt-in (it runs notebook 00 in JupyterLab and the planner in Notebook 7, ~1.5-4 min on 2 cores; then, with
`--classic`, in classic Notebook 6 on Colab's ipywidgets 7.7.1, ~2 min): DS_COURSE_BROWSER_TEST=1, with Debian's
chromium and chromium-driver installed and selenium in the environment (see the script's docstring); the classic run
also needs the venv of Colab's versions at build/colab-widgets-env. Skipped otherwise, so CI, which installs none of it,
does not run them.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not os.environ.get("DS_COURSE_BROWSER_TEST") or importlib.util.find_spec("selenium") is None
    or not shutil.which("chromium") or not shutil.which("chromedriver"),
    reason="opt-in: DS_COURSE_BROWSER_TEST=1 with chromium, chromium-driver and selenium installed")


def test_the_planner_of_notebook_00_works_in_a_browser():
    out = ROOT / "build" / "browser"
    for old in out.glob("*.png"):
        old.unlink()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "browser_test.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "PASSED" in done.stdout
    shots = sorted(p.name for p in out.glob("*.png"))
    assert shots == ["01_planner_after_run_all.png", "02_model_gpt2-medium.png", "03_stage_3.png",
                     "04_micro_batch_16_details_open.png", "04b_micro_batch_2000.png", "05_hub_lookup_error.png",
                     "05b_narrow_900px_chart.png", "05b_narrow_900px_long_apply.png",
                     "05c_narrow_900px_refused_apply.png", "05d_refusal_fix_applied.png",
                     "06_reopened_without_kernel.png", "07_notebook7_planner.png", "07b_notebook7_kernel_restarted.png",
                     "08_notebook7_reopened.png"], shots


CLASSIC_ENV = ROOT / "build" / "colab-widgets-env"


@pytest.mark.skipif(not (CLASSIC_ENV / "bin" / "python").is_file(),
                    reason="needs the venv of Colab's versions at build/colab-widgets-env (browser_test.py's docstring)")
def test_notebook_00_s_widgets_work_in_classic_notebook_on_colab_s_ipywidgets_7():
    out = ROOT / "build" / "browser" / "classic"
    for old in out.glob("*.png"):
        old.unlink()
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "browser_test.py"), "--classic", "--env",
                           str(CLASSIC_ENV)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "PASSED (classic Notebook)" in done.stdout
    shots = sorted(p.name for p in out.glob("*.png"))
    assert shots == ["00_training_bar_finished.png", "01_planner_after_run_all.png", "02_model_gpt2-medium.png",
                     "03_stage_3.png", "04_micro_batch_16_details_open.png", "04b_micro_batch_2000.png",
                     "05_hub_lookup_error.png", "05b_narrow_900px_chart.png", "05b_narrow_900px_long_apply.png",
                     "05c_narrow_900px_refused_apply.png", "05d_refusal_fix_applied.png", "05e_kernel_restarted.png",
                     "06_reopened_planner_static_copy.png", "07_reopened_training_bar.png"], shots
