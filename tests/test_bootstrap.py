"""helpers.bootstrap: the one bootstrap cell and `start_notebook` (every notebook's first code cell)."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import bootstrap


def test_bootstrap_cell_is_python_that_finds_this_checkout_from_a_subfolder(tmp_path):
    """Run the cell's search-and-import part from notebooks/ in a fresh interpreter (the helpers call stubbed)."""
    ast.parse(bootstrap.BOOTSTRAP_CELL)
    cell = bootstrap.BOOTSTRAP_CELL.replace("helpers.start_notebook()", "None")
    assert cell != bootstrap.BOOTSTRAP_CELL
    code = cell + "\nprint(COURSE_ROOT, sys.path[0], helpers.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "notebooks", capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    root, first, module = out.stdout.split()
    assert root == first == str(ROOT) and module == str(ROOT / "helpers" / "__init__.py")
    outside = subprocess.run([sys.executable, "-c", cell], cwd=tmp_path, capture_output=True, text=True)
    assert "Run this notebook from a checkout of the course" in outside.stderr


@pytest.mark.slow
def test_on_colab_a_folder_without_helpers_and_a_failed_clone_say_what_to_do_and_the_fix_works(tmp_path):
    """Issue 41 item 8, the cell's Colab branch (google.colab stubbed, /content/deepspeed-course moved to tmp_path):
    a folder without helpers/ (an interrupted clone) is refused with `rm -rf` as the fix; a clone that fails says so
    with git's reason and what to do; after the fix, with the course reachable, the cell clones and imports."""
    target = tmp_path / "content" / "deepspeed-course"
    source = tmp_path / "course"  # a tiny course to clone: helpers/__init__.py in a git repository
    (source / "helpers").mkdir(parents=True)
    (source / "helpers" / "__init__.py").write_text("def start_notebook():\n    print('started')\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(source)]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "course"]):
        subprocess.run(git + args, check=True, capture_output=True)

    def run(repo: str) -> subprocess.CompletedProcess:
        cell = (bootstrap.BOOTSTRAP_CELL.replace("/content/deepspeed-course", str(target))
                .replace('"https://github.com/deepspeed-course/deepspeed-course"', repr(repo)))
        code = "import sys, types\nsys.modules['google.colab'] = types.ModuleType('google.colab')\n" + cell
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})

    target.mkdir(parents=True)  # an interrupted clone left the folder without helpers/
    refused = run(f"file://{source}")
    assert refused.returncode != 0 and f"{target} has no helpers/" in refused.stderr
    assert f"rm -rf {target}" in refused.stderr
    target.rmdir()  # the fix
    offline = run(f"file://{tmp_path / 'unreachable'}")
    assert offline.returncode != 0 and "git clone failed:" in offline.stderr and "online" in offline.stderr
    assert not target.exists()
    cloned = run(f"file://{source}")
    assert cloned.returncode == 0, cloned.stderr
    assert (target / "helpers" / "__init__.py").is_file() and "started" in cloned.stdout


def test_work_dir_is_the_notebooks_own_folder_under_build(tmp_path):
    assert bootstrap.work_dir("nb09", tmp_path) == tmp_path / "build" / "nb09"
    assert (tmp_path / "build" / "nb09").is_dir()
    with pytest.raises(ValueError, match="plain folder name"):
        bootstrap.work_dir("../elsewhere", tmp_path)


def test_launched_programs_import_this_checkouts_helpers(tmp_path, monkeypatch):
    """Installed from this checkout (pip install -e ., scripts/setup.sh): nothing to do. Elsewhere (another
    checkout, or a bare GPU machine) the checkout goes first on PYTHONPATH, which launched programs inherit."""
    assert bootstrap.installed_root() == ROOT
    monkeypatch.setenv("PYTHONPATH", "/some/where")
    assert bootstrap.launched_programs_import(ROOT) == "installed"
    other = tmp_path / "copy"
    assert "through PYTHONPATH" in bootstrap.launched_programs_import(other)
    assert bootstrap.launched_programs_import(other) != "installed"  # again: no second entry
    assert os.environ["PYTHONPATH"] == os.pathsep.join([str(other), "/some/where"])


