"""Scaling out: per-rank model-state bytes for ZeRO 0-3 as the ranks grow, a 2-stage pipeline, AutoTP (notebook 05).

    python3 benchmarks/scale_out.py                          # GPUs if there are any, else CPU ranks (gloo)
    python3 benchmarks/scale_out.py --out $OUT/scale_out.json   # on the GPU machine

With GPUs: one GPU per rank over NCCL, N = 1, 2, 4, 8 up to the GPUs present (a 1-GPU machine runs N=1 only;
the pipeline and AutoTP runs need 2). Without: N = 1, 2, 4 CPU processes over gloo, labelled as such: the bytes
per rank are the same bookkeeping, the speed is not a GPU's. Each N is one launch of
notebooks/programs/scale_out_train.py (deepspeed launcher) measuring all four stages. Writes the JSON and a .md beside it:
per (stage, N) rank 0's params / peak gradients / optimizer bytes, their sum against the estimator, and the target
of issue 7: ZeRO-3 model states per rank at N within 20 % of 1/N of N=1's.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

from helpers import scale_out
from helpers.launch import PROGRAMS, run_ranks

ROOT = Path(__file__).resolve().parent.parent

TARGET = 0.20  # ZeRO-3 model states at N ranks within 20 % of 1/N of one rank's


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "scale_out.json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ranks", type=int, nargs="*", default=None,
                   help="N values (default: 1, 2, 4, 8 up to the GPUs; 1, 2, 4 on CPU)")
    p.add_argument("--shape", choices=("auto", *scale_out.SCALE_OUT_SHAPES), default="auto")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--no-pipeline-tp", action="store_true", help="skip the pipeline and AutoTP runs")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench_scale_out")
    return p.parse_args(argv)


def runtime_label(device: str, gpus: int) -> str:
    if device == "cuda":
        from helpers.hardware import detect_runtime

        rt = detect_runtime(t4_budget=False)
        return f"{rt.gpu_name} x{gpus}, one GPU per rank (NCCL)"
    from helpers.hardware import usable_cpus

    return f"CPU gloo ranks, {usable_cpus()}-core machine, no GPU (bytes per rank, not GPU memory)"


def target_check(rows: list[dict]) -> dict:
    """ZeRO-3's model states per rank against 1/N of one rank's, per N."""
    stage3 = {r["world"]: r for r in rows if r["stage"] == 3}
    checks = {}
    for n, r in sorted(stage3.items()):
        if n > 1 and 1 in stage3:
            ratio = r["model_states"] / (stage3[1]["model_states"] / n)
            checks[str(n)] = {"ratio": round(ratio, 3), "within_20pct": abs(ratio - 1) <= TARGET}
    return checks


def split_line(title: str, per: str, held: str, run: dict, middle: str = "", tail: str = "") -> str:
    """One sentence on a pipeline or tensor-parallel run: the parameters each part holds, the loss gap."""
    return (f"{title}: parameters per {per} {held} of {run['params_total']:,}{middle}; largest loss gap to the "
            f"unsplit run {run['max_loss_gap']:.2e}{tail}.")


def markdown(report: dict) -> str:
    mb = 1e6
    lines = [f"# Scaling out: model states per rank ({report['runtime']}, {report['date']})", "",
             f"Course GPT {report['n_params']:,} parameters ("
             + ", ".join(f"{k} {v}" for k, v in report["shape"].items()) + f"), {report['precision']}, "
             f"{report['steps']} steps per stage, gradient bucket {report['bucket_elements']:,} elements "
             "(1/8 of the model). Bytes on rank 0, read off the engine: parameters (ZeRO-3: its partition), "
             "gradients at their peak during backward (and what stays for the step), optimizer (Adam moments + "
             "fp32 master copy). Estimate: `helpers.model_states_per_gpu` (no buckets).", "",
             "| stage | N | device | params MB | grads peak MB | grads kept MB | optimizer MB | model states MB | "
             "estimate MB | states / (N=1 / N) | peak GPU MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ratio = r.get("ratio_to_1_over_n")
        gpu = f"{r['max_peak_gpu_bytes'] / 2**20:.0f}" if r["device"] == "cuda" else "-"
        lines.append(f"| {r['stage']} | {r['world']} | {r['device']} | {r['params'] / mb:.3f} | "
                     f"{r['grads_peak'] / mb:.3f} | {r['grads_held'] / mb:.3f} | {r['optimizer'] / mb:.3f} | "
                     f"{r['model_states'] / mb:.3f} | {r['estimate'] / mb:.3f} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {gpu} |")
    lines += ["", "Target (issue 7): ZeRO-3 model states per rank at N within 20 % of 1/N of N=1's: " + (
        ", ".join(f"N={n}: {c['ratio']:.3f} ({'met' if c['within_20pct'] else 'NOT met'})"
                  for n, c in report["target"].items()) or "needs N > 1")]
    p, t = report.get("pipeline"), report.get("tensor_parallel")
    if p:
        lines += ["", split_line(f"Pipeline ({p['stages']} stages, {p['micro_batches']} micro-batches, {p['device']})",
                                 "stage", ", ".join(f"{x:,}" for x in p["params_per_stage"]), p,
                                 tail=f" over {len(p['pipeline_losses'])} steps")]
    if t:
        lines += ["", split_line(f"AutoTP {t['mode']} ({t['world']} ranks, {t['device']})", "rank",
                                 f"{t['params_local']:,}", t,
                                 middle=f", {t['tensors_split']} tensors split in half; params "
                                        f"{t.get('params', 0) / mb:.3f} MB, optimizer "
                                        f"{t.get('optimizer', 0) / mb:.3f} MB per rank")]
    lines += ["", "Commands: " + "; ".join(f"`{c}`" for c in report["commands"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import deepspeed
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    ranks = args.ranks or ([n for n in (1, 2, 4, 8) if n <= gpus] if device == "cuda" else [1, 2, 4])
    shape = scale_out.SCALE_OUT_SHAPES[args.shape if args.shape != "auto" else ("gpu" if device == "cuda" else "cpu")]
    blocks = scale_out.corpus_blocks(args.work_dir, shape["vocab"], shape["seq_len"])
    common = ["--blocks", str(blocks), "--shape", "gpu" if shape is scale_out.SCALE_OUT_SHAPES["gpu"] else "cpu",
              "--micro-batch", str(args.micro_batch)]
    start = time.perf_counter()
    rows, commands = [], []
    for n in ranks:
        reports = run_ranks(PROGRAMS / "scale_out_train.py", n, args.work_dir / f"zero_n{n}", device=device,
                            launcher="deepspeed", args=common + ["--steps", str(args.steps)], timeout=1800)
        commands.append(reports[0]["command"])
        rows += scale_out.zero_rows(reports)
        print(f"N={n}: {reports[0]['launch_seconds']} s", flush=True)
    rows = sorted(scale_out.with_estimates(rows), key=lambda r: (r["stage"], r["world"]))
    first = rows[0]
    report = {"runtime": runtime_label(device, gpus), "device": device, "backend": first["backend"],
              "date": dt.date.today().isoformat(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "shape": {k: v for k, v in shape.items()}, "n_params": first["n_params"],
              "precision": first["precision"], "steps": args.steps, "micro_batch": args.micro_batch,
              "bucket_elements": first["bucket_elements"], "ranks": ranks,
              "rows": rows,
              "target": target_check(rows), "commands": commands}
    two = device == "cpu" or gpus >= 2
    if not args.no_pipeline_tp and two:
        pipe = run_ranks(PROGRAMS / "pipeline_train.py", 2, args.work_dir / "pipeline", device=device,
                         launcher="torchrun", args=common + ["--steps", "4"])
        report["pipeline"] = {k: pipe[0][k] for k in ("stages", "micro_batches", "device", "params_total",
                                                       "pipeline_losses", "plain_losses", "max_loss_gap")}
        report["pipeline"]["params_per_stage"] = [r["params_local"] for r in pipe]
        report["pipeline"]["layers_per_stage"] = [r["layer_names"] for r in pipe]
        tp = run_ranks(PROGRAMS / "tp_train.py", 2, args.work_dir / "tp", device=device, launcher="torchrun",
                       args=common + ["--steps", "4"])
        report["tensor_parallel"] = {k: tp[0].get(k) for k in ("mode", "world", "device", "params_total",
                                                               "params_local", "params", "grads", "optimizer",
                                                               "max_loss_gap", "tp_losses", "plain_losses",
                                                               "training_error", "peak_gpu_bytes")}
        report["tensor_parallel"]["tensors_split"] = len(tp[0]["split"])
        commands += [pipe[0]["command"], tp[0]["command"]]
    elif not two:
        report["pipeline_tp_skipped"] = f"the pipeline and AutoTP runs need 2 GPUs; this machine has {gpus}"
    report["seconds"] = round(time.perf_counter() - start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
