"""Benchmark: how fast the NVMe-offload config trains, lever by lever, against the step-time model (notebook 02).

    DS_COURSE_T4_BUDGET=1 python benchmarks/offload_speed.py --emulate --nvme-path /tmp/nvme --deadline-s 400
    python benchmarks/offload_speed.py --model gpt2-tiny --seq-len 64 --steps 2 --levers baseline mb4_g2   # CPU

First the runtime's limits (helpers.limits: disk through DeepSpeed's aio, PCIe, CPU Adam, matmul), measured in the
same enclosure as the runs. Then each lever (LEVERS: micro-batch, gradient accumulation, pinned buffers, aio
settings, pipelined swapping, the course's overflow check) trains the model with the ladder's NVMe config ("zero3_nvme_optimizer_gpu_params":
ZeRO-3, fp16 weights on the GPU, optimizer states and fp32 gradients on NVMe) in a fresh process, one at a time,
and the row records measured tokens/s beside helpers.estimate_step_time's prediction and roofline, peak RSS,
disk, and the seconds of every micro-batch (the last one of a step includes the optimizer step).
With --emulate each run is inside a Colab enclosure (scripts/colab_emulation.py: RAM limit, 2 CPUs).
A run counts ("fits") when it finished, its loss fell, no fp16-overflow step was skipped in the timed steps, and it
stayed within 12.1 GB RAM (the enforced limit) and 60 GB disk. Rows already in --out are kept (--rerun NAME to
measure one again); --deadline-s stops starting rows. Writes reports/offload_speed.json and .md.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import helpers
from helpers.hardware import COLAB_NVME_BUDGET_BYTES, COLAB_RAM_GB
from helpers.limits import RuntimeLimits
from helpers.step_time import DATASHEET_FP16_TFLOPS, estimate_step_time, project_to_gpu

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # colab_emulation, for --emulate
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench, also when loaded by path (tests)
import _bench  # noqa: E402

GB = 1e9
ROW_SETUP_S = 90  # a fresh process's imports, model, engine and NVMe swap files (GPT-2 XL on the GPU machine: ~75 s)
CONFIG = "zero3_nvme_optimizer_gpu_params"
# A constant learning rate, no warm-up: DeepSpeed's WarmupLR gives lr 0 to the first two optimizer steps (it
# raises warmup_num_steps to at least 2 and starts at iteration 0), so a 2-step row would never update the
# weights before its last loss. Constant, the first step updates and the second step's loss shows it: 2 optimizer
# steps judge the loss. 1.5e-4 is the lr at which GPT-2 XL's loss first fell in the ladder (11.11 -> 9.94).
LR = 1.5e-4
# name -> (what changes, micro-batch, grad accumulation, config patch as {dotted.path: value})
LEVERS: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "baseline": ("the ladder's setting: micro-batch 2, one micro-batch per optimizer step", 2, 1, {}),
    "mb8": ("micro-batch 8 (the GPU is mostly empty with the optimizer on NVMe)", 8, 1, {}),
    "mb8_g4": ("micro-batch 8, 4 micro-batches per optimizer step", 8, 4, {}),
    "mb8_g16": ("micro-batch 8, 16 micro-batches per optimizer step", 8, 16, {}),
    "mb8_g16_pinned": ("+ pinned host buffers (pin_memory)", 8, 16,
                       {"zero_optimization.offload_optimizer.pin_memory": True}),
    "mb8_g16_aio": ("+ aio: queue depth 32, 2 I/O threads (intra_op_parallelism), 4 MiB blocks", 8, 16,
                    {"aio.queue_depth": 32, "aio.intra_op_parallelism": 2, "aio.block_size": 4 * 2**20}),
    "mb8_g16_pipelined": ("+ pipelined optimizer swapping (pipeline_read, pipeline_write)", 8, 16,
                          {"zero_optimization.offload_optimizer.pipeline_read": True,
                           "zero_optimization.offload_optimizer.pipeline_write": True}),
    "mb16_g8": ("micro-batch 16, 8 micro-batches per optimizer step", 16, 8, {}),
    "mb16_g8_chunked": ("+ the course's overflow check (helpers.chunk_zero3_overflow_check: min/max per slice)",
                        16, 8, {}),
    "mb16_g8_chunked_pinned": ("+ pinned host buffers, which fit once the check holds no whole-buffer temporary",
                               16, 8, {"zero_optimization.offload_optimizer.pin_memory": True}),
    # CPU runtimes (compute is ~1000x slower: smaller steps)
    "mb2_g4": ("micro-batch 2, 4 micro-batches per optimizer step", 2, 4, {}),
    "mb4_g2": ("micro-batch 4, 2 micro-batches per optimizer step", 4, 2, {}),
}
# levers whose process calls helpers.chunk_zero3_overflow_check() first (the course's one change of DeepSpeed)
CHUNKED_CHECK = frozenset({"mb16_g8_chunked", "mb16_g8_chunked_pinned"})


def patched(config: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with each dotted path of `patch` set."""
    out = copy.deepcopy(config)
    for path, value in patch.items():
        node = out
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def lever_config(name: str, runtime: Any, shape: Any, nvme: str) -> dict[str, Any]:
    """The DeepSpeed config of one lever (the ladder's NVMe config, then the lever's changes)."""
    _, mb, accum, patch = LEVERS[name]
    cfg = helpers.config.offload_config(CONFIG, runtime, largest_param=shape.largest_layer_params, nvme_path=nvme,
                                 micro_batch_size=mb, grad_accum_steps=accum, lr=LR, scheduler=None,
                                 initial_scale_power=12, check_paths=False)
    return patched(cfg, patch)


