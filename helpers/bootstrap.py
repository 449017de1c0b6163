"""The first code cell of every notebook (00-05) and the one call it makes: `helpers.start_notebook()`.

`BOOTSTRAP_CELL` is that cell's exact text: it finds the checkout (the cwd or a folder above it; on Colab it clones
the course into /content once), puts it first on sys.path and imports helpers, which is light (no torch). Then
`start_notebook` does the rest: on Colab the install of what Colab lacks (requirements-colab.txt, every package
Colab has held at its version, and helpers itself, editable, so launched programs import it; once per VM) and libaio
for NVMe offload; programs launched from the notebook import this checkout's helpers (installed, or through PYTHONPATH);
warnings filters; inline plots; DeepSpeed's first-engine imports (`warm_up_deepspeed`); and a short status block.
A notebook's parameters cell comes after this cell (every notebook has a T4_BUDGET parameter), and the cell after
it makes the runtime, once: `runtime = helpers.detect_runtime(T4_BUDGET)`.
`work_dir(name)` is the notebook's folder under the checkout's build/. scripts/apply_bootstrap.py writes the cell
into the notebooks; tests/test_repo.py checks each has it, unchanged.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

from helpers.hardware import in_colab
from helpers.progress import course_progress_bars
from helpers.runtime import announce_op_builds, warm_up_deepspeed

__all__ = ["start_notebook", "work_dir"]

BOOTSTRAP_CELL = '''\
# The course's bootstrap, the same cell in every notebook (helpers/bootstrap.py): find the course (on Colab, clone it)
import os, sys, subprocess, pathlib

COURSE_REPO = "https://github.com/deepspeed-course/deepspeed-course"  # the one place the course's address is written
COURSE_ROOT = next((d for d in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]
                    if (d / "helpers" / "__init__.py").is_file()), None)
if COURSE_ROOT is None and "google.colab" in sys.modules:
    COURSE_ROOT = pathlib.Path("/content/deepspeed-course")
    if not (COURSE_ROOT / "helpers" / "__init__.py").is_file():
        if COURSE_ROOT.exists():  # an interrupted clone, or another folder of that name
            raise RuntimeError(f"{COURSE_ROOT} has no helpers/. Fix: run !rm -rf {COURSE_ROOT}, then this cell again.")
        clone = subprocess.run(["git", "clone", "--depth", "1", COURSE_REPO, str(COURSE_ROOT)], capture_output=True,
                               text=True)
        if clone.returncode:
            raise RuntimeError(f"git clone failed: {clone.stderr.strip()[-300:]}\\nFix: check that this runtime is "
                               "online, then run this cell again.")
if COURSE_ROOT is None:
    raise RuntimeError("Run this notebook from a checkout of the course (or in Colab): helpers/ was not found.")
if sys.path[:1] != [str(COURSE_ROOT)]:
    sys.path.insert(0, str(COURSE_ROOT))
import helpers

helpers.start_notebook()  # Colab: pinned install (once); then warnings, plots, DeepSpeed warm-up, versions'''

DIST_NAME = "deepspeed-course-helpers"  # pyproject.toml's project name
COLAB_MARKER = ".colab-installed"  # in the checkout: the Colab install ran on this VM
COLAB_REQUIREMENTS = "requirements-colab.txt"  # what Colab lacks; everything Colab has stays as it is
LIBAIO_HEADER = Path("/usr/include/libaio.h")


def course_root() -> Path:
    """The checkout this `helpers` was imported from."""
    return Path(__file__).resolve().parent.parent


def work_dir(name: str, root: str | os.PathLike[str] | None = None) -> Path:
    """The notebook's own folder `build/<name>` in the checkout (made if missing), e.g. work_dir("nb02")
    (notebook 00)."""
    if not name or os.sep in name or name in (".", ".."):
        raise ValueError(f"work_dir needs a plain folder name such as 'nb02' (got {name!r})")
    path = Path(root or course_root()) / "build" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def installed_root() -> Path | None:
    """The checkout that `pip install -e` installed helpers from (what launched programs import), or None."""
    import importlib.metadata

    try:
        direct = importlib.metadata.distribution(DIST_NAME).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    url = json.loads(direct or "{}").get("url", "")
    return Path(url.removeprefix("file://")) if url.startswith("file://") else None


def installed_versions() -> dict[str, str]:
    """name -> version of every distribution this Python has (read from its metadata, nothing imported)."""
    import importlib.metadata

    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").strip()
        if name:
            versions.setdefault(name.lower().replace("_", "-"), dist.version)
    return versions


def _imported_distributions(changed: set[str]) -> list[str]:
    """Of the distributions in `changed`, those whose modules this process has already imported."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    imported = {m.split(".")[0] for m in list(sys.modules)}
    return sorted({d.lower().replace("_", "-") for m in imported for d in owners.get(m, [])} & changed)


