"""What the measured-run benchmarks share (benchmarks/stages.py, benchmarks/integrations.py): their command-line
options for a run, the corpus they train on, and how they write a report (JSON + its Markdown).

Imported by the benchmark scripts as `import _bench` (a script's own folder is first on sys.path).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_run_options", "run_settings", "local_train_blocks", "write_report"]


def add_run_options(p: argparse.ArgumentParser, *, out: Path, work_dir: Path) -> None:
    """--steps, --untimed-steps (alias --warmup), --micro-batch, --seq-len, --lr, --no-checkpointing, --out,
    --work-dir."""
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--untimed-steps", "--warmup", dest="untimed_steps", type=int, default=3,
                   help="first steps left out of the tokens/s timing (not the learning-rate warm-up)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("--work-dir", type=Path, default=work_dir)


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `add_run_options` that shape a run, for the report's "settings"."""
    return {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
            "untimed_steps": args.untimed_steps, "checkpointing": args.checkpointing, "lr": args.lr}


def local_train_blocks(work_dir: Path, seq_len: int) -> Any:
    """The shipped corpus, a tokenizer trained on it (cached in work_dir/tokenizer), packed into seq_len blocks."""
    import helpers

    ds = helpers.load_text_dataset("local")
    tok = helpers.train_tokenizer(ds["train"]["text"], work_dir / "tokenizer")
    return helpers.pack_blocks(ds["train"], tok, seq_len)


def write_report(report: dict[str, Any], out: Path, markdown: Callable[[dict[str, Any]], str]) -> None:
    """`report` as JSON at `out` and `markdown(report)` beside it (.md); called after each measured part, so a
    run cut short keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
