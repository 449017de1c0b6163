"""Benchmark: the host byte account of ZeRO-3 offload, buffer by buffer, estimated and measured (issue 25).

    python benchmarks/host_memory.py                      # CPU: gpt2-large, bf16, both NVMe configs (~15 min)
    DS_COURSE_T4_BUDGET=1 python benchmarks/host_memory.py --sizes gpt2-xl gpt2-2.7b --seq-len 512 \\
        --out reports/host_memory.json                    # GPU (fp16), in the Colab emulation for the 2.7B question

Each (config, model) trains `--steps` optimizer steps in a fresh process (helpers.fresh_process.train_in_fresh_process) with
`helpers.host_trace` recording every host storage of >= `--trace-mb` MB by the DeepSpeed line that allocated it.
`helpers.host_buffers.stage3_host_buffers` predicts the same buffers from the config and the model's parameter
tensors; the report puts them side by side (measured: the most bytes the site held at once), lists what the trace
saw that no formula names (>= 100 MB), and adds them up against the process's measured peak RSS. Each run is made
with glibc's default allocator and again with `--mmap-threshold-mib 1` (helpers.mmap_large_allocations): the part
of the peak outside traced storages is mostly freed heap that glibc keeps, and the second run shows how much.

On a CPU-only machine the accelerator is the CPU: what would be GPU memory (the 16-bit parameters, the reduce bucket,
activations) is host RAM too. Those sites (`DEVICE_SITES`) are listed apart, so the host rows are the ones a GPU
runtime keeps in RAM; bf16 stands in for fp16 (the same two bytes; DeepSpeed refuses fp16 on CPU).
The predicted account of sizes not measured (`--predict`, default gpt2-xl and gpt2-2.7b with fp16) is printed too,
labelled as an estimate.
Writes reports/host_memory_cpu.json/.md on CPU by default, reports/host_memory.json/.md on a GPU.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import _bench  # this script's folder is first on sys.path
import helpers
from helpers.host_buffers import DEVICE_SITES, parameter_numels, stage3_host_buffers, stage3_host_peak
from helpers.memory import RUNTIME_GROWTH_BYTES
from helpers.overflow_check import CHECKED_DEEPSPEED, DEFAULT_CHUNK_ELEMENTS

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
CONFIGS = ("zero3_nvme_optimizer_gpu_params", "zero3_nvme_all")
REPORTED_BYTES = 100_000_000  # a measured site that no formula names is listed from this size
PREDICT_BASELINE_BYTES = 1_330_000_000  # a fresh training process before its model, GPU machine (reports/host_memory.json)


def host_config(name: str, runtime: Any, size: str, nvme: str, micro_batch: int, steps: int,
                check_paths: bool = True) -> dict[str, Any]:
    """The ladder's config `name` for `size` (benchmarks/ladder.py); bf16 where there is no GPU."""
    from ladder import ladder_config

    shape = helpers.model_shape(helpers.gpt2_config(size))
    extra = {} if runtime.has_gpu else {"precision": "bf16"}
    return ladder_config(name, runtime, nvme, shape.largest_layer_params, micro_batch=micro_batch, steps=steps,
                         check_paths=check_paths, **extra)


def _matches(site: str, estimate_site: str) -> bool:
    """A traced site ('deepspeed/<file>:<line> <function>') against a formula's ('<file>:<line> <function>', or
    '<file> <function>' for any line of that function)."""
    site = site.removeprefix("deepspeed/")
    file_line, _, function = site.partition(" ")
    est_file_line, _, est_function = estimate_site.partition(" ")
    # Python 3.12 inlines comprehensions (PEP 709): '<listcomp>' there is the enclosing function's frame
    if function != est_function and not est_function.startswith("<"):
        return False
    return file_line == est_file_line if ":" in est_file_line else file_line.split(":")[0] == est_file_line


