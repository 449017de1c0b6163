"""The course under Colab's software (issue 21): Colab's package list as a fixture, the install cell run against an
environment of those versions, the clone from a stand-in for GitHub, and notebooks 00-02 taking the Colab branches
there (scripts/colab_software.py). The full run builds a venv and compiles DeepSpeed's ops in it: ~15 min on 2 cores."""
import json
import re
import shutil

import pytest

import colab_software  # scripts/
from conftest import ROOT
from helpers.bootstrap import BOOTSTRAP_CELL

REPORT = json.loads((ROOT / "reports" / "colab_software.json").read_text())


def test_the_fixture_is_colabs_own_list_with_its_source():
    pins = colab_software.colab_pins()
    source = colab_software.fixture_source()
    assert source["repository"] == "https://github.com/googlecolab/backend-info" and re.fullmatch(r"[0-9a-f]{40}",
                                                                                                  source["commit"])
    assert source["python"].startswith("3.13") and "Ubuntu" in source["os"]
    # what issue 21 read off it; a refreshed fixture changes these on purpose
    assert pins["torch"] == "2.11.0" and pins["ipywidgets"] == "7.7.1" and pins["transformers"] == "5.15.0"
    assert "google-colab" not in pins  # installed from a URL: no version to pin
    # the frontend packages the install must leave alone are Colab's (comm is not: ipywidgets 7 predates it)
    assert [n for n in colab_software.COLAB_FRONTEND if colab_software.normalize(n) not in pins] == ["comm"]


def test_the_emulated_bootstrap_changes_only_the_address_and_content(tmp_path):
    cell = colab_software.emulated_bootstrap("file:///srv/course.git", tmp_path)
    changed = [(a, b) for a, b in zip(BOOTSTRAP_CELL.splitlines(), cell.splitlines()) if a != b]
    assert len(cell.splitlines()) == len(BOOTSTRAP_CELL.splitlines()) and len(changed) == 2
    assert 'COURSE_REPO = "file:///srv/course.git"' in changed[0][1]
    assert f'pathlib.Path("{tmp_path}/deepspeed-course")' in changed[1][1]


def test_the_committed_report_shows_the_install_leaves_colab_alone():
    fixed, before = REPORT["runs"]["after_fix"], REPORT["runs"]["before_fix"]
    assert REPORT["fixture"]["commit"] == colab_software.fixture_source()["commit"]
    ins = fixed["install"]
    assert ins["passed"] and ins["counts"]["upgraded"] == ins["counts"]["downgraded"] == ins["counts"]["removed"] == 0
    assert {"deepspeed", "deepspeed-course-helpers"} <= set(ins["changes"]["added"])
    assert ins["frontend_packages_changed"] == [] and ins["restart_needed_for"] == []
    assert ins["pip_check_after"] == ins["pip_check_before"]
    assert ins["loaded"]["transformers"] == colab_software.colab_pins()["transformers"]
    assert fixed["environment"]["torch_mode"] == "colab"
    for nn in ("00", "01", "02"):
        entry = next(e for n, e in fixed["notebooks"].items() if n.startswith(nn))
        assert entry["passed"], (nn, entry["error"])
    assert next(e for n, e in fixed["notebooks"].items() if n.startswith("01"))["branch"].startswith("Colab's branch")
    # what the install did before the fix, kept as the reason for it
    assert before["install"]["counts"]["upgraded"] + before["install"]["counts"]["downgraded"] > 0
    classic = next(v for k, v in REPORT["browser_test"].items() if "ipywidgets 7.7.1" in k)
    assert classic.startswith("passed")  # the widgets under Colab's kernel-side versions (scripts/browser_test.py)
    md = (ROOT / "reports" / "colab_software.md").read_text()
    assert "## Not emulated" in md and "Python" in md.split("## Not emulated")[1]


@pytest.mark.skipif(not colab_software.colab_pins(), reason="no fixture")
def test_a_first_colab_session_in_colabs_versions(tmp_path_factory):
    """CI's run: Colab's versions but the CPU torch on disk (no CUDA torch is downloaded), the bootstrap cell clones
    the committed course from a bare repository, installs, and notebooks 00-02 run through the Colab branches."""
    import tempfile
    from pathlib import Path

    work = Path(tempfile.mkdtemp(prefix="colab-software-ci-"))  # outside the checkout: the cell must clone
    try:
        entry = colab_software.report("local", ["00", "01", "02"], work, label="ci")
    finally:
        print(json.dumps(locals().get("entry", {}), indent=1, default=str)[:20000])  # the CI log keeps the run
    shutil.rmtree(work, ignore_errors=True)
    ins = entry["install"]
    assert ins["passed"], ins["error"]
    assert ins["counts"]["upgraded"] == ins["counts"]["downgraded"] == ins["counts"]["removed"] == 0, ins["changes"]
    assert ins["frontend_packages_changed"] == [] and ins["restart_needed_for"] == []
    assert ins["pip_check_after"] == ins["pip_check_before"], ins["pip_check_after"]
    assert ins["loaded"]["helpers"].startswith(str(work / "content" / "deepspeed-course"))  # the clone, not this tree
    for name, result in entry["notebooks"].items():
        assert result["passed"], f"{name}: {result['error']}"
    assert entry["notebooks"]["01_zero2_finetune_and_stages.ipynb"]["branch"].startswith("Colab's branch")


def test_the_readme_says_what_the_report_measured():
    readme = " ".join((ROOT / "README.md").read_text().split())
    ins = REPORT["runs"]["after_fix"]["install"]
    before = REPORT["runs"]["before_fix"]["install"]["counts"]
    notebooks = REPORT["runs"]["after_fix"]["notebooks"].values()
    assert (f"the install adds {ins['counts']['added']} packages ({', '.join(ins['changes']['added'])}) and changes "
            f"none, in {ins['bootstrap_seconds']:.0f} s") in readme
    assert f"before the fix it added {before['added']} and upgraded {before['upgraded']}" in readme
    assert f"then {sum(e['passed'] for e in notebooks)} of {len(notebooks)} notebooks passed there" in readme