def install_on_colab(root: Path) -> bool:
    """On Colab, once per VM: only what Colab lacks (requirements-colab.txt: DeepSpeed and what it needs), then
    helpers itself, editable, so programs the notebooks launch import it. Returns True when it installed now.

    Every package Colab already has is held at its version by a constraint file listing them all: its torch (never
    reinstalled), transformers, datasets and accelerate, and the jupyter / ipykernel / ipywidgets / notebook / tornado
    packages its frontend runs on. scripts/colab_software.py checks this against Colab's own package list. Should a
    package this kernel has already imported change anyway, the cell stops and says to restart the session.
    """
    marker = root / COLAB_MARKER
    if not in_colab() or marker.exists():
        return False
    before = installed_versions()
    keep = root / "build" / "colab-installed-versions.txt"
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.write_text("".join(f"{name}=={version}\n" for name, version in sorted(before.items())))
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    _pip(pip + ["-r", str(root / COLAB_REQUIREMENTS), "-c", str(keep)], "DeepSpeed and what it needs")
    _pip(pip + ["--no-deps", "--no-build-isolation", "-e", str(root)], "the course's helpers")
    marker.touch()
    after = installed_versions()
    stale = _imported_distributions({n for n, v in before.items() if after.get(n) != v})
    if stale:
        raise RuntimeError(f"the install changed {', '.join(stale)}, which this session had already imported: "
                           "choose Runtime > Restart session, then run this cell again (it will not install twice)")
    return True