def account(trace: dict[str, Any], config: dict[str, Any], numels: list[int], gpu: bool,
            overflow_chunk: int = 0) -> dict[str, Any]:
    """The estimate's rows with what the trace measured at their sites; the unnamed and device-side sites apart."""
    sites = trace["sites"]
    used: set[str] = set()
    rows = []
    for b in stage3_host_buffers(config, numels, gpu=gpu, overflow_chunk=overflow_chunk):
        if not b.traced:  # checked against the RSS rise in a step instead (step_rise)
            rows.append({**b.as_dict(), "measured_bytes": None, "ratio": None})
            continue
        hits = [s for s in sites if _matches(s["site"], b.site)]
        used.update(s["site"] for s in hits)
        held = [s["max_alive_bytes"] for s in hits]
        measured = (max(held, default=0) if b.one_at_a_time else sum(held))
        rows.append({**b.as_dict(), "measured_bytes": measured,
                     "ratio": round(measured / b.bytes, 3) if b.bytes else None})
    device = [s for s in sites if s["site"] not in used and any(d in s["site"] for d in DEVICE_SITES)]
    other = [s for s in sites if s["site"] not in used and s not in device and s["max_alive_bytes"] >= REPORTED_BYTES]
    return {"rows": rows, "device_sites": [_site_row(s) for s in device if s["max_alive_bytes"] >= REPORTED_BYTES],
            "unnamed_sites": [_site_row(s) for s in other]}


