"""What the measured-run benchmarks share (benchmarks/stages.py, benchmarks/integrations.py): their command-line
options for a run, the corpus they train on, and how they write a report (JSON + its Markdown); and the runtime of
--emulate (benchmarks/ladder.py, benchmarks/offload_speed.py).

Imported by the benchmark scripts as `import _bench` (a script's own folder is first on sys.path).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_run_options", "check_run_options", "run_settings", "local_corpus", "local_train_blocks", "write_report",
           "emulated_runtime"]


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


def check_run_options(p: argparse.ArgumentParser, args: argparse.Namespace, sizes: list[str]) -> None:
    """Refuse, before any model is built or any data packed, the run options that would fail later: counts below 1,
    and a --seq-len longer than a model in `sizes` takes (issue 41: `stages.py --seq-len 100000` ended in
    datasets' "Invalid key: 0 is out of bounds"). argparse's error: the usage, the message with the longest
    --seq-len that works, exit status 2."""
    import helpers

    defaults = {a.dest: a.default for a in p._actions}
    for name in ("steps", "micro_batch", "seq_len"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            p.error(f"{flag} {getattr(args, name)}: must be at least 1. Fix: {flag} {defaults[name]}")
    if args.untimed_steps < 0:
        p.error(f"--untimed-steps {args.untimed_steps}: must be 0 or more. Fix: --untimed-steps {defaults['untimed_steps']}")
    positions = {size: helpers.model_shape(size).n_positions for size in sizes}
    known = {size: n for size, n in positions.items() if n}
    if known and args.seq_len > min(known.values()):
        longest = min(known.values())
        names = ", ".join(size for size, n in known.items() if n < args.seq_len)
        p.error(f"--seq-len {args.seq_len} is longer than {names} takes ({longest} positions: a longer block fails "
                f"in its position embedding, and the shipped corpus packs into few or no blocks that long). "
                f"Fix: --seq-len {longest} (the longest that works)")


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `add_run_options` that shape a run, for the report's "settings"."""
    return {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
            "untimed_steps": args.untimed_steps, "checkpointing": args.checkpointing, "lr": args.lr}


def local_corpus(work_dir: Path) -> tuple[Any, Any]:
    """The shipped corpus and the course's tokenizer trained on it, cached in work_dir/tokenizer, where the fresh
    processes a benchmark starts for its rungs load it from (helpers.fresh_process)."""
    import helpers

    ds = helpers.load_text_dataset("local")
    return ds, helpers.train_tokenizer(ds["train"]["text"], work_dir / "tokenizer")


def local_train_blocks(work_dir: Path, seq_len: int, max_blocks: int | None = None) -> Any:
    """The shipped corpus's train split through `local_corpus`'s tokenizer, packed into seq_len blocks (at most
    max_blocks)."""
    import helpers

    ds, tok = local_corpus(work_dir)
    return helpers.pack_blocks(ds["train"], tok, seq_len, max_blocks=max_blocks)


def emulated_runtime() -> Any:
    """The runtime of a benchmark's --emulate (benchmarks/ladder.py, offload_speed.py): the T4 budget switched on in
    this process and so in every child it starts (DS_COURSE_T4_BUDGET: fp16, PyTorch's allocator capped), Colab's RAM
    and CPUs (scripts/colab_emulation.ColabLimits) and the mechanism an enclosure would use here. Without the first,
    offload_speed's children ran capped while its report's label named the whole GPU's memory ("79.1787 GiB VRAM")."""
    import dataclasses
    import os

    import helpers
    from colab_emulation import ColabLimits, probe  # scripts/ on sys.path: the benchmarks put it there

    os.environ[helpers.hardware.T4_BUDGET_ENV] = "1"
    limits = ColabLimits()
    return dataclasses.replace(helpers.detect_runtime(), emulation=probe()[0], ram_total_bytes=limits.ram_bytes,
                               ram_budget_bytes=limits.ram_bytes, cpu_cores=limits.cpus, is_colab=True)


def write_report(report: dict[str, Any], out: Path, markdown: Callable[[dict[str, Any]], str]) -> None:
    """`report` as JSON at `out` and `markdown(report)` beside it (.md); called after each measured part, so a
    run cut short keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