def measure_limits_in(enclosure: Any, nvme: str, aio: dict[str, Any], out: Path,
                      blocks: list[tuple[int, int, int, int]] = (), n_layers: int = 0,
                      adam_params: int = 16_000_000, zero: dict[str, Any] | None = None) -> RuntimeLimits:
    """helpers.limits measured in a child process (inside `enclosure` when given: its CPUs, its RAM), with what
    the bandwidths miss: the gradient round trip, the compute rate of the model's blocks at the levers'
    micro-batches, ZeRO-3's hooks at the model's depth, the overflow check, the weight copy, CPU Adam on one
    sub-group."""
    argv = ["--nvme", nvme, "--aio", json.dumps(aio), "--out", str(out), "--refresh", "--grad-round-trip",
            "--blocks", json.dumps([list(b) for b in blocks]), "--adam-params", str(adam_params)]
    argv += ["--zero3-layers", str(n_layers), "--zero3-config", json.dumps(zero or {})] if n_layers else []
    cmd = [sys.executable, "-c", f"import sys; from helpers.limits import _main; sys.exit(_main({argv!r}))"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if enclosure is not None:
        proc = subprocess.Popen(enclosure.join_argv() + cmd, cwd=ROOT, env={**env, **enclosure.environment()})
        enclosure.adopt(proc.pid)
        proc.wait()
    else:
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    return RuntimeLimits.from_dict(json.loads(out.read_text()))


def verdict(m: Any, ram_gb: float) -> tuple[bool, str]:
    """Does the row count: finished, at least one optimizer step applied (not skipped by fp16 overflow) before the
    last loss, that loss below the first (constant lr: the last step's loss is after the updates), RAM and disk
    within Colab's."""
    if m.error:
        return False, m.error
    skipped_at = set(m.extras.get("skipped_at_steps", []))
    if len(m.losses) < 2:
        return False, f"{len(m.losses)} optimizer step(s): the loss needs 2 to be judged"
    if all(step in skipped_at for step in range(len(m.losses) - 1)):
        return False, (f"fp16 overflow skipped every optimizer step before the last loss (steps {sorted(skipped_at)}):"
                       " the weights never changed")
    if not m.losses[-1] < m.losses[0]:
        return False, f"loss did not fall ({m.losses[0]:.3f} -> {m.losses[-1]:.3f})"
    if m.peak_rss_gb > ram_gb:
        return False, f"peak RSS {m.peak_rss_gb:.2f} GB > {ram_gb} GB"
    if m.disk_gb > COLAB_NVME_BUDGET_BYTES / GB:
        return False, f"disk {m.disk_gb:.1f} GB > {COLAB_NVME_BUDGET_BYTES / GB:.0f} GB"
    return True, ""


def measured_breakdown(micro_batch_s: list[list[float]], untimed: int) -> dict[str, float]:
    """From the per-micro-batch seconds of the timed steps: a micro-batch without the optimizer step, and what the
    last micro-batch of a step (the accumulation boundary, with DeepSpeed's optimizer step) adds."""
    timed = micro_batch_s[untimed:] or micro_batch_s[-1:]
    inner = [s for step in timed for s in step[:-1]]
    last = [step[-1] for step in timed]
    per_mb = sum(inner) / len(inner) if inner else float("nan")
    boundary = sum(last) / len(last) - (per_mb if inner else 0.0)
    return {"micro_batch_s": round(per_mb, 3) if inner else None, "boundary_and_optimizer_step_s": round(boundary, 3),
            "step_s": round(sum(sum(s) for s in timed) / len(timed), 3)}


def measured_phases(phases: list[list[dict[str, float]]], untimed: int) -> dict[str, float]:
    """Seconds per optimizer step in each measured phase (train_run's `micro_batch_phases`), over the timed steps."""
    timed = phases[untimed:] or phases[-1:]
    out: dict[str, float] = {}
    for step in timed:
        for micro in step:
            for k, v in micro.items():
                out[k] = out.get(k, 0.0) + v / len(timed)
    return {k: round(v, 3) for k, v in out.items()}


def phase_table(phases: dict[str, float], accum: int) -> str:
    """The measured phases of one optimizer step as text: the micro-batch loop, then the optimizer step's parts."""
    def line(name: str, indent: int = 0) -> str:
        return f"{'  ' * indent + name:<44} {phases.get(name, 0.0):>8.2f}"

    lines = [f"measured per optimizer step ({accum} micro-batch{'es' if accum > 1 else ''}), seconds:",
             line("forward"), line("backward"), line("reduce + host gradient copies", 1),
             line("host gradient copies", 2), line("engine.step"), line("overflow check", 1), line("gradient norm", 1),
             line("optimizer states + gradients from disk", 1), line("CPU Adam", 1), line("new weights to GPU", 1),
             line("optimizer states to disk", 1)]
    return "\n".join(lines)


def predict_row(row: dict[str, Any], limits: RuntimeLimits, runtime: Any, shape: Any, seq_len: int,
                nvme: str) -> dict[str, Any]:
    """The step-time model's fields of one row, from the limits measured with it (its "limits"; else `limits`)
    (`--repredict` reuses a run's measurements)."""
    if row.get("limits"):  # the limits of the machine the row ran on (each device call is a fresh machine)
        limits = RuntimeLimits.from_dict(row["limits"])
    cfg = lever_config(row["lever"], runtime, shape, nvme)
    est = estimate_step_time(cfg, shape, limits, seq_len=seq_len, name=row["lever"],
                             chunked_overflow_check=row["lever"] in CHUNKED_CHECK)
    fields = {k: v for k, v in est.as_dict().items() if k != "config"}
    measured = row.get("measured") or {}
    if measured:
        detail = (f"a micro-batch {measured['micro_batch_s']:.2f} s; the last one, with the optimizer step, adds "
                  f"{measured['boundary_and_optimizer_step_s']:.2f} s" if measured.get("micro_batch_s") is not None
                  else "one micro-batch per optimizer step")
        fields["breakdown"] = est.table() + f"\nmeasured: {measured['step_s']:.2f} s per optimizer step ({detail})"
        if row.get("phases"):
            fields["breakdown"] += "\n" + phase_table(row["phases"], row["grad_accum"])
    return fields


def with_summary(report: dict[str, Any]) -> dict[str, Any]:
    """`report` with its "baseline", "best" (the fastest row that fits) and "batch_only" (the fastest that fits with
    stock DeepSpeed: no config patch, DeepSpeed's own overflow check; notebook 02 and the README quote it) filled from
    its rows."""
    rows = report["rows"]
    base = next((r for r in rows if r["lever"] == "baseline"), None)
    best = max((r for r in rows if r["fits"]), key=lambda r: r["tokens_per_s"], default=None)
    batch_only = max((r for r in rows if r["fits"] and not r.get("patch") and not r.get("chunked_overflow_check")),
                     key=lambda r: r["tokens_per_s"], default=None)
    keys = ("lever", "tokens_per_s", "predicted_tokens_per_s", "roofline_tokens_per_s", "bottleneck", "peak_rss_gb",
            "disk_gb", "grad_accum", "micro_batch")
    summary = {**report, "baseline": base and {k: base[k] for k in keys}, "best": best and {k: best[k] for k in keys},
               "batch_only": batch_only and {k: batch_only[k] for k in keys}}
    gpu = report["runtime"].split()[0]
    # the T4 estimate is of the best row; with none (every row's loss judged on too few steps, issue 42's 2.7B run of
    # 2 steps), of the fastest row that finished within RAM and disk, and the text says its loss did not count
    row = best or max((r for r in rows if (r.get("measured") or {}).get("step_s")
                       and r["peak_rss_gb"] <= report["ram_budget_gb"] and r["disk_gb"] <= COLAB_NVME_BUDGET_BYTES / GB),
                      key=lambda r: r["tokens_per_s"], default=None)
    if row and report.get("emulation") and gpu in DATASHEET_FP16_TFLOPS and (row.get("measured") or {}).get("step_s"):
        proj = project_to_gpu(row["components_s"], row["measured"]["step_s"],
                              row["micro_batch"] * row["grad_accum"] * report["settings"]["seq_len"], measured_on=gpu)
        text = proj.text() if row["fits"] else (f"{proj.text()}; of {row['lever']}, which ran within RAM and disk but "
                                                f"does not count as training: {row['reason']}")
        summary["t4_estimate"] = {"lever": row["lever"], "tokens_per_s": round(proj.tokens_per_s, 1),
                                  "step_s": round(proj.step_s, 2), "gpu_busy_s": round(proj.gpu_busy_s, 2),
                                  "t4_gpu_s": round(proj.target_gpu_s, 2), "measured_step_s": proj.measured_step_s,
                                  "text": text}
    return summary


def repredict(path: Path) -> dict[str, Any]:
    """The report at `path` with every row's prediction recomputed from its own limits by the current step-time
    model (no run): the runtime the rows ran on is the Colab profile for an emulated report, else this one."""
    report = json.loads(path.read_text())
    runtime = helpers.colab_t4_profile() if report.get("emulation") else helpers.detect_runtime()
    shape = helpers.model_shape(helpers.gpt2_config(report["model"]))
    limits = RuntimeLimits.from_dict(report["limits"])
    for row in report["rows"]:
        row.update(predict_row(row, limits, runtime, shape, report["settings"]["seq_len"], "/nvme/" + row["lever"]))
    return with_summary(report)


def markdown(report: dict[str, Any]) -> str:
    lim = report["limits"]
    lines = [f"# NVMe offload speed, lever by lever ({report['runtime']}, {report['date']})", "",
             f"Model {report['model']} ({report['params'] / 1e6:,.0f}M), config `{CONFIG}` (ZeRO-3, 16-bit weights "
             "on the GPU - on a CPU runtime fp32 weights in RAM -, optimizer states and fp32 gradients on NVMe), "
             f"{report['settings']['seq_len']} tokens per "
             f"sequence, {report['settings']['steps']} optimizer steps ({report['settings']['untimed_steps']} untimed), "
             "each row in a fresh process" + (" inside the Colab enclosure" if report.get("emulation") else "") + ".",
             "", "## Limits measured on this runtime", "", "```", RuntimeLimits.from_dict(lim).table(), "```", "",
             "## Levers", "",
             "| lever | micro-batch x accumulation | tokens/s measured | predicted | roofline | measured/predicted "
             "| peak RSS GB | disk GB | fits | what changes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ratio = f"{r['tokens_per_s'] / r['predicted_tokens_per_s']:.2f}" if r.get("predicted_tokens_per_s") and \
            r["tokens_per_s"] else "-"
        lines.append(f"| {r['lever']} | {r['micro_batch']} x {r['grad_accum']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['predicted_tokens_per_s']:,.0f} | {r['roofline_tokens_per_s']:,.0f} | {ratio} | "
                     f"{r['peak_rss_gb']:.2f} | {r['disk_gb']:.1f} | {'yes' if r['fits'] else 'no: ' + r['reason'][:80]} "
                     f"| {r['what']} |")
    b, best = report.get("baseline"), report.get("best")
    if b and best:
        lines += ["", f"Best: **{best['lever']}**, {best['tokens_per_s']:,.0f} tokens/s = "
                  f"{best['tokens_per_s'] / max(b['tokens_per_s'], 1e-9):.1f}x the baseline's {b['tokens_per_s']:,.0f}; "
                  f"{best['tokens_per_s'] / best['roofline_tokens_per_s']:.0%} of its roofline "
                  f"({best['roofline_tokens_per_s']:,.0f} tokens/s, {best['bottleneck']} alone)."]
    if report.get("t4_estimate"):
        lines += ["", report["t4_estimate"]["text"] + "."]
    for r in report["rows"]:
        if r.get("breakdown"):
            lines += ["", f"### One optimizer step of {r['lever']}: predicted against measured", "", "```",
                      r["breakdown"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-xl")
    p.add_argument("--levers", nargs="+", default=["mb8_g16", "mb8_g4", "baseline", "mb8_g16_pinned",
                                                    "mb8_g16_aio", "mb8_g16_pipelined", "mb16_g8", "mb8",
                                                    "mb16_g8_chunked", "mb16_g8_chunked_pinned"],
                   choices=list(LEVERS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--untimed-steps", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--nvme-path", default="/tmp/ds-course-nvme")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--deadline-s", type=float, default=0.0)
    p.add_argument("--hard-stop-s", type=float, default=0.0)
    p.add_argument("--rerun", nargs="*", default=[])
    p.add_argument("--remeasure-limits", action="store_true", help="measure the limits again, keeping the rows")
    p.add_argument("--repredict", action="store_true",
                   help="no runs: recompute every row's prediction from the limits measured with it and this model")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "offload_speed.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args(argv)

    if args.repredict:
        _bench.write_report(repredict(args.out), args.out, markdown)
        print(args.out.with_suffix(".md").read_text())
        return 0
    started = time.perf_counter()
    runtime = _bench.emulated_runtime() if args.emulate else helpers.detect_runtime()  # --emulate: T4 budget, RAM, CPUs
    enclosure_cls = limits_cls = None
    if args.emulate:
        from colab_emulation import ColabLimits, Enclosure

        enclosure_cls, limits_cls = Enclosure, ColabLimits
    ram_gb = COLAB_RAM_GB if (runtime.t4_budget or runtime.is_colab) else runtime.ram_budget_bytes / GB
    shape = helpers.model_shape(helpers.gpt2_config(args.model))
    _bench.local_corpus(args.work_dir)  # the tokenizer its rungs' processes load
    nvme_root = Path(args.nvme_path)
    nvme_root.mkdir(parents=True, exist_ok=True)
    settings = {"seq_len": args.seq_len, "steps": args.steps, "untimed_steps": args.untimed_steps, "lr": LR,
                "schedule": "constant"}
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    same = old.get("runtime") == runtime.label and old.get("model") == args.model and old.get("settings") == settings
    kept = {r["lever"]: r for r in old.get("rows", []) if r["lever"] not in args.rerun} if same else {}

    def enclosure(name: str) -> Any:
        if enclosure_cls is None:
            return None
        pair = sorted(os.sched_getaffinity(0))[:limits_cls().cpus]
        return enclosure_cls(name, limits_cls(), cpus=pair, nvme_dir=str(nvme_root))

    base_cfg = lever_config("baseline", runtime, shape, str(nvme_root / "probe"))
    limits_file = args.work_dir / "limits.json"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    blocks = sorted({(shape.hidden, shape.n_heads, args.seq_len, LEVERS[name][1]) for name in args.levers})
    if same and old.get("limits") and not args.remeasure_limits:
        limits = RuntimeLimits.from_dict(old["limits"])
    else:
        enc = enclosure("limits")
        limit_args = (str(nvme_root), base_cfg.get("aio", {}), limits_file, blocks, shape.n_layers,
                      int(base_cfg["zero_optimization"].get("sub_group_size", 16_000_000)),
                      base_cfg["zero_optimization"])
        if enc is None:
            limits = measure_limits_in(None, *limit_args)
        else:
            with enc:
                limits = measure_limits_in(enc, *limit_args)
    print(limits.table(), flush=True)
    rows: list[dict[str, Any]] = []

    def write() -> None:
        report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "model": args.model,
                  "params": shape.n_params, "config": CONFIG, "settings": settings, "ram_budget_gb": ram_gb,
                  "emulation": limits_cls().as_report(runtime.emulation) if limits_cls else None,
                  "limits": limits.as_dict(), "rows": rows}
        _bench.write_report(with_summary(report), args.out, markdown)

    for name in args.levers:
        what, mb, accum, patch = LEVERS[name]
        if name in kept:
            rows.append(kept[name])
            continue
        if args.deadline_s and time.perf_counter() - started > args.deadline_s:
            print(f"{name}: not started (deadline)", flush=True)
            continue
        nvme = nvme_root / name
        cfg = lever_config(name, runtime, shape, str(nvme))
        est = estimate_step_time(cfg, shape, limits, seq_len=args.seq_len, name=name,
                                 chunked_overflow_check=name in CHUNKED_CHECK)  # printed below
        left = args.hard_stop_s - (time.perf_counter() - started) if args.hard_stop_s else None
        need = ROW_SETUP_S + 1.2 * args.steps * est.seconds  # the model says how long the row will take
        if left is not None and left < need:
            print(f"{name}: not started ({left:.0f} s left, the row needs ~{need:.0f} s by the step-time model)",
                  flush=True)
            continue
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
        fp = helpers.fresh_process
        spec = fp.FreshRunSpec(name, cfg, args.model, tokenizer_dir=args.work_dir / "tokenizer", steps=args.steps,
                               seq_len=args.seq_len, max_blocks=max(64, args.steps * mb * accum + 8),
                               untimed_steps=args.untimed_steps, timeout_s=left, progress=False,
                               time_micro_batches=True, chunked_overflow_check=name in CHUNKED_CHECK)
        enc = enclosure(f"os-{name}")
        if enc is None:
            m = fp.train_in_fresh_process(spec)
            enc_report = None
        else:
            with enc:
                m = fp.train_in_fresh_process(dataclasses.replace(spec, wrap=enc.join_argv(), env=enc.environment()))
            enc_report = enc.stats.as_report()
            m.peak_rss_gb = max(m.peak_rss_gb, enc_report.get("peak_ram_gb", 0.0))
            if enc_report.get("oom_kills") and not m.error:
                m.error = f"{enc_report['oom_kills']} process(es) killed at the RAM limit"
        shutil.rmtree(nvme, ignore_errors=True)
        fits, reason = verdict(m, ram_gb)
        timings = m.extras.get("micro_batch_s", [])
        measured = measured_breakdown(timings, args.untimed_steps) if timings else {}
        phases = m.extras.get("micro_batch_phases", [])
        row = {"lever": name, "what": what, "micro_batch": mb, "grad_accum": accum, "patch": patch,
               "chunked_overflow_check": name in CHUNKED_CHECK,
               "tokens_per_s": m.tokens_per_s, "peak_rss_gb": m.peak_rss_gb, "disk_gb": m.disk_gb,
               "peak_vram_gib": m.peak_vram_gib, "losses": m.losses, "skipped_steps": m.extras.get("skipped_steps"),
               "skipped_at_steps": m.extras.get("skipped_at_steps", []), "micro_batch_s": timings,
               "micro_batch_phases": phases, "phases": measured_phases(phases, args.untimed_steps) if phases else {},
               "measured": measured, "rss_by_phase_gb": m.rss_by_phase, "run_seconds": m.seconds, "fits": fits,
               "reason": reason, "enclosure": enc_report, "limits": limits.as_dict()}
        row.update(predict_row(row, limits, runtime, shape, args.seq_len, str(nvme)))
        rows.append(row)
        write()
        print(f"{name:<20} {m.tokens_per_s:>8,.1f} tok/s (predicted {est.tokens_per_s:,.1f}, roofline "
              f"{est.roofline_tokens_per_s:,.1f}) RSS {m.peak_rss_gb:.2f} GB disk {m.disk_gb:.1f} GB "
              f"{'fits' if fits else 'NO: ' + reason[:120]}  [{time.perf_counter() - started:.0f} s]", flush=True)
    write()
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
