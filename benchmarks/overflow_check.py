"""Benchmark: ZeRO-3's fp16 overflow check, DeepSpeed's against `helpers.chunk_zero3_overflow_check()` (issue 25).

    DS_COURSE_T4_BUDGET=1 python benchmarks/overflow_check.py                       # GPU: gpt2 then gpt2-xl, fp16
    python benchmarks/overflow_check.py --sizes gpt2-tiny --seq-len 32 --steps 3    # CPU smoke (bf16: no check runs)

Each size trains twice in a fresh process (helpers.fresh_process.train_in_fresh_process) with the ladder's NVMe config
(zero3_nvme_optimizer_gpu_params: the gradient buffer in host RAM), once with DeepSpeed 0.19.8's own
`has_overflow` and once with the chunked one, from the same seed and data. fp16 starts at loss scale 2^16
(`--initial-scale-power`), so the first steps overflow and are skipped: both runs must skip the same steps and give
the same losses (the check's answer decides every step). The report puts side by side the peak RSS (the chunked
check saves ~3 bytes per parameter of host RAM at each step), tokens/s (its cost) and the skipped steps.
`--scan-sizes` times the check alone instead (the part that runs on the host CPU, whose speed the GPU machine does not
emulate): DeepSpeed's two whole-buffer calls and the chunked min/max over an fp16 buffer of each size's parameter count,
on `--threads` cores (Colab: 2), with the RSS each adds (reports/overflow_check_scan.json and .md).
On a CPU runtime DeepSpeed refuses fp16, and with bf16 it never checks for overflow: the rows then only show that the
patch changes nothing else. Writes reports/overflow_check.json and .md (reports/overflow_check_cpu.* on CPU).
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

import helpers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

CONFIG = "zero3_nvme_optimizer_gpu_params"


def measure(args: argparse.Namespace, size: str, chunked: bool, runtime: Any) -> dict[str, Any]:
    shape = helpers.model_shape(helpers.gpt2_config(size))
    nvme = Path(args.nvme_path) / f"{size}-{'chunked' if chunked else 'deepspeed'}"
    nvme.mkdir(parents=True, exist_ok=True)
    extra = {} if runtime.has_gpu else {"precision": "bf16"}
    cfg = helpers.config.offload_config(CONFIG, runtime, largest_param=shape.largest_layer_params, nvme_path=str(nvme),
                                 micro_batch_size=args.micro_batch, lr=args.lr, warmup_steps=1,
                                 initial_scale_power=args.initial_scale_power, **extra)
    fp = helpers.fresh_process
    r = fp.train_in_fresh_process(fp.FreshRunSpec(f"{size} {'chunked' if chunked else 'DeepSpeed'} check", cfg, size,
                                                  tokenizer_dir=args.work_dir / "tokenizer", steps=args.steps,
                                                  untimed_steps=args.untimed_steps, seq_len=args.seq_len,
                                                  max_blocks=64, chunked_overflow_check=chunked,
                                                  progress=not args.quiet))
    helpers.runtime.remove_nvme_leftovers(str(nvme))
    return {"model": size, "params": shape.n_params, "check": "chunked" if chunked else "DeepSpeed's",
            "precision": r.precision, "error": r.error, "losses": r.losses,
            "skipped_at_steps": r.extras.get("skipped_at_steps", []), "skipped_steps": r.extras.get("skipped_steps"),
            "peak_rss_gb": r.peak_rss_gb, "baseline_rss_gb": r.baseline_rss_gb, "tokens_per_s": r.tokens_per_s,
            "step_seconds": r.step_seconds, "seconds": r.seconds}


def time_scan(n_elements: int, threads: int, repeats: int, chunk_elements: int) -> dict[str, Any]:
    """Seconds and transient RSS of one overflow check over an fp16 host buffer of `n_elements`, DeepSpeed's way
    (stage3.py: isinf(buffer).any(), then isnan(buffer).any()) and sliced (helpers.overflow_check), on `threads`."""
    import time

    import torch

    from helpers.overflow_check import _any_inf_or_nan

    torch.set_num_threads(threads)
    # finite values in every page, as a gradient buffer holds (zeros from calloc would read one shared zero page)
    buf = torch.full((n_elements,), 1e-3, dtype=torch.float16)

    def whole() -> bool:
        return bool(torch.isinf(buf).any()) or bool(torch.isnan(buf).any())

    def sliced() -> bool:
        return bool(_any_inf_or_nan(buf, chunk_elements))

    out: dict[str, Any] = {"elements": n_elements, "threads": threads, "chunk_elements": chunk_elements}
    for name, fn in (("deepspeed", whole), ("chunked", sliced)):
        seconds, peaks = [], []
        for _ in range(repeats):
            with helpers.measure_peak(interval_s=0.005) as m:  # peak RSS above the buffer, sampled every 5 ms
                t = time.perf_counter()
                assert fn() is False
                seconds.append(time.perf_counter() - t)
            peaks.append(m.peak_rss - m.baseline_rss)
        out[f"{name}_seconds"] = round(min(seconds), 3)
        out[f"{name}_transient_gb"] = round(max(peaks) / 1e9, 2)
    return out


def scan_markdown(report: dict[str, Any]) -> str:
    lines = [f"# ZeRO-3's fp16 overflow check alone, on the host CPU ({report['runtime']}, {report['date']})", "",
             "One check over an fp16 gradient buffer of each size's parameter count (all finite, as in a step that "
             "does not overflow), DeepSpeed 0.19.8's way (`isinf(buffer).any()` then `isnan(buffer).any()`) and in "
             f"slices of {report['chunk_elements']:,} elements, a min/max (`torch.aminmax`) each "
             f"(`helpers.chunk_zero3_overflow_check`); best of {report['repeats']}; transient = peak RSS "
             "above the buffer, sampled every 5 ms. `python benchmarks/overflow_check.py --scan-sizes ...` "
             "regenerates it.", "",
             "| model | parameters | threads | DeepSpeed's s | chunked s | DeepSpeed's transient GB | chunked transient GB |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['model']} | {r['elements']:,} | {r['threads']} | {r['deepspeed_seconds']} | "
                     f"{r['chunked_seconds']} | {r['deepspeed_transient_gb']} | {r['chunked_transient_gb']} |")
    return "\n".join(lines) + "\n"


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per size measured both ways: same skipped steps, largest loss difference, RSS saved, speed ratio."""
    out = []
    for size in dict.fromkeys(r["model"] for r in rows):
        pair = {r["check"]: r for r in rows if r["model"] == size and not r["error"]}
        if len(pair) < 2:
            continue
        ds, ch = pair["DeepSpeed's"], pair["chunked"]
        n = min(len(ds["losses"]), len(ch["losses"]))
        out.append({"model": size, "same_skipped_steps": ds["skipped_at_steps"] == ch["skipped_at_steps"],
                    "max_loss_difference": max((abs(a - b) for a, b in zip(ds["losses"][:n], ch["losses"][:n])),
                                               default=None),
                    "rss_saved_gb": round(ds["peak_rss_gb"] - ch["peak_rss_gb"], 2),
                    "tokens_per_s_ratio": round(ch["tokens_per_s"] / ds["tokens_per_s"], 3)
                    if ds["tokens_per_s"] else None})
    return out


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"# ZeRO-3's fp16 overflow check: DeepSpeed's vs chunked ({report['runtime']}, {report['date']})", "",
             f"Config `{CONFIG}`, {s['steps']} steps ({s['untimed_steps']} untimed) of {s['micro_batch']} x "
             f"{s['seq_len']} tokens, lr {s['lr']:g}, fp16 loss scale from 2^{s['initial_scale_power']}; each run in a "
             "fresh process, same seed and data. `python benchmarks/overflow_check.py` regenerates it.", "",
             "| model | check | precision | skipped at steps | losses | peak RSS GB | tokens/s | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        lines.append(f"| {r['model']} | {r['check']} | {r['precision']} | {r['skipped_at_steps'] or '-'} | {losses} | "
                     f"{r['peak_rss_gb']:.2f} | {r['tokens_per_s']:,.0f} | {r['error'][:80]} |")
    if report["comparison"]:
        lines += ["", "| model | same skipped steps | largest loss difference | RSS saved GB | tokens/s chunked / "
                  "DeepSpeed's |", "|---|---|---|---|---|"]
        for c in report["comparison"]:
            diff = "-" if c["max_loss_difference"] is None else f"{c['max_loss_difference']:.2e}"
            lines.append(f"| {c['model']} | {'yes' if c['same_skipped_steps'] else 'NO'} | {diff} | "
                         f"{c['rss_saved_gb']:.2f} | {c['tokens_per_s_ratio']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["gpt2", "gpt2-xl"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--untimed-steps", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--initial-scale-power", type=int, default=16)
    p.add_argument("--nvme-path", default=str(ROOT / "build" / "overflow_check_nvme"))
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "overflow_check")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--scan-sizes", nargs="*", default=None,
                   help="time the check alone over buffers of these sizes' parameter counts (no training)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    runtime = helpers.detect_runtime()
    if args.scan_sizes is not None:
        from helpers.overflow_check import DEFAULT_CHUNK_ELEMENTS

        out = args.out or ROOT / "reports" / "overflow_check_scan.json"
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
        report = {"runtime": f"{runtime.label}: {cpu}", "date": dt.date.today().isoformat(),
                  "chunk_elements": DEFAULT_CHUNK_ELEMENTS, "repeats": args.repeats, "rows": []}
        for size in args.scan_sizes or ["gpt2-xl", "gpt2-2.7b"]:
            n = helpers.model_shape(helpers.gpt2_config(size)).n_params
            report["rows"].append({"model": size, **time_scan(n, args.threads, args.repeats, DEFAULT_CHUNK_ELEMENTS)})
            _bench.write_report(report, out, scan_markdown)
        print(out.with_suffix(".md").read_text())
        return 0
    out = args.out or ROOT / "reports" / ("overflow_check.json" if runtime.has_gpu else "overflow_check_cpu.json")
    helpers.runtime.build_ops("cpu_adam", "async_io")
    _bench.local_corpus(args.work_dir)  # the tokenizer its rungs' processes load
    report: dict[str, Any] = {
        "runtime": runtime.label, "date": dt.date.today().isoformat(),
        "settings": {"steps": args.steps, "untimed_steps": args.untimed_steps, "micro_batch": args.micro_batch,
                     "seq_len": args.seq_len, "lr": args.lr, "initial_scale_power": args.initial_scale_power},
        "rows": [], "comparison": []}
    for size in args.sizes:
        for chunked in (False, True):
            report["rows"].append(measure(args, size, chunked, runtime))
            report["comparison"] = compare(report["rows"])
            _bench.write_report(report, out, markdown)
    print(out.with_suffix(".md").read_text())
    return 0 if all(not r["error"] for r in report["rows"]) and all(c["same_skipped_steps"]
                                                                     for c in report["comparison"]) else 1


if __name__ == "__main__":
    sys.exit(main())
