"""Why is ZeRO-2 slower than plain PyTorch AMP on one GPU? Measure one change at a time (notebook 01).

    DS_COURSE_T4_BUDGET=1 python benchmarks/zero2_speed.py --size gpt2

Writes reports/zero2_speed.json: tokens/s and peak VRAM for plain AMP and ZeRO-2 variants at the same
model and batch.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import _bench  # this script's folder is first on sys.path
import helpers

ROOT = Path(__file__).resolve().parent.parent


def variant(runtime, micro_batch: int, steps: int, **zero_overrides):
    """configs/zero2.json for this runtime with one change; plain AMP reads its batch, lr and warm-up from it too."""
    cfg = helpers.course_config("zero2", runtime, micro_batch_size=micro_batch, lr=3e-4,
                                warmup_steps=max(1, steps // 10))
    for key, value in zero_overrides.items():
        if key == "gradient_clipping":
            cfg.pop("gradient_clipping", None) if value is None else cfg.update(gradient_clipping=value)
        else:
            cfg["zero_optimization"][key] = value
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", default="gpt2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "zero2_speed.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args(argv)
    runtime = helpers.detect_runtime()
    blocks = _bench.local_train_blocks(args.work_dir, args.seq_len)
    model_dir = helpers.save_model_from_config(args.work_dir / f"model-{args.size}", args.size)
    n = args.steps
    runs = [  # name, config, plain PyTorch AMP?
        ("plain AMP, micro-batch 4", variant(runtime, 4, n), True),
        ("ZeRO-2 as in configs/, micro-batch 4", variant(runtime, 4, n), False),
        ("ZeRO-2 overlap_comm", variant(runtime, 4, n, overlap_comm=True), False),
        ("ZeRO-2 no gradient clipping", variant(runtime, 4, n, gradient_clipping=None), False),
        ("ZeRO-2 contiguous_gradients off", variant(runtime, 4, n, contiguous_gradients=False), False),
        ("plain AMP, micro-batch 8", variant(runtime, 8, n), True),
        ("ZeRO-2 as in configs/, micro-batch 8", variant(runtime, 8, n), False),
    ]
    rows = []
    for name, cfg, plain in runs:
        mb = cfg["train_micro_batch_size_per_gpu"]
        r = helpers.train_run(name, lambda: helpers.load_causal_lm(model_dir), blocks, runtime=runtime, ds_config=cfg,
                              plain_pytorch=plain, steps=args.steps, checkpointing=True, model_name=args.size,
                              measure=helpers.train.MeasureSettings(untimed_steps=3, progress=False))
        rows.append({"name": name, "micro_batch": mb, "tokens_per_s": r.tokens_per_s, "peak_vram_gib": r.peak_vram_gib,
                     "loss_last": r.losses[-1]})
        print(f"{name:<40}{r.tokens_per_s:>10,.0f} tok/s {r.peak_vram_gib:>7.2f} GiB", flush=True)
        args.out.write_text(json.dumps({"runtime": runtime.label, "date": dt.date.today().isoformat(),
                                        "model": args.size, "seq_len": args.seq_len, "steps": args.steps,
                                        "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
