"""Benchmark: one DeepSpeed config, three drivers (raw engine, HF Trainer, Accelerate), measured (notebook 04).

    DS_COURSE_T4_BUDGET=1 python benchmarks/integrations.py                  # GPU: GPT-2 124M, ZeRO-2 and ZeRO-3
    python benchmarks/integrations.py --size gpt2-tiny --steps 4 --seq-len 32 --configs zero2   # CPU smoke

Same model (saved once, dropout off so every driver computes the same steps), same batches in the same order,
same config and seed. Writes reports/integrations.json (one row per driver and config: peak_vram_gib,
estimated_vram_gib, first and final loss, tokens_per_s, runtime label ...) and reports/integrations.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import helpers  # noqa: E402
from helpers.integrations import agreement, driver_config, ordered_blocks, run_accelerate, run_trainer  # noqa: E402
from helpers.memory import estimate_activations, estimate_peak  # noqa: E402

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
DRIVERS = ("raw engine", "Trainer", "Accelerate")


def run_config(name: str, model_dir: str, train_blocks, runtime, args) -> list[dict]:
    shape = helpers.model_shape(model_dir)
    cfg = driver_config(name, runtime, micro_batch=args.micro_batch, lr=args.lr, steps=args.steps)
    act = estimate_activations(args.micro_batch, args.seq_len, shape.hidden, shape.n_layers, shape.vocab,
                               n_heads=shape.n_heads, precision=runtime.precision, checkpointing=args.checkpointing)
    est, _ = estimate_peak(cfg, shape.n_params, precision=runtime.precision, activation_bytes=act,
                           largest_layer_params=shape.largest_layer_params)
    common = dict(runtime=runtime, ds_config=cfg, checkpointing=args.checkpointing, estimated_bytes=est,
                  model_name=args.size, warmup_steps=args.warmup)
    if cfg["zero_optimization"]["stage"] == 3:
        raw_factory = lambda: helpers.build_zero3_model(cfg, model_dir)  # noqa: E731
    else:
        raw_factory = lambda: helpers.load_causal_lm(model_dir)  # noqa: E731
    raw = helpers.train_run(f"raw engine {name}", raw_factory, train_blocks, steps=args.steps,
                            micro_batch=args.micro_batch, lr=args.lr, **common)
    data = ordered_blocks(train_blocks, args.micro_batch, args.steps)
    trainer, _ = run_trainer(f"Trainer {name}", lambda: helpers.load_causal_lm(model_dir), data,
                             output_dir=args.work_dir / f"trainer-{name}", **common)
    accel = run_accelerate(f"Accelerate {name}", lambda: helpers.load_causal_lm(model_dir), data, **common)
    rows = []
    for driver, r, engine in (("raw engine", raw, "DeepSpeedEngine"), ("Trainer", trainer.result, trainer.engine_class),
                              ("Accelerate", accel.result, accel.engine_class)):
        rows.append({"driver": driver, "config": name, "model": args.size, "params": r.params,
                     "precision": r.precision, "engine": engine, "peak_vram_gib": r.peak_vram_gib,
                     "estimated_vram_gib": r.estimated_vram_gib, "peak_rss_gib": r.peak_rss_gib,
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
             "| tokens/s | peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['config']} | {r['driver']} | {r['peak_vram_gib']:.2f} | {r['estimated_vram_gib']:.2f} | "
                     f"{r['first_loss']:.4f} | {r['final_loss']:.4f} | {r['max_loss_diff_vs_raw']:.2g} | "
                     f"{r['tokens_per_s']:,.0f} | {r['peak_rss_gib']:.2f} |")
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
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "integrations.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench_integrations")
    args = p.parse_args(argv)

    runtime = helpers.detect_runtime()
    print(runtime, flush=True)
    ds = helpers.load_text_dataset("local")
    tok = helpers.train_tokenizer(ds["train"]["text"], args.work_dir / "tokenizer")
    train_blocks = helpers.pack_blocks(ds["train"], tok, args.seq_len)
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
                           "warmup_steps": args.warmup, "checkpointing": args.checkpointing, "lr": args.lr,
                           "dropout": 0.0},
              "rows": rows, "agreement": summarise(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