def _pip(argv: list[str], what: str) -> None:
    """Run one pip install; on failure raise what happened (pip's last lines) and what to do (issue 41: a bare
    CalledProcessError said neither). Nothing is marked installed, so re-running the cell tries again."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode == 0:
        return
    said = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-3:])
    offline = any(w in said for w in ("No matching distribution", "Could not find a version", "Failed to establish",
                                      "Temporary failure in name resolution", "Network is unreachable"))
    fix = ("this VM could not reach PyPI (the Python package index): check the connection, or choose Runtime > "
           "Disconnect and delete runtime for a fresh VM" if offline else "read pip's message above")
    raise RuntimeError(f"installing {what} failed (pip exit {done.returncode}):\n{said}\nWhat to do: {fix}; then run "
                       "this cell again (nothing was marked installed, so it tries again).")


# what a complete checkout has (an interrupted `git clone` on Colab leaves a folder without some of them)
CHECKOUT_FILES = ("helpers/__init__.py", "pyproject.toml", COLAB_REQUIREMENTS)
GIT_LOOKUP_TIMEOUT_S = 10.0  # `git ls-remote`: one round trip to GitHub; offline it fails or times out, and is skipped


def _check_checkout(root: Path) -> None:
    """Refuse a course folder that lacks what a checkout has, naming the fix (issue 41 item 8: an interrupted clone
    left /content/deepspeed-course that every later run of the cell took for the course)."""
    missing = [name for name in CHECKOUT_FILES if not (root / name).is_file()]
    if not missing:
        return
    fix = (f"run `!rm -rf {root}` in a cell, then this cell again: it clones the course anew" if in_colab() else
           f"restore them (`git -C {root} checkout -- .`), or clone the course again")
    raise RuntimeError(f"the course folder {root} is incomplete ({', '.join(missing)} missing): an interrupted "
                       f"`git clone`, or files removed. What to do: {fix}.")


def _git(root: Path, *args: str, timeout: float = GIT_LOOKUP_TIMEOUT_S) -> subprocess.CompletedProcess | None:
    """`git -C root *args`, its output captured, never prompting; None when git is missing or took too long."""
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return None


def _ok(done: subprocess.CompletedProcess | None) -> bool:
    return done is not None and done.returncode == 0


def _update_checkout(root: Path) -> bool:
    """On Colab: bring a checkout an earlier session of this VM cloned up to the course on GitHub (issue 41 item 8:
    a notebook opened from GitHub ran against the older helpers the bootstrap cell found). Returns True when it is
    the newest (or cannot be compared: offline, no git, not a clone: nothing happens).

    One `git ls-remote` (a round trip, no download) compares this commit with GitHub's. An older checkout with no
    changes of the learner's is updated (fetch, reset to GitHub's commit, the install marker removed so the install
    checks its pins again), then RuntimeError says to restart the session: this Python has the old helpers loaded.
    One with changes of the learner's is left alone, with a note giving the command that updates it."""
    if not in_colab() or not (root / ".git").exists():
        return True
    here, there = _git(root, "rev-parse", "HEAD"), _git(root, "ls-remote", "origin", "HEAD")
    if not _ok(here) or not _ok(there) or not there.stdout.split():  # type: ignore[union-attr]
        return True
    local, remote = here.stdout.strip(), there.stdout.split()[0]  # type: ignore[union-attr]
    if local == remote:
        return True
    command = (f"!git -C {root} fetch --depth 1 origin HEAD && git -C {root} reset --hard FETCH_HEAD && "
               f"rm -f {root / COLAB_MARKER}")
    restart = "then choose Runtime > Restart session and run this cell again"
    changed = _git(root, "status", "--porcelain", "--untracked-files=no")
    if not _ok(changed) or changed.stdout.strip():  # type: ignore[union-attr]
        print(f"note: the course on GitHub ({remote[:7]}) is newer than this VM's copy {root} ({local[:7]}), which "
              f"has changes of yours (`!git -C {root} status`), so it was not updated: notebooks opened from GitHub "
              f"may need the newer helpers. To update (your changes to the course's files are lost): {command}, "
              f"{restart}.")
        return False
    fetched = _git(root, "fetch", "--depth", "1", "origin", "HEAD", timeout=300)
    reset = _git(root, "reset", "--hard", "FETCH_HEAD") if _ok(fetched) else None
    if not _ok(reset):
        said = ((fetched if not _ok(fetched) else reset) or subprocess.CompletedProcess([], 1, "", "timed out"))
        last = ((said.stderr or said.stdout or "").strip().splitlines() or ["no output"])[-1]
        print(f"note: the course on GitHub ({remote[:7]}) is newer than this VM's copy {root} ({local[:7]}) and the "
              f"update failed (git said {last!r}). To update: {command}, {restart}.")
        return False
    (root / COLAB_MARKER).unlink(missing_ok=True)  # the install checks its pins again (they may have changed)
    raise RuntimeError(f"the course on GitHub is newer than this VM's copy: {root} is updated now ({local[:7]} -> "
                       f"{remote[:7]}), but this Python has the older helpers loaded. What to do: choose Runtime > "
                       "Restart session, then run this cell again.")


def install_libaio() -> bool:
    """On Colab, libaio's headers for DeepSpeed's async_io op (NVMe offload), once; True when it installed them.

    Colab's image has no libaio: apt-get installs it; when the VM's package lists are stale that fails, so the lists
    are refreshed (`apt-get update`) and the install tried again. Should it still fail, one line says so with the fix
    (NVMe offload, notebook 02, is the only lesson that needs it; the others run without)."""
    if not in_colab() or LIBAIO_HEADER.exists():
        return False
    install = ["apt-get", "install", "-y", "-qq", "libaio-dev"]
    done = subprocess.run(install, check=False, capture_output=True, text=True)
    if done.returncode != 0 or not LIBAIO_HEADER.exists():
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True, text=True)
        done = subprocess.run(install, check=False, capture_output=True, text=True)
    if LIBAIO_HEADER.exists():
        return True
    last = ((done.stderr or done.stdout or "").strip().splitlines() or ["no output"])[-1]
    print(f"note: libaio (for NVMe offload, notebook 02) did not install: apt-get said {last!r}. Fix: run "
          "`!apt-get update && apt-get install -y libaio-dev` in a cell, then this cell again; the other lessons "
          "do not need it.")
    return False


