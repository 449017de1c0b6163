"""Benchmark: plain PyTorch AMP vs ZeRO 0/1/2/3 on one GPU, measured against the estimate (notebook 01).

    DS_COURSE_T4_BUDGET=1 python benchmarks/stages.py --sizes gpt2 gpt2-medium
    python benchmarks/stages.py --sizes gpt2-tiny --steps 4 --seq-len 64     # CPU smoke

Writes reports/stages.json (one row per model and config: params, peak_vram_gib, estimated_vram_gib,
peak_rss_gb, tokens_per_s, runtime label ...) and reports/stages.md, and checks the targets:
ZeRO-2 tokens/s >= 0.9x plain PyTorch AMP; estimate within 15 % of the measured peak.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import _bench
import helpers
from helpers.config import course_config
from helpers.memory import GiB, estimate_run
from helpers.records import report_gb

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = ("plain", "zero0", "zero1", "zero2", "zero3")


def stage_rows(size: str, model_dir: str, train_blocks, runtime, args) -> list[dict]:
    shape = helpers.model_shape(model_dir)
    rows = []
    for name in CONFIGS:
        plain = name == "plain"
        # one config per run, plain PyTorch included: it reads the same batch, lr and warm-up (a tenth of the steps)
        cfg = course_config(name, runtime, micro_batch_size=args.micro_batch, lr=args.lr,
                            warmup_steps=max(1, args.steps // 10))
        est = estimate_run(None if plain else cfg, shape, seq_len=args.seq_len, precision=runtime.precision,
                           checkpointing=args.checkpointing, micro_batch=args.micro_batch if plain else None)
        label = "plain PyTorch AMP" if plain and runtime.precision != "fp32" else \
            "plain PyTorch" if plain else name.replace("zero", "ZeRO-")
        r = helpers.train_run(label, lambda: helpers.load_causal_lm(model_dir), train_blocks, runtime=runtime,
                              ds_config=cfg, plain_pytorch=plain, steps=args.steps,
                              checkpointing=args.checkpointing, estimated_bytes=est.peak_bytes, model_name=size,
                              measure=helpers.train.MeasureSettings(untimed_steps=args.untimed_steps))
        row = r.as_dict()
        row.update(config=name, model_states_gib=round(est.states.gpu_total / GiB, 3),
                   activations_gib=round(est.activation_bytes / GiB, 3), loss_first=r.losses[0],
                   loss_last=r.losses[-1])
        row.pop("losses")
        rows.append(row)
        print(f"{size:<12} {r.row()}", flush=True)
    return rows


def per_gpu_estimates(n_params: int, precision: str) -> dict[str, dict[str, float]]:
    """Model-state GiB per GPU for stages 0-3 on 1, 2, 4, 8 GPUs (no buckets)."""
    return {f"zero{s}": {str(n): round(b / GiB, 3) for n, b in per_n.items()}
            for s, per_n in helpers.model_states_per_gpu(n_params, precision).items()}


def targets(rows: list[dict]) -> dict:
    out = {}
    for model in sorted({r["model"] for r in rows}):
        by = {r["config"]: r for r in rows if r["model"] == model}
        speed = by["zero2"]["tokens_per_s"] / by["plain"]["tokens_per_s"] if by["plain"]["tokens_per_s"] else None
        errors = [(abs(r["ratio"] - 1), r["config"]) for r in by.values() if r["ratio"] is not None]
        worst = max(errors) if errors else (None, None)  # no GPU: nothing measured to compare with
        out[model] = {"zero2_vs_plain_tokens_per_s": round(speed, 3) if speed else None,
                      "zero2_speed_target_met": bool(speed and speed >= 0.9),
                      "worst_estimate_error": None if worst[0] is None else round(worst[0], 3),
                      "worst_estimate_config": worst[1],
                      "estimate_target_met": None if worst[0] is None else worst[0] <= 0.15}
    return out


def markdown(report: dict) -> str:
    lines = [f"# ZeRO stages on one GPU ({report['runtime']}, {report['date']})", "",
             f"micro-batch {report['settings']['micro_batch']} x {report['settings']['seq_len']} tokens, "
             f"{report['settings']['steps']} steps, activation checkpointing "
             f"{'on' if report['settings']['checkpointing'] else 'off'}, precision {report['precision']}.", "",
             "| model | params | config | peak VRAM GiB | estimate GiB | measured/est. | tokens/s | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['name']} | {r['peak_vram_gib']:.2f} | "
                     f"{r['estimated_vram_gib']:.2f} | {r['ratio'] if r['ratio'] is not None else '-'} | "
                     f"{r['tokens_per_s']:,.0f} | {report_gb(r, 'peak_rss'):.2f} |")
    lines += ["", "Targets:", ""]
    for model, t in report["targets"].items():
        lines.append(f"- {model}: ZeRO-2 / plain tokens/s = {t['zero2_vs_plain_tokens_per_s']} "
                     f"(target >= 0.9: {'met' if t['zero2_speed_target_met'] else 'NOT met'}); "
                     + ("no GPU peak measured" if t["worst_estimate_error"] is None else
                        f"worst estimate error {t['worst_estimate_error']:.0%} ({t['worst_estimate_config']}; "
                        f"target <= 15%: {'met' if t['estimate_target_met'] else 'NOT met'})"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["gpt2", "gpt2-medium"])
    _bench.add_run_options(p, out=ROOT / "reports" / "stages.json", work_dir=ROOT / "build" / "bench")
    args = p.parse_args(argv)
    _bench.check_run_options(p, args, args.sizes)  # before anything is built

    runtime = helpers.detect_runtime()
    print(runtime, flush=True)
    train_blocks = _bench.local_train_blocks(args.work_dir, args.seq_len)
    rows: list[dict] = []
    for size in args.sizes:
        model_dir = helpers.save_model_from_config(args.work_dir / f"model-{size}", size)
        rows += stage_rows(size, model_dir, train_blocks, runtime, args)
        write_report(rows, runtime, args)  # after each size, so a cut-short run keeps what it measured
    print(args.out.with_suffix(".md").read_text())
    return 0


def write_report(rows: list[dict], runtime, args) -> None:
    report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "precision": runtime.precision,
              "settings": _bench.run_settings(args),
              "rows": rows, "targets": targets(rows),
              "per_gpu_model_states_gib": {r["model"]: per_gpu_estimates(r["params"], runtime.precision)
                                           for r in rows if r["config"] == "plain"}}
    _bench.write_report(report, args.out, markdown)


if __name__ == "__main__":
    sys.exit(main())
