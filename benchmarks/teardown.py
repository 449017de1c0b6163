"""Benchmark: what a torn-down ZeRO-3 engine leaves behind, with and without helpers.release_zero3_globals.

    DS_COURSE_T4_BUDGET=1 python benchmarks/teardown.py                    # GPU: GPT-2 medium, ZeRO-3
    python benchmarks/teardown.py --size gpt2-tiny --seq-len 32 --out /tmp/teardown.json   # CPU smoke
    python benchmarks/teardown.py --config zero3_nvme_all --size gpt2 --vocab 50257 --seq-len 64 --runs 4 \
        --out reports/teardown_nvme_cpu.json                               # params on NVMe: release_nvme_swappers

DeepSpeed 0.19.8 keeps every ZeRO-3 model in a module-level list and every parameter coordinator in a class-wide
lru_cache, so `engine.destroy()` plus `del` frees nothing: the next run in the same kernel starts with the last
one's parameters, gradients and optimizer states still allocated. `helpers.teardown` clears both. Each variant runs
`--runs` trainings in one fresh process and records GPU memory allocated and process RSS before and after each.
Writes reports/teardown.json and .md.

With an offload config (`helpers.config.OFFLOAD_KINDS`, e.g. zero3_nvme_all, its NVMe folder under --work-dir) the fix
compared is the one for that config: with parameters on NVMe, `release_nvme_swappers` (DeepSpeed's parameter
swapper never frees its page-locked swap buffers); the other one stays on in both variants. Page-locked bytes
(/proc/self/smaps_rollup "Locked") are recorded too.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GiB = 2**30


def child(args: argparse.Namespace) -> int:
    """Train `--runs` times in this process; print one JSON line of before/after memory per run."""
    import gc

    import torch

    import helpers
    import helpers.runtime
    from helpers.config import OFFLOAD_KINDS

    if args.child == "without":  # what DeepSpeed alone does: destroy() and the collection
        setattr(helpers.runtime, args.fix, lambda module=None: None)
    runtime = helpers.detect_runtime()
    ds = helpers.load_text_dataset("local")
    tok = helpers.train_tokenizer(ds["train"]["text"], Path(args.work_dir) / "tokenizer")
    blocks = helpers.pack_blocks(ds["train"], tok, args.seq_len, max_blocks=64)
    config = helpers.gpt2_config(args.size, vocab_size=args.vocab or len(tok))
    info = {}
    if args.config in OFFLOAD_KINDS:
        nvme = Path(args.work_dir) / "nvme"
        nvme.mkdir(parents=True, exist_ok=True)
        cfg = helpers.config.offload_config(args.config, runtime, nvme_path=str(nvme), micro_batch_size=2, lr=3e-4,
                                     warmup_steps=1, largest_param=helpers.model_shape(config).largest_layer_params)
        param = cfg["zero_optimization"].get("offload_param", {})
        info = {"precision": "bf16" if cfg.get("bf16", {}).get("enabled") else "fp16" if cfg.get("fp16", {}).get(
            "enabled") else "fp32", "buffer_count": param.get("buffer_count"), "buffer_size": param.get("buffer_size")}
    else:
        cfg = helpers.course_config(args.config, runtime, micro_batch_size=2, lr=3e-4, warmup_steps=1)
    rows = []
    for i in range(args.runs):
        helpers.reset_peak_stats()
        gpu0, rss0 = helpers.gpu_allocated_bytes(), helpers.release_host_memory()
        r = helpers.train_run(f"run {i}", lambda: helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0), blocks,
                              runtime=runtime, ds_config=cfg, steps=3,
                              measure=helpers.train.MeasureSettings(untimed_steps=1, progress=False))
        gpu1, rss1 = helpers.gpu_allocated_bytes(), helpers.release_host_memory()
        rows.append({"run": i, "params": r.params, "losses": r.losses, "error": r.error,
                     "gpu_before_gib": round(gpu0 / GiB, 3), "gpu_after_gib": round(gpu1 / GiB, 3),
                     "rss_before_gb": round(rss0 / 1e9, 3), "rss_after_gb": round(rss1 / 1e9, 3),
                     "locked_after_gb": round(locked_bytes() / 1e9, 3),
                     "engines_alive": sum(type(o).__name__ == "DeepSpeedEngine" for o in gc.get_objects())})
    print(json.dumps({"runtime": runtime.label, "torch": torch.__version__, "rows": rows, **info}))
    return 0


def locked_bytes() -> int:
    """Page-locked (mlock) bytes of this process (0 where /proc cannot tell): DeepNVMe's swap buffers."""
    import re

    try:
        m = re.search(r"Locked:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="gpt2-medium")
    p.add_argument("--config", default="zero3")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--vocab", type=int, default=0, help="embedding rows (default: the local tokenizer's 8192; GPT-2 "
                   "has 50257, which sizes the NVMe parameter swap buffers)")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "teardown.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench_teardown")
    p.add_argument("--fix", choices=("release_zero3_globals", "release_nvme_swappers"),
                   help="the helpers.runtime function the 'without' variant turns off (default: release_nvme_swappers "
                        "for a config with parameters on NVMe, else release_zero3_globals)")
    p.add_argument("--child", choices=("with", "without"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fix is None:
        from helpers.config import OFFLOAD_KINDS

        nvme_params = OFFLOAD_KINDS.get(args.config, {}).get("offload_param") == "nvme"
        args.fix = "release_nvme_swappers" if nvme_params else "release_zero3_globals"
    if args.child:
        return child(args)
    import deepspeed

    report = {"date": dt.date.today().isoformat(), "deepspeed": deepspeed.__version__, "size": args.size,
              "vocab": args.vocab or "tokenizer",
              "config": args.config, "fix": args.fix, "variants": {}}
    for variant in ("without", "with"):
        cmd = [sys.executable, __file__, "--child", variant, "--size", args.size, "--config", args.config,
               "--runs", str(args.runs), "--seq-len", str(args.seq_len), "--work-dir", str(args.work_dir),
               "--fix", args.fix, "--vocab", str(args.vocab)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{variant}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        out = json.loads(lines[-1])
        report["runtime"] = out["runtime"]
        report.update({k: out[k] for k in ("precision", "buffer_count", "buffer_size") if k in out})
        report["variants"][f"{variant} {args.fix}"] = out["rows"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# What a torn-down ZeRO-3 engine leaves behind ({report['runtime']}, {report['date']})", "",
             f"{args.size} (vocab {report['vocab']}), {args.config}, {args.runs} trainings of 3 steps in one process, "
             f"deepspeed {report['deepspeed']}; memory before and after each training (teardown included)."
             + (f" {report['precision']}, {report['buffer_count']} parameter swap buffers of "
                f"{report['buffer_size']:,} elements." if "buffer_size" in report else ""), "",
             "| teardown | run | GPU allocated before -> after (GiB) | RSS before -> after (GB) "
             "| page-locked after (GB) | engines alive after |",
             "|---|---|---|---|---|---|"]
    for variant, rows in report["variants"].items():
        for r in rows:
            lines.append(f"| {variant} | {r['run']} | {r['gpu_before_gib']:.2f} -> {r['gpu_after_gib']:.2f} | "
                         f"{r['rss_before_gb']:.2f} -> {r['rss_after_gb']:.2f} | {r['locked_after_gb']:.2f} | "
                         f"{r['engines_alive']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