# Log lines of the libraries that say nothing a learner can act on, by logger and the start of the message:
# - DeepSpeed's WarmupLR asks itself for a learning rate while it is being built (lr_schedules.py, before its first
#   step; once per engine: ten times in notebook 01);
# - transformers (modeling_utils' `loss_function`) says `loss_type=None` is unrecognized for every GPT-2 config,
#   then uses the causal-LM loss anyway, which is the loss these models train with.
NOISE_LOG_MESSAGES = {
    "DeepSpeed": ("Attempting to get learning rate from scheduler before it has started",),
    "transformers.modeling_utils": ("`loss_type=None` was set in the config but it is unrecognized",),
    # offline, datasets says twice where it found the cached corpus; helpers.hub_or_local has said it once already
    "datasets.load": ("Using the latest cached version of the dataset since",),
    "datasets.packaged_modules.cache.cache": ("Found the latest cached dataset configuration",),
}
# DeepSpeed's ZeRO-3 step warns, in a paragraph meant for multi-rank jobs, when PyTorch's allocator had to flush its
# cache to find memory (stage3.py): that is memory pressure, worth one plain line for a learner, not nothing.
ALLOCATOR_FLUSHES = re.compile(r"(\d+) pytorch allocator cache flushes since last step")


class _DropMessages(logging.Filter):
    """Drops the records whose message starts with one of `starts`; every other record passes."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


class _AllocatorFlushesInOneLine(logging.Filter):
    """Rewrites DeepSpeed's allocator-flush paragraph as one line a learner can act on (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = ALLOCATOR_FLUSHES.match(record.getMessage())
        if found:
            record.msg = (f"GPU memory is nearly full: PyTorch freed its cached memory {found.group(1)} time(s) in the "
                          "last step to find room, which slows training (a smaller micro-batch, or more offload, "
                          "gives it room)")
            record.args = ()
        return True


def quiet_warnings() -> None:
    """Hide the FutureWarning and UserWarning noise of torch, transformers and DeepSpeed (the notebooks' habit), drop
    the log lines of `NOISE_LOG_MESSAGES` (exactly those) and shorten DeepSpeed's allocator-flush warning to one line.

    Filters sit on the loggers that make those records (DeepSpeed's "DeepSpeed", transformers' module logger), so
    nothing else they log is touched; calling this again adds no second filter."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    wanted: dict[str, list[logging.Filter]] = {name: [_DropMessages(starts)]
                                               for name, starts in NOISE_LOG_MESSAGES.items()}
    wanted["DeepSpeed"].append(_AllocatorFlushesInOneLine())
    for name, filters in wanted.items():
        logger = logging.getLogger(name)
        for new in filters:
            if not any(type(old) is type(new) for old in logger.filters):
                logger.addFilter(new)


def _inline_plots() -> None:
    """`%matplotlib inline` when running in IPython (a no-op elsewhere)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None and getattr(shell, "kernel", None) is not None:
        shell.run_line_magic("matplotlib", "inline")


def launched_programs_import(root: Path) -> str:
    """Make programs this notebook launches import helpers from `root`; returns how they do ("installed" or a note).

    With helpers installed from this checkout (scripts/setup.sh, or the Colab install) nothing is needed; otherwise
    (another checkout installed, or none: a bare GPU machine) `root` is put first on PYTHONPATH, which they inherit.
    """
    installed = installed_root()
    if installed is not None and installed.resolve() == root.resolve():
        return "installed"
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *paths])
    where = "not installed" if installed is None else f"installed from {installed}"
    return f"note: helpers is {where}; programs launched from here import {root}/helpers through PYTHONPATH"


def start_notebook() -> None:
    """Everything a notebook needs before its parameters cell (the runtime comes after them:
    `runtime = helpers.detect_runtime(T4_BUDGET)`, once) (notebook 00).

    Prints one status block: where the course code is, torch and DeepSpeed versions. First the checkout is checked:
    complete (`_check_checkout`) and, on Colab, as new as the course on GitHub (`_update_checkout`).
    """
    root = course_root()
    _check_checkout(root)  # an interrupted clone: the fix, before pip reads a file it lacks
    _update_checkout(root)  # Colab: a copy an earlier session cloned, older than the course on GitHub
    installed = install_on_colab(root)
    install_libaio()
    quiet_warnings()
    _inline_plots()
    announce_op_builds()  # a line before DeepSpeed compiles an op for minutes on first use
    course_progress_bars()  # text bars when a runner saves the notebook; widgets that end as text otherwise
    warm_s = warm_up_deepspeed()  # the first engine's ~1500 imports, now: an interrupted cell cannot half-import them
    import deepspeed
    import torch

    lines = [f"course code: {root}" + (" (DeepSpeed and what Colab lacks installed now)" if installed else ""),
             f"torch {torch.__version__} | deepspeed {deepspeed.__version__} | DeepSpeed warmed up in {warm_s:.1f} s"]
    launched_programs_import(root)  # how launched programs find helpers: a developer's detail, not printed
    print("\n".join(lines))