def step_rise(memory: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The RSS rise inside a step (peak minus the steady state after the step before it), against the step
    transients the formulas say are alive at once (the has_overflow mask and its |x| copy; the first step's Adam
    moments are made at another moment). None without the memory probe's samples."""
    peak = memory.get("at_rss_peak", {})
    ends = memory.get("at_phase_end", {})
    before = ends.get(peak.get("phase", ""), {})
    if not peak or not before or not peak["phase"].startswith("after step"):
        return None
    together = sum(x["bytes"] for x in rows if x["when"] == "step" and "has_overflow" in x["site"])
    return {"measured_bytes": peak["VmRSS"] - before["VmRSS"], "predicted_bytes": together,
            "steady_rss_bytes": before["VmRSS"], "phase": peak["phase"]}


def _site_row(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in ("site", "dtypes", "count", "max_alive_bytes", "alive_at_peak_bytes", "first_phase",
                              "pinned") if k in s}


def measure(args: argparse.Namespace, name: str, size: str, runtime: Any) -> dict[str, Any]:
    nvme = Path(args.nvme_path)
    nvme.mkdir(parents=True, exist_ok=True)
    cfg = host_config(name, runtime, size, str(nvme), args.micro_batch, args.steps)
    fp = helpers.fresh_process
    r = fp.train_in_fresh_process(fp.FreshRunSpec(f"{name} {size}", cfg, size, tokenizer_dir=args.work_dir / "tokenizer",
                                                  steps=args.steps, seq_len=args.seq_len, max_blocks=64,
                                                  trace_host_bytes=int(args.trace_mb * 1e6), progress=not args.quiet,
                                                  mmap_threshold_mib=args.mmap_threshold_mib,
                                                  chunked_overflow_check=args.chunked_overflow_check))
    helpers.runtime.remove_nvme_leftovers(str(nvme))
    row: dict[str, Any] = {"config": name, "model": size, "params": r.params, "precision": r.precision,
                           "error": r.error, "losses": r.losses, "peak_rss_gb": r.peak_rss_gb,
                           "baseline_rss_gb": r.baseline_rss_gb, "rss_by_phase": r.rss_by_phase,
                           "seconds": r.seconds, "mmap_threshold_mib": args.mmap_threshold_mib,
                           "chunked_overflow_check": args.chunked_overflow_check}
    trace = r.extras.get("host_trace")
    if trace:
        chunk = DEFAULT_CHUNK_ELEMENTS if args.chunked_overflow_check else 0
        acc = account(trace, cfg, parameter_numels(size), runtime.has_gpu, chunk)
        row.update(acc)
        row["memory"] = trace.get("memory", {})
        row["step_rise"] = step_rise(row["memory"], acc["rows"])
        row["trace_peak_gb"] = round(trace["peak_live_bytes"] / GB, 3)
        row["trace_peak_phase"] = trace["peak_phase"]
        row["host_always_gb"] = round(sum(x["bytes"] for x in acc["rows"] if x["when"] == "always") / GB, 3)
    return row


def predicted(name: str, size: str) -> dict[str, Any]:
    """The formulas alone for `size` on a GPU runtime in fp16 (not measured here)."""
    cfg = host_config(name, helpers.colab_t4_profile(), size, "/content/nvme", micro_batch=2, steps=1,
                      check_paths=False)
    numels = parameter_numels(size)
    rows = [b.as_dict() for b in stage3_host_buffers(cfg, numels)]
    always = sum(b["bytes"] for b in rows if b["when"] == "always")
    # has_overflow's mask and copy are freed before the optimizer step makes the first step's Adam moments
    step = max(sum(b["bytes"] for b in rows if b["when"] == when) for when in ("step", "first step"))
    peaks = {chunked: stage3_host_peak(cfg, numels, baseline_bytes=PREDICT_BASELINE_BYTES,
                                       overflow_chunk=DEFAULT_CHUNK_ELEMENTS if chunked else 0).total
             for chunked in (False, True)}
    return {"config": name, "model": size, "params": sum(numels), "rows": rows, "always_gb": round(always / GB, 3),
            "step_transient_gb": round(step / GB, 3), "peak_gb": round(peaks[False] / GB, 2),
            "peak_chunked_overflow_check_gb": round(peaks[True] / GB, 2)}


def write_md(report: dict[str, Any], path: Path) -> None:
    lines = [f"# Host byte account of ZeRO-3 offload ({report['runtime']})", "",
             f"DeepSpeed {report['deepspeed']} (sites checked against {CHECKED_DEEPSPEED}); {report['when']}; "
             f"{report['steps']} steps of {report['micro_batch']} x {report['seq_len']} tokens; "
             f"the trace records host storages of >= {report['trace_mb']:g} MB. Measured: the most bytes the site "
             "held at once. `python benchmarks/host_memory.py` regenerates it.", ""]
    for row in report["rows"]:
        glibc = (f", glibc mmap threshold {row['mmap_threshold_mib']:g} MiB" if row.get("mmap_threshold_mib")
                 else ", glibc's default allocator settings")
        lines += [f"## {row['config']}, {row['model']} ({row['params'] / 1e6:,.0f}M params, {row['precision']}{glibc})",
                  ""]
        if row.get("note"):
            lines += [row["note"], ""]
        if row.get("chunked_overflow_check"):
            lines += ["With `helpers.chunk_zero3_overflow_check()` in the child.", ""]
        if row["error"]:
            lines += [f"error: {row['error']}", ""]
            continue
        rest = row["peak_rss_gb"] - row["baseline_rss_gb"] - row["trace_peak_gb"]
        lines += [f"Peak RSS {row['peak_rss_gb']:.2f} GB = {row['baseline_rss_gb']:.2f} GB the process held before "
                  f"its model + {row['trace_peak_gb']:.2f} GB of traced storages at their peak "
                  f"({row['trace_peak_phase']}) + {rest:.2f} GB outside them (tensors under the trace's threshold, "
                  "freed heap the allocator keeps, C++ buffers no operator touched; the two peaks need not "
                  "coincide).", ""]
        peak = row.get("memory", {}).get("at_rss_peak", {})
        if peak:
            parts = ", ".join(f"{k} {peak[k] / GB:.2f}" for k in ("RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin",
                                                                  "pinned_allocated", "pinned_reserved",
                                                                  "traced_live") if k in peak)
            lines += [f"At the sampled RSS peak ({peak.get('VmRSS', 0) / GB:.2f} GB, {peak.get('phase', '?')}), GB: "
                      f"{parts}.", ""]
        lines += [
                  "| host buffer (GPU runtime) | DeepSpeed site | when | formula | estimate GB | measured GB | "
                  "measured/estimate |", "|---|---|---|---|---|---|---|"]
        for x in row["rows"]:
            ratio = f"{x['ratio']:.2f}" if x["ratio"] is not None else "-"
            measured = f"{x['measured_bytes'] / GB:.3f}" if x["measured_bytes"] is not None else "not traced"
            lines.append(f"| {x['name']} | `{x['site']}` | {x['when']} | {x['formula']} | {x['bytes'] / GB:.3f} | "
                         f"{measured} | {ratio} |")
        rise = row.get("step_rise")
        if rise:
            lines += ["", f"RSS rise inside a step ({rise['phase']}): {rise['measured_bytes'] / GB:.2f} GB above the "
                      f"steady {rise['steady_rss_bytes'] / GB:.2f} GB; the has_overflow rows together (mask + |x| "
                      f"copy, alive at once): {rise['predicted_bytes'] / GB:.2f} GB "
                      f"({rise['measured_bytes'] / max(rise['predicted_bytes'], 1):.2f}x)."]
        if row["device_sites"]:
            lines += ["", "On the accelerator on a GPU runtime (host RAM here, where the accelerator is the CPU):", ""]
            lines += [f"- `{s['site']}`: {s['max_alive_bytes'] / GB:.3f} GB ({', '.join(s['dtypes'])}, "
                      f"{s['count']} storages)" for s in row["device_sites"]]
        lines += ["", "Traced host storages no formula names (>= 0.1 GB): "
                  + ("none." if not row["unnamed_sites"] else "")]
        lines += [f"- `{s['site']}`: {s['max_alive_bytes'] / GB:.3f} GB ({', '.join(s['dtypes'])})"
                  for s in row["unnamed_sites"]]
        lines.append("")
    lines += ["## Predicted for the GPU runtime (fp16, formulas only)", "",
              f"Peak = {PREDICT_BASELINE_BYTES / GB:.2f} GB the process holds before its model + "
              f"{RUNTIME_GROWTH_BYTES / GB:.2f} GB the runtime adds + the buffers always held + the largest transient "
              "(`helpers.host_buffers.stage3_host_peak`); with DeepSpeed's overflow check, and with "
              "`helpers.chunk_zero3_overflow_check()`. Colab's limit in the emulation: 12.13 GB.", "",
              "| config | model | always in RAM GB | largest transient in a step GB | peak GB | peak, chunked check GB | "
              "biggest row |", "|---|---|---|---|---|---|---|"]
    for p in report["predicted"]:
        big = max(p["rows"], key=lambda b: b["bytes"])
        lines.append(f"| {p['config']} | {p['model']} | {p['always_gb']:.2f} | {p['step_transient_gb']:.2f} | "
                     f"{p.get('peak_gb', 0):.2f} | {p.get('peak_chunked_overflow_check_gb', 0):.2f} | "
                     f"{big['name']}: {big['bytes'] / GB:.2f} GB |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["gpt2-large"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--predict", nargs="*", default=["gpt2-xl", "gpt2-2.7b"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--trace-mb", type=float, default=1.0)
    p.add_argument("--nvme-path", default=str(ROOT / "build" / "host_memory_nvme"))
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "host_memory")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--mmap-threshold-mib", type=float, nargs="+", default=[0.0, 1.0],
                   help="one run each: glibc serves allocations above this with mmap in the child "
                        "(helpers.mmap_large_allocations), so freed RAM goes back at once; 0: glibc's default")
    p.add_argument("--chunked-overflow-check", action="store_true",
                   help="the child calls helpers.chunk_zero3_overflow_check() first (fp16 only)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of --out measured without error and run only the others")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    runtime = helpers.detect_runtime()
    out = args.out or ROOT / "reports" / ("host_memory.json" if runtime.has_gpu else "host_memory_cpu.json")
    helpers.runtime.build_ops("cpu_adam", "async_io")
    _bench.local_corpus(args.work_dir)  # the tokenizer its runs' processes load
    import deepspeed

    def key(r: dict[str, Any]) -> tuple[str, str, float]:
        return r["config"], r["model"], float(r["mmap_threshold_mib"] or 0.0)

    rows: list[dict[str, Any]] = []
    if args.resume and out.exists():
        rows = json.loads(out.read_text())["rows"]
    done = {key(r) for r in rows if not r["error"]}
    rows = [r for r in rows if key(r) in done]
    for size in args.sizes:
        for name in args.configs:
            for mmap in args.mmap_threshold_mib:
                if (name, size, float(mmap)) in done:
                    continue
                rows.append(measure(argparse.Namespace(**{**vars(args), "mmap_threshold_mib": mmap}), name, size,
                                    runtime))
                # written after every row, so a run cut short (a device call's limit) keeps what it measured
                report = {"runtime": runtime.label, "deepspeed": deepspeed.__version__,
                          "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                          "steps": args.steps, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                          "trace_mb": args.trace_mb, "rows": rows,
                          "predicted": [predicted(n, s) for s in args.predict for n in args.configs]}
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(report, indent=1) + "\n")
                write_md(report, out.with_suffix(".md"))
    print(out.with_suffix(".md").read_text())
    return 0 if all(not r["error"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
