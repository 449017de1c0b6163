"""Notebook 07's train.py on the model its section 6 only plans (GPT-2 XL on a Colab T4, from a fresh runtime), run
for real inside the Colab emulation: the plan's GPU memory, RAM and disk beside what the run measured, phase by phase
(loading, deepspeed.initialize, training, save_checkpoint, zero_to_fp32).

Two commands, so that building the stand-in model (an fp32 copy of 6.2 GB at XL) is not in the run's RAM:
    python benchmarks/capstone.py --prepare --model gpt2-xl --nvme-path /tmp/cap-nvme --work-dir /tmp/capstone
    python scripts/colab_emulation.py --exec -- python benchmarks/capstone.py --model gpt2-xl --steps 4 \\
        --nvme-path /tmp/cap-nvme --work-dir /tmp/capstone --out reports/capstone_xl.json
Disk at XL: the stand-in 6.2 GB, NVMe swap 24.9, the checkpoint ~22 (optimizer states included), zero_to_fp32's
folder 6.2: ~59 GB with --consolidate, more than a 64 GB GPU machine leaves (scripts/gpu_pending.sh capstone_xl).
The second is the fresh runtime: this driver (lean, like a restarted Colab kernel) starts train.py through
`helpers.run_script`, the notebook's own watcher. Offline: the model is the course's stand-in built from its config
(random weights), the data the shipped corpus. tests/test_capstone runs both commands at gpt2-tiny on CPU.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # colab_emulation, for the runtime of --emulate
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench, also when loaded by path (tests)
import _bench  # noqa: E402

SCRIPT = ROOT / "notebooks" / "programs" / "train_your_model.py"
GB, GiB = 1e9, 2**30


def plan_for(model: str, runtime, seq_len: int, micro_batch: int, nvme_path: str):
    """Section 6's plan (a fresh runtime: nothing else holds RAM) on this runtime's budgets: (kind, plan)."""
    import helpers

    return helpers.pick_plan(model, runtime, seq_len=seq_len, micro_batch=micro_batch, nvme_path=nvme_path,
                             ram_in_use=0)


def prepare(args: argparse.Namespace) -> int:
    """The stand-in model folder and the config file, built outside the run."""
    import helpers

    args.work_dir.mkdir(parents=True, exist_ok=True)
    runtime = _bench.emulated_runtime() if args.emulate else helpers.detect_runtime()
    kind, plan = plan_for(args.model, runtime, args.seq_len, args.micro_batch, args.nvme_path)
    config = plan.config
    config["optimizer"]["params"]["lr"] = config["scheduler"]["params"]["warmup_max_lr"] = args.lr
    config["scheduler"]["params"]["warmup_num_steps"] = max(1, args.steps // 10)
    (args.work_dir / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")
    folder = helpers.capstone_model(args.model).path(args.work_dir)
    (args.work_dir / "prepared.json").write_text(json.dumps({"model": args.model, "folder": folder, "kind": kind}))
    print(f"prepared {args.model} ({kind}) in {args.work_dir}: {plan.report.needs()}")
    return 0


def run(args: argparse.Namespace) -> int:
    import helpers
    from helpers.data import LOCAL_CORPUS

    prepared_path = args.work_dir / "prepared.json"
    if not prepared_path.is_file():
        raise SystemExit(f"{prepared_path} is missing. Fix: run this command with --prepare first (same --model, "
                         "--work-dir)")
    prepared = json.loads(prepared_path.read_text())
    if prepared["model"] != args.model:
        raise SystemExit(f"{args.work_dir} was prepared for {prepared['model']}, not {args.model}. Fix: --prepare "
                         f"--model {args.model}, or --model {prepared['model']}")
    runtime = _bench.emulated_runtime() if args.emulate else helpers.detect_runtime()
    kind, plan = plan_for(args.model, runtime, args.seq_len, args.micro_batch, args.nvme_path)
    out = args.work_dir / "out"
    cmd = ["--model", prepared["folder"], "--deepspeed", str(args.work_dir / "ds_config.json"), "--data",
           str(LOCAL_CORPUS), "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--out", str(out)]
    cmd += ["--consolidate"] if args.consolidate else []
    result = helpers.run_script(SCRIPT, cmd, out=out, steps=args.steps, runtime=runtime,
                                nvme_path=args.nvme_path if "nvme" in kind else None)
    text = result.report(plan, runtime)
    print(text)
    report = {
        "runtime": runtime.label, "date": dt.date.today().isoformat(), "model": args.model, "config": kind,
        "settings": {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "steps": args.steps, "lr": args.lr,
                     "consolidate": args.consolidate},
        "plan": {"gpu_gib": round(plan.report.gpu_needed / GiB, 3), "ram_gb": round(plan.report.ram_needed / GB, 3),
                 "disk_gb": round(plan.report.disk_needed / GB, 3), "fits": plan.report.fits},
        "measured": {"trained": result.trained, "returncode": result.returncode, "seconds": result.seconds,
                     "losses": [round(x, 4) for x in result.losses],
                     "peak_gpu_gib": round(result.peak_gpu_bytes / GiB, 3),
                     "peak_script_rss_gb": round(result.peak_rss_bytes / GB, 3),
                     "peak_main_rss_gb": round(result.peak_main_rss_bytes / GB, 3),
                     "peak_with_driver_gb": round(result.peak_with_kernel_bytes / GB, 3),
                     "peak_ram_by_phase_gb": {k: round(v / GB, 3) for k, v in result.peak_ram_by_phase.items()},
                     "peak_disk_gb": round(result.peak_disk_bytes / GB, 3),
                     "checkpoint_gb": round(result.checkpoint_bytes / GB, 3), "tail": result.tail[-8:]},
        "text": text,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _bench.write_report(report, args.out, markdown)
    return 0 if result.trained else 1


def markdown(report: dict) -> str:
    m, p = report["measured"], report["plan"]
    phases = ", ".join(f"{k} {v:.2f}" for k, v in m["peak_ram_by_phase_gb"].items())
    return "\n".join([
        f"# Notebook 07's train.py on {report['model']}, run ({report['runtime']}, {report['date']})", "",
        f"Config `{report['config']}` as the planner chose it for a fresh runtime; {report['settings']}; "
        "`python benchmarks/capstone.py` (its docstring has the commands).", "",
        "| | plan | measured |", "|---|---|---|",
        f"| GPU (GiB, allocated) | {p['gpu_gib']:.2f} | {m['peak_gpu_gib']:.2f} |",
        f"| RAM (GB): the script's process tree | {p['ram_gb']:.2f} | {m['peak_script_rss_gb']:.2f} |",
        f"| RAM (GB): with the driver (a fresh kernel's share) | | {m['peak_with_driver_gb']:.2f} |",
        f"| disk (GB): output and NVMe folders | {p['disk_gb']:.2f} | {m['peak_disk_gb']:.2f} |", "",
        f"RAM by phase (GB, driver and script together): {phases}.", "",
        "```", report["text"], "```", ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare", action="store_true", help="build the stand-in model folder and the config, then stop")
    p.add_argument("--emulate", action="store_true", help="plan on the Colab emulation's budgets (RAM, CPUs, T4 cap)")
    p.add_argument("--model", default="gpt2-xl")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-consolidate", dest="consolidate", action="store_false",
                   help="train.py without --consolidate (no zero_to_fp32 folder: at XL 6.2 GB less disk)")
    p.add_argument("--nvme-path", default="/tmp/capstone-nvme")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "capstone")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "capstone_xl.json")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing from the Hub: the stand-in and the shipped corpus
    return prepare(args) if args.prepare else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
