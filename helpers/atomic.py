"""Files and folders written whole or not at all (notebooks 01-05).

A helper that writes a file or a folder builds it under a temporary name beside its target and renames it into
place (`write_atomically`): an interrupted kernel (KeyboardInterrupt, a crash, a killed process) leaves either
nothing or the previous artefact, never a half-written one. Temporaries a dead process left behind are removed
by the next write. `needs_writing` tells a complete artefact (reused) from a half-written one that an older
version of a helper or a hand edit left (rebuilt, with a printed message), and `check_replaceable` refuses to
replace a folder that holds anything else, before the expensive work starts.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable, Iterable

__all__ = []


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _leftovers(target: Path) -> list[Path]:
    """Temporaries of `target` whose writer is gone (named .<name>.partial-<pid>-<id> / .<name>.old-<pid>-<id>)."""
    import psutil

    stale = []
    for p in target.parent.glob(f".{glob.escape(target.name)}.*-*"):
        kind, _, rest = p.name[len(target.name) + 2:].partition("-")
        pid = rest.split("-", 1)[0]
        if kind in ("partial", "old") and pid.isdigit() and (int(pid) == os.getpid()
                                                              or not psutil.pid_exists(int(pid))):
            stale.append(p)
    return stale


def write_atomically(target: str | os.PathLike[str], write: Callable[[Path], object]) -> Path:
    """Run `write(tmp)` to create a file or folder at `tmp` beside `target`, then rename it to `target`.

    An existing `target` is replaced only once the new one is complete; on any exception (KeyboardInterrupt
    included) the temporary is removed and the old `target` kept. Protects against interrupted and killed
    processes, not against power loss (no fsync). Used by every helper that writes to disk.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in _leftovers(target):
        _remove(stale)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = target.parent / f".{target.name}.partial-{tag}"
    old = target.parent / f".{target.name}.old-{tag}"
    try:
        write(tmp)
        if not (tmp.exists() or tmp.is_symlink()):
            raise FileNotFoundError(f"writing {target} produced nothing at {tmp}")
        if tmp.is_dir() and (target.exists() or target.is_symlink()):
            os.replace(target, old)  # a folder cannot be renamed over a full one: move the old one aside first
            os.replace(tmp, target)
            _remove(old)
        else:
            os.replace(tmp, target)  # a file replaces a file in one step
    except BaseException:
        if (old.exists() or old.is_symlink()) and not (target.exists() or target.is_symlink()):
            os.replace(old, target)
        _remove(tmp)
        raise
    return target


def _unused_name(path: Path) -> Path:
    """`path`, or path-2, path-3 ... : the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def check_replaceable(target: str | os.PathLike[str], allowed: Iterable[str], what: str) -> None:
    """Refuse (FileExistsError) to replace `target` when it is a file, or a folder holding files a saved `what`
    ('model', 'tokenizer') does not: `allowed` are glob patterns of its file names. Call it before the expensive work.
    """
    target = Path(target)
    if not (target.exists() or target.is_symlink()):
        return
    fix = f"Fix: pass a new folder, e.g. {str(_unused_name(target.with_name(f'{target.name}-{what}')))!r}."
    if not target.is_dir():
        raise FileExistsError(f"{str(target)!r} is a file, not a folder for a saved {what}. {fix}")
    patterns = tuple(allowed)
    foreign = sorted(p.name for p in target.iterdir() if not any(fnmatch.fnmatch(p.name, pat) for pat in patterns))
    if foreign:
        shown = ", ".join(foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise FileExistsError(f"{str(target)!r} holds files that are not part of a saved {what} ({shown}); saving "
                              f"the {what} there would replace them. {fix}")


def needs_writing(target: str | os.PathLike[str], problem: Callable[[Path], str | None], allowed: Iterable[str],
                  what: str) -> bool:
    """False when `target` holds a complete saved `what` (reuse it); True when it is absent or an empty folder, and
    also when it is half-written (`problem(target)` says what is wrong): then it prints that it rebuilds it.

    A file, or an incomplete folder with other files in it, is refused (`check_replaceable`).
    """
    target = Path(target)
    if not (target.exists() or target.is_symlink()):
        return True
    if target.is_dir() and not any(target.iterdir()):
        return True
    if target.is_dir() and problem(target) is None:
        return False
    check_replaceable(target, allowed, what)
    print(f"{target}: incomplete saved {what} ({problem(target)}; an interrupted save?): rebuilding it")
    return True