def test_nothing_is_installed_off_colab(tmp_path, monkeypatch):
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    calls = []
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda *a, **k: calls.append(a))
    assert bootstrap.install_on_colab(tmp_path) is False and bootstrap.install_libaio() is False
    assert calls == [] and not (tmp_path / bootstrap.COLAB_MARKER).exists()


def test_on_colab_the_install_adds_only_what_colab_lacks_once(tmp_path, monkeypatch):
    """requirements-colab.txt, with every installed distribution (torch, the jupyter stack ...) held at its version by
    a constraint file; then helpers, editable; once per VM (marker)."""
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    calls = []
    monkeypatch.setattr(bootstrap.subprocess, "run",
                        lambda argv, **k: calls.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""))
    assert bootstrap.install_on_colab(tmp_path) is True
    assert len(calls) == 2 and calls[0][-4:] == ["-r", str(tmp_path / "requirements-colab.txt"), "-c",
                                                 str(tmp_path / "build" / "colab-installed-versions.txt")]
    held = dict(line.split("==", 1) for line in (tmp_path / "build" / "colab-installed-versions.txt").read_text().split())
    from importlib.metadata import version

    assert held["torch"] == version("torch") and held["ipykernel"] == version("ipykernel")  # exactly as installed
    assert calls[1][-2:] == ["-e", str(tmp_path)]
    assert not [a for argv in calls for a in argv if a.startswith("torch")]
    assert bootstrap.install_on_colab(tmp_path) is False and len(calls) == 2  # marker: once per VM


def test_an_install_that_changes_an_imported_package_says_to_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, 0, "", ""))
    real = bootstrap.installed_versions()
    seen = iter([real, {**real, "pytest": "0.1"}])  # this process has imported pytest
    monkeypatch.setattr(bootstrap, "installed_versions", lambda: next(seen))
    with pytest.raises(RuntimeError, match=r"changed pytest, .*Runtime > Restart session"):
        bootstrap.install_on_colab(tmp_path)
    assert (tmp_path / bootstrap.COLAB_MARKER).exists()  # the re-run after the restart does not install again


def test_an_install_pypi_refuses_says_what_happened_and_what_to_do_and_can_be_rerun(tmp_path, monkeypatch, capsys):
    """Issue 41 item 8: PyPI unreachable gave pip's 'No matching distribution' and a bare CalledProcessError."""
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    failed = "ERROR: No matching distribution found for deepspeed==0.19.8"
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, 1, "", failed))
    with pytest.raises(RuntimeError, match=r"(?s)installing DeepSpeed.*failed \(pip exit 1\).*No matching.*could not "
                                           r"reach PyPI.*run this cell again"):
        bootstrap.install_on_colab(tmp_path)
    assert not (tmp_path / bootstrap.COLAB_MARKER).exists()  # the re-run tries again
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda argv, **k: subprocess.CompletedProcess(argv, 0, "", ""))
    assert bootstrap.install_on_colab(tmp_path) is True


def test_libaio_refreshes_stale_package_lists_and_says_the_fix_when_it_still_fails(tmp_path, monkeypatch, capsys):
    """Issue 41 item 8: apt-get install without apt-get update, its output discarded and its failure ignored."""
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    header = tmp_path / "libaio.h"
    monkeypatch.setattr(bootstrap, "LIBAIO_HEADER", header)
    calls = []

    def apt(argv, **k):  # the install fails until the package lists are refreshed
        calls.append(argv[:2])
        if argv[1] == "install" and ["apt-get", "update"] in calls:
            header.write_text("")
            return subprocess.CompletedProcess(argv, 0, "", "")
        return subprocess.CompletedProcess(argv, 100 if argv[1] == "install" else 0, "", "E: Unable to locate package")

    monkeypatch.setattr(bootstrap.subprocess, "run", apt)
    assert bootstrap.install_libaio() is True and calls == [["apt-get", "install"], ["apt-get", "update"],
                                                            ["apt-get", "install"]]
    header.unlink()
    monkeypatch.setattr(bootstrap.subprocess, "run",
                        lambda argv, **k: subprocess.CompletedProcess(argv, 100, "", "E: Unable to locate package"))
    assert bootstrap.install_libaio() is False
    out = capsys.readouterr().out
    assert "E: Unable to locate package" in out and "apt-get update && apt-get install -y libaio-dev" in out


