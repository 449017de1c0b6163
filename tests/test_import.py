import subprocess
import sys

from conftest import ROOT


def test_import_helpers_is_light_and_exports_resolve():
    code = ("import sys, helpers; heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'matplotlib', "
            "'ipywidgets', 'datasets') if m in sys.modules]; assert not heavy, heavy; "
            "[getattr(helpers, n) for n in helpers.__all__]; print(len(helpers.__all__))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip().splitlines()[-1]) >= 30


def test_unknown_name_raises_attribute_error():
    import helpers
    import pytest

    with pytest.raises(AttributeError):
        helpers.no_such_helper  # noqa: B018
