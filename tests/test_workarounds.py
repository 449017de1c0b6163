"""helpers.workarounds: every DeepSpeed workaround in one list, checked against the installed DeepSpeed (issue 43)."""
import importlib
import re

import pytest

from helpers.workarounds import DEEPSPEED_WORKAROUNDS


@pytest.mark.parametrize("w", DEEPSPEED_WORKAROUNDS, ids=[w.name for w in DEEPSPEED_WORKAROUNDS])
def test_each_workaround_was_checked_against_the_installed_deepspeed_and_its_code_exists(w):
    """Fails when DeepSpeed moves past the versions an entry was checked on: re-check its code (`where`) against the
    new version and its upstream report, then add the version to `checked` or remove the workaround."""
    import deepspeed

    module, _, name = w.where.partition(".")
    assert hasattr(importlib.import_module(f"helpers.{module}"), name), f"{w.name}: helpers.{w.where} does not exist"
    assert deepspeed.__version__ in w.checked, (
        f"{w.name} ({w.upstream}) was checked against DeepSpeed {', '.join(w.checked)}; this is "
        f"{deepspeed.__version__}: re-check helpers.{w.where}, then update helpers/workarounds.py")


def test_the_list_names_each_workaround_once():
    names = [w.name for w in DEEPSPEED_WORKAROUNDS]
    assert len(names) == len(set(names)) and len({w.where for w in DEEPSPEED_WORKAROUNDS}) == len(names)


def test_the_checked_deepspeed_version_has_one_home_that_the_requirements_pin():
    """Issue 43: DeepSpeed's version is written once (helpers.overflow_check, the lowest floor that needs it); the
    workaround list, moe's message and benchmarks/host_memory.py read it, and the requirements install exactly it."""
    from conftest import ROOT
    from helpers.overflow_check import CHECKED_DEEPSPEED
    from helpers.workarounds import CHECKED

    assert CHECKED_DEEPSPEED in CHECKED
    for name in ("requirements.txt", "requirements-colab.txt"):
        assert f"deepspeed=={CHECKED_DEEPSPEED}" in (ROOT / name).read_text().split(), name
    constant = re.compile(rf"^\s*\w+\s*=\s*\(?\s*[\"']{re.escape(CHECKED_DEEPSPEED)}[\"']", flags=re.M)
    twins = [p.name for p in (ROOT / "helpers").glob("*.py")
             if p.name != "overflow_check.py" and constant.search(p.read_text())]
    assert not twins, f"a second constant naming DeepSpeed {CHECKED_DEEPSPEED} in {twins}: import CHECKED_DEEPSPEED"