def test_colab_requirements_name_only_what_colab_lacks():
    """The install adds; it never asks for a package Colab ships (its versions come from Colab's own list)."""
    import colab_software

    pins = colab_software.colab_pins()
    names = [colab_software.normalize(re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0])
             for line in (ROOT / "requirements-colab.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert names == ["deepspeed"]
    assert not [n for n in names if n in pins]


def test_start_notebook_prints_one_status_block_and_leaves_the_runtime_to_the_notebook(monkeypatch, capsys):
    monkeypatch.setattr(bootstrap, "warm_up_deepspeed", lambda: 0.5)
    assert bootstrap.start_notebook() is None  # the runtime is made once, after the parameters cell (T4_BUDGET)
    out = capsys.readouterr().out
    assert f"course code: {ROOT}\n" in out and "Runtime" not in out
    assert "| DeepSpeed warmed up in 0.5 s" in out


def test_quiet_warnings_drops_exactly_the_library_noise_and_shortens_the_allocator_warning():
    """The DeepSpeed and transformers lines a learner cannot act on are dropped at their loggers; other lines of the
    same loggers pass untouched; DeepSpeed's allocator-flush paragraph (memory pressure) becomes one plain line."""
    import logging

    bootstrap.quiet_warnings()
    bootstrap.quiet_warnings()  # a second call (every notebook calls it) adds no second filter

    def passes(logger_name, msg, *args):
        logger = logging.getLogger(logger_name)
        record = logger.makeRecord(logger_name, logging.WARNING, "x.py", 1, msg, args, None)
        return record if logger.filter(record) else None

    assert passes("DeepSpeed", "Attempting to get learning rate from scheduler before it has started") is None
    assert passes("transformers.modeling_utils", "`loss_type=None` was set in the config but it is unrecognized. "
                  "Using the default loss: `ForCausalLMLoss`.") is None
    for name, msg in [("DeepSpeed", "[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536"),
                      ("DeepSpeed", "Using unknown warmup_type: x. The increasing function is set to default (log)"),
                      ("transformers.modeling_utils", "`loss_type=ForMaskedLM` was set ..."),
                      ("transformers.modeling_utils", "Some weights of GPT2LMHeadModel were not initialized"),
                      ("some.other.library", "Attempting to get learning rate from scheduler before it has started")]:
        record = passes(name, msg)
        assert record is not None and record.getMessage() == msg, (name, msg)
    flush = passes("DeepSpeed", "%d pytorch allocator cache flushes since last step. this happens when there is high "
                   "memory pressure and is detrimental to performance. if this is happening frequently consider "
                   "adjusting settings to reduce memory consumption.", 3)
    assert flush is not None and flush.getMessage().startswith("GPU memory is nearly full: PyTorch freed its cached "
                                                               "memory 3 time(s) in the last step")
    assert "\n" not in flush.getMessage() and "ranks" not in flush.getMessage()
    kinds = [type(f).__name__ for f in logging.getLogger("DeepSpeed").filters]
    assert sorted(kinds) == sorted(set(kinds))


def _fake_git(monkeypatch, *, remote, local="a" * 40, dirty="", online=True, fetch_ok=True):
    """subprocess.run answering git as a Colab clone would; returns the list of git commands run."""
    calls = []

    def run(argv, **kwargs):
        assert argv[:3] == ["git", "-C", argv[2]] and kwargs.get("timeout"), argv  # never without a time limit
        calls.append(argv[3:])
        what = argv[3]
        if what == "ls-remote" and not online:
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        out = {"rev-parse": local + "\n", "ls-remote": f"{remote}\tHEAD\n", "status": dirty}.get(what, "")
        code = 128 if what == "fetch" and not fetch_ok else 0
        return subprocess.CompletedProcess(argv, code, out, "fatal: unable to access: Could not resolve host"
                                           if code else "")

    monkeypatch.setattr(bootstrap.subprocess, "run", run)
    return calls


def test_an_older_colab_checkout_is_updated_then_the_cell_says_to_restart_and_the_rerun_passes(tmp_path, monkeypatch,
                                                                                               capsys):
    """Issue 41 item 8: a VM that already had the course never updated it, so a newer notebook opened from GitHub ran
    against older helpers. One `git ls-remote` compares; offline nothing happens."""
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    (tmp_path / ".git").mkdir()
    (tmp_path / bootstrap.COLAB_MARKER).touch()
    calls = _fake_git(monkeypatch, remote="a" * 40)
    assert bootstrap._update_checkout(tmp_path) is True and [c[0] for c in calls] == ["rev-parse", "ls-remote"]
    calls = _fake_git(monkeypatch, remote="b" * 40, online=False)
    assert bootstrap._update_checkout(tmp_path) is True and capsys.readouterr().out == ""  # offline: nothing said
    calls = _fake_git(monkeypatch, remote="b" * 40)
    with pytest.raises(RuntimeError, match=r"updated now \(aaaaaaa -> bbbbbbb\).*Runtime > Restart session, then "
                                           r"run this cell again"):
        bootstrap._update_checkout(tmp_path)
    assert [c[0] for c in calls] == ["rev-parse", "ls-remote", "status", "fetch", "reset"]
    assert calls[-1] == ["reset", "--hard", "FETCH_HEAD"] and not (tmp_path / bootstrap.COLAB_MARKER).exists()
    _fake_git(monkeypatch, remote="b" * 40, local="b" * 40)  # after the restart: the newest, the cell goes on
    assert bootstrap._update_checkout(tmp_path) is True


def test_an_older_checkout_with_the_learners_changes_or_a_failed_fetch_gets_the_command_that_updates_it(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    (tmp_path / ".git").mkdir()
    calls = _fake_git(monkeypatch, remote="b" * 40, dirty=" M helpers/train.py\n")
    assert bootstrap._update_checkout(tmp_path) is False and "reset" not in [c[0] for c in calls]
    out = capsys.readouterr().out
    assert "has changes of yours" in out and f"git -C {tmp_path} reset --hard FETCH_HEAD" in out
    _fake_git(monkeypatch, remote="b" * 40, fetch_ok=False)
    assert bootstrap._update_checkout(tmp_path) is False
    assert "update failed (git said 'fatal: unable to access: Could not resolve host')" in capsys.readouterr().out
    monkeypatch.delenv("COLAB_RELEASE_TAG")
    calls = _fake_git(monkeypatch, remote="b" * 40)
    assert bootstrap._update_checkout(tmp_path) is True and calls == []  # a developer's checkout: left alone


def test_an_incomplete_course_folder_is_refused_with_the_fix(tmp_path, monkeypatch):
    """Issue 41 item 8: /content/deepspeed-course without the course (an interrupted clone) failed the same way at
    every run of the cell."""
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "__init__.py").write_text("")
    with pytest.raises(RuntimeError, match=rf"incomplete \(pyproject.toml, requirements-colab.txt missing\).*"
                                           rf"`!rm -rf {tmp_path}`"):
        bootstrap._check_checkout(tmp_path)
    bootstrap._check_checkout(ROOT)  # a checkout passes
