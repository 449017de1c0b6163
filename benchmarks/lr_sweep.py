"""Benchmark: which peak learning rate lets a random model's loss fall in the ladder's first steps (issue 25).

    python benchmarks/lr_sweep.py --size gpt2-2.7b --lrs 3e-4 1.6e-4 1e-4 5e-5     # GPU, whole card, fp16 AMP
    python benchmarks/lr_sweep.py --size gpt2-tiny --seq-len 32 --steps 4            # CPU smoke (fp32)

The ladder (benchmarks/ladder.py) trains every rung a few steps from a random initialisation with one peak learning
rate (3e-4, a one-step warm-up) and calls the rung "fits" only if the loss fell. At 2.65B parameters (a 2560-wide
model) with DeepSpeed, 3e-4 made the loss rise (11.43 -> 16.45 in four steps) while GPT-2 XL (1600 wide) fell with
it: the first Adam steps move every weight by about lr, and the wider the layer the more those moves add up (GPT-3's
table: 1.6e-4 at 2.7B). Measuring that inside the Colab emulation costs ~55 s a step (the optimizer on NVMe); this
sweep measures the same question on the whole GPU in seconds: plain PyTorch (AdamW, the same linear warm-up,
clipping, weight decay, fp16 autocast with a GradScaler), the same data and steps, ONE initialisation copied for
every learning rate. Its answer picks the 2.7B rung's --lr; the rung itself is still measured with DeepSpeed.
Writes reports/lr_sweep.json and .md.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import sys
from pathlib import Path
from typing import Any

import helpers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402
from ladder import ladder_config  # noqa: E402  (the ladder's lr, warm-up, clipping: one definition)

from helpers.train import loss_fell  # noqa: E402


def falls(losses: list[float]) -> bool:
    """The ladder's test (benchmarks/ladder.py verdict): the last loss below the first."""
    return len(losses) >= 2 and losses[-1] < losses[0]


def pick(rows: list[dict[str, Any]]) -> float | None:
    """The learning rate whose run ended lowest among those whose loss fell; None when none fell."""
    ok = [r for r in rows if not r["error"] and falls(r["losses"])]
    return min(ok, key=lambda r: r["losses"][-1])["lr"] if ok else None


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"# Learning rate for the first steps of {s['size']} ({report['runtime']}, {report['date']})", "",
             f"Plain PyTorch, {report['precision']} autocast, {s['steps']} steps of {s['micro_batch']} x {s['seq_len']} "
             f"tokens, warm-up {s['warmup_steps']} step(s), one initialisation (seed {s['seed']}) for every lr. "
             "`python benchmarks/lr_sweep.py` regenerates it.", "",
             "| peak lr | warm-up steps | losses | falls | learns (issue 42) | error |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        losses = ", ".join(f"{x:.3f}" for x in r["losses"])
        learned = loss_fell(r["losses"], on_gpu=True)[1] if r["losses"] else "-"
        lines.append(f"| {r['lr']:g} | {r.get('warmup_steps', s['warmup_steps'])} | {losses} | "
                     f"{'yes' if falls(r['losses']) else 'no'} | {learned} | {r['error'][:80]} |")
    picked = report["picked_lr"]
    lines += ["", f"Picked: {picked:g} (the lowest last loss among the rates whose loss fell)." if picked else
              "Picked: none (no rate made the loss fall)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="gpt2-2.7b")
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1.6e-4, 1e-4, 5e-5])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, nargs="+", default=[0],
                   help="optimizer steps of linear warm-up, each a run per lr (0: the ladder's, half the steps)")
    p.add_argument("--n-layer", type=int, default=0, help="override the size's depth (a quick probe of its width)")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench-emulated")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for lr in args.lrs:
        helpers.checks.check_number("--lrs", lr, positive=True, integer=False, example=1e-4)
    import torch
    from transformers import AutoModelForCausalLM

    # the whole card, not the T4 cap (plain PyTorch's 2.7B needs ~45 GB), but the T4's fp16 numerics
    runtime = helpers.detect_runtime(t4_budget=False)
    if runtime.has_gpu:
        runtime = dataclasses.replace(runtime, precision="fp16")
    out = args.out or ROOT / "reports" / ("lr_sweep.json" if runtime.has_gpu else "lr_sweep_cpu.json")
    blocks = _bench.local_train_blocks(args.work_dir, args.seq_len, max_blocks=256)  # as the ladder's child packs them
    config = helpers.gpt2_config(args.size, **({"n_layer": args.n_layer} if args.n_layer else {}))
    torch.manual_seed(args.seed)
    template = AutoModelForCausalLM.from_config(config)  # one initialisation, copied per lr
    shape = helpers.model_shape(config)
    configs = {(lr, w): ladder_config("plain", runtime, None, shape.largest_layer_params,
                                      micro_batch=args.micro_batch, steps=args.steps, lr=lr, warmup_steps=w)
               for w in args.warmup_steps for lr in args.lrs}
    warmup = sorted({c["scheduler"]["params"]["warmup_num_steps"] for c in configs.values()})
    report: dict[str, Any] = {
        "runtime": runtime.label, "precision": runtime.precision, "date": dt.date.today().isoformat(),
        "settings": {"size": args.size, "n_layer": config.n_layer, "params": shape.n_params, "steps": args.steps, "micro_batch": args.micro_batch,
                     "seq_len": args.seq_len, "seed": args.seed, "warmup_steps": warmup[0] if len(warmup) == 1 else warmup},
        "rows": [], "picked_lr": None}
    for (lr, _), cfg in configs.items():
        w = cfg["scheduler"]["params"]["warmup_num_steps"]
        r = helpers.train_run(f"{args.size} lr {lr:g} warm-up {w}", lambda: copy.deepcopy(template), blocks,
                              runtime=runtime, ds_config=cfg, plain_pytorch=True, steps=args.steps,
                              checkpointing=True, seed=args.seed, model_name=args.size,
                              measure=helpers.train.MeasureSettings(untimed_steps=1, progress=not args.quiet))
        report["rows"].append({"lr": lr, "warmup_steps": w, "losses": r.losses, "error": r.error,
                               "seconds": r.seconds, "lrs": r.lrs})
        report["picked_lr"] = pick(report["rows"])
        _bench.write_report(report, out, markdown)
    print(out.with_suffix(".md").read_text())
    return 0 if report["picked_lr"] else 1


if __name__ == "__main__":
    sys.exit(main())
