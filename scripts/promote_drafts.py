"""Move the edited notebooks in notebooks/drafts/ over their versions in notebooks/ (issue 40's drafts): a draft works
in build/nbNN-draft so that it and its old version can run side by side in the test command; promoted, it works in
build/nbNN again. Run where the drafts' GPU check runs (scripts/gpu_pending.sh does, on its copy of the checkout) and
here once that check passed; then regenerate what docs/decisions.md ("How to land a GPU run") lists (executed copies,
gpu_check.json, README).

    python scripts/promote_drafts.py            # every draft
    python scripts/promote_drafts.py 01 04      # these drafts only
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRAFTS = ROOT / "notebooks" / "drafts"
WORK_DIR = re.compile(r'work_dir\(\\"nb(\d\d)-draft\\"\)(  # build/nb\d\d-draft \(build/nb\d\d once out of drafts/\)'
                      r'(?:: checkpoints and logs)?)?')


def promoted_text(text: str) -> str:
    """A draft's JSON text as it reads once promoted: its work folder is build/nbNN."""
    return WORK_DIR.sub(lambda m: f'work_dir(\\"nb{m.group(1)}\\")' + (
        f"  # build/nb{m.group(1)}: checkpoints and logs" if m.group(2) else ""), text)


def promote(numbers: list[str] | None = None, drafts: Path = DRAFTS) -> list[Path]:
    """Write each chosen draft over notebooks/<its name> and delete the draft; returns the notebooks written."""
    chosen = sorted(p for p in drafts.glob("[0-9][0-9]_*.ipynb") if not numbers or p.name[:2] in numbers)
    written = []
    for draft in chosen:
        text = promoted_text(draft.read_text())
        if "-draft" in text:
            raise SystemExit(f"{draft}: a 'draft' work folder is left after promotion; fix its work_dir line by hand")
        target = drafts.parent / draft.name
        target.write_text(text)
        draft.unlink()
        written.append(target)
    if drafts.is_dir() and not any(drafts.iterdir()):
        drafts.rmdir()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("numbers", nargs="*", help="two-digit notebook numbers (default: every draft)")
    args = parser.parse_args(argv)
    written = promote(args.numbers)
    print("promoted: " + (", ".join(str(p.relative_to(ROOT)) for p in written) or "nothing (no draft)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
