"""Benchmark: one DeepSpeed config, three drivers (raw engine, HF Trainer, Accelerate), measured (notebook 04).

    DS_COURSE_T4_BUDGET=1 python benchmarks/integrations.py                  # GPU: GPT-2 124M, ZeRO-2 and ZeRO-3
    python benchmarks/integrations.py --size gpt2-tiny --steps 4 --seq-len 32 --configs zero2   # CPU smoke

Same model (saved once, dropout off so every driver computes the same steps), same batches in the same order,
the same config dict (`helpers.course_config`) for the three drivers, same seed. Writes reports/integrations.json
(one row per driver and config: peak_vram_gib, estimated_vram_gib, first and final loss, tokens_per_s, runtime
label ...) and reports/integrations.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import _bench
import helpers
from helpers.config import course_config
from helpers.integrations import agreement, ordered_blocks, run_accelerate, run_trainer
from helpers.memory import estimate_run
from helpers.records import report_gb

ROOT = Path(__file__).resolve().parent.parent

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
DRIVERS = ("raw engine", "Trainer", "Accelerate")


def run_config(name: str, model_dir: str, train_blocks, runtime, args) -> list[dict]:
    shape = helpers.model_shape(model_dir)
    # the one config all three drivers get: batch sizes, learning rate and warm-up (a tenth of the steps) are in it
    cfg = course_config(name, runtime, micro_batch_size=args.micro_batch, lr=args.lr,
                        warmup_steps=max(1, args.steps // 10))
    est = estimate_run(cfg, shape, seq_len=args.seq_len, precision=runtime.precision,
                       checkpointing=args.checkpointing).peak_bytes
    common = dict(runtime=runtime, ds_config=cfg, checkpointing=args.checkpointing, estimated_bytes=est,
                  model_name=args.size)
    if cfg["zero_optimization"]["stage"] == 3:
        raw_factory = lambda: helpers.checkpoints.build_zero3_model(cfg, model_dir)  # noqa: E731
    else:
        raw_factory = lambda: helpers.load_causal_lm(model_dir)  # noqa: E731
    raw = helpers.train_run(f"raw engine {name}", raw_factory, train_blocks, steps=args.steps,
                            measure=helpers.train.MeasureSettings(untimed_steps=args.untimed_steps), **common)
    data = ordered_blocks(train_blocks, args.micro_batch, args.steps)
    trainer = run_trainer(f"Trainer {name}", lambda: helpers.load_causal_lm(model_dir), data,
                          output_dir=args.work_dir / f"trainer-{name}", untimed_steps=args.untimed_steps, **common)
    accel = run_accelerate(f"Accelerate {name}", lambda: helpers.load_causal_lm(model_dir), data,
                           untimed_steps=args.untimed_steps, **common)
    rows = []
    for driver, r in zip(DRIVERS, (raw, trainer, accel)):
        rows.append({"driver": driver, "config": name, "model": args.size, "params": r.params,
                     "precision": r.precision, "engine": r.extras.get("engine_class", "DeepSpeedEngine"),
                     "peak_vram_gib": r.peak_vram_gib, "estimated_vram_gib": r.estimated_vram_gib,
                     "peak_rss_gb": r.peak_rss_gb,
                     "first_loss": round(r.losses[0], 4) if r.losses else None,
                     "final_loss": round(r.losses[-1], 4) if r.losses else None,
                     "max_loss_diff_vs_raw": round(agreement(raw, r), 6), "tokens_per_s": r.tokens_per_s,
                     "seconds": r.seconds, "runtime": r.runtime, "error": r.error})
        print(f"{name:<6} {driver:<11} {r.row()}", flush=True)
    return rows


def summarise(rows: list[dict]) -> dict:
    out = {}
    for config in sorted({r["config"] for r in rows}):
        by = {r["driver"]: r for r in rows if r["config"] == config}
        raw = by["raw engine"]
        peaks = [r["peak_vram_gib"] for r in by.values()]
        out[config] = {
            "max_loss_diff": max(r["max_loss_diff_vs_raw"] for r in by.values()),
            "final_loss_spread": round(max(r["final_loss"] for r in by.values())
                                       - min(r["final_loss"] for r in by.values()), 6),
            "peak_vram_spread_gib": round(max(peaks) - min(peaks), 3),
            "tokens_per_s_vs_raw": {d: round(r["tokens_per_s"] / raw["tokens_per_s"], 3) if raw["tokens_per_s"]
                                    else None for d, r in by.items()},
        }
    return out


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# One config, three drivers ({report['runtime']}, {report['date']})", "",
             f"{report['model']} ({report['rows'][0]['params'] / 1e6:.1f}M params), micro-batch {s['micro_batch']} x "
             f"{s['seq_len']} tokens, {s['steps']} steps, activation checkpointing "
             f"{'on' if s['checkpointing'] else 'off'}, precision {report['precision']}, dropout off, same batches.",
             "", "| config | driver | peak VRAM GiB | estimate GiB | first loss | final loss | max loss diff vs raw "
             "| tokens/s | peak RSS GB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['config']} | {r['driver']} | {r['peak_vram_gib']:.2f} | {r['estimated_vram_gib']:.2f} | "
                     f"{r['first_loss']:.4f} | {r['final_loss']:.4f} | {r['max_loss_diff_vs_raw']:.2g} | "
                     f"{r['tokens_per_s']:,.0f} | {report_gb(r, 'peak_rss'):.2f} |")
    lines += ["", "Agreement per config:", ""]
    for config, a in report["agreement"].items():
        speeds = ", ".join(f"{d} {v}x" for d, v in a["tokens_per_s_vs_raw"].items() if d != "raw engine")
        lines.append(f"- {config}: largest per-step loss difference {a['max_loss_diff']:.2g}, peak VRAM spread "
                     f"{a['peak_vram_spread_gib']:.3f} GiB; tokens/s relative to the raw engine: {speeds}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="gpt2")
    p.add_argument("--configs", nargs="+", default=["zero2", "zero3"])
    _bench.add_run_options(p, out=ROOT / "reports" / "integrations.json", work_dir=ROOT / "build" / "bench_integrations")
    args = p.parse_args(argv)
    _bench.check_run_options(p, args, [args.size])  # before anything is built

    runtime = helpers.detect_runtime()
    print(runtime, flush=True)
    train_blocks = _bench.local_train_blocks(args.work_dir, args.seq_len)
    model_dir = helpers.save_model_from_config(args.work_dir / f"model-{args.size}-nodropout", args.size, **NO_DROPOUT)
    rows: list[dict] = []
    for name in args.configs:
        rows += run_config(name, model_dir, train_blocks, runtime, args)
        write_report(rows, runtime, args)  # after each config, so a cut-short run keeps what it measured
    print(args.out.with_suffix(".md").read_text())
    return 0


def write_report(rows: list[dict], runtime, args) -> None:
    import deepspeed
    import transformers

    import accelerate

    report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "precision": runtime.precision,
              "model": args.size, "versions": {"deepspeed": deepspeed.__version__,
                                               "transformers": transformers.__version__,
                                               "accelerate": accelerate.__version__},
              "settings": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
                           "untimed_steps": args.untimed_steps, "checkpointing": args.checkpointing, "lr": args.lr,
                           "dropout": 0.0},
              "rows": rows, "agreement": summarise(rows)}
    _bench.write_report(report, args.out, markdown)


if __name__ == "__main__":
    sys.exit(main())
