"""Benchmark: how fast the NVMe-offload config trains, lever by lever, against the step-time model (notebook 02).

    DS_COURSE_T4_BUDGET=1 python benchmarks/offload_speed.py --emulate --nvme-path /tmp/nvme --deadline-s 400
    python benchmarks/offload_speed.py --model gpt2-tiny --seq-len 64 --steps 2 --levers baseline mb4_g2   # CPU

First the runtime's limits (helpers.limits: disk through DeepSpeed's aio, PCIe, CPU Adam, matmul), measured in the
same enclosure as the runs. Then each lever (LEVERS: micro-batch, gradient accumulation, pinned buffers, aio
settings, pipelined swapping) trains the model with the ladder's NVMe config ("zero3_nvme_optimizer_gpu_params":
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
from helpers.step_time import estimate_step_time

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # colab_emulation, for --emulate
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench, also when loaded by path (tests)
import _bench  # noqa: E402

GB = 1e9
CONFIG = "zero3_nvme_optimizer_gpu_params"
LR = 3e-4
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
    # CPU runtimes (compute is ~1000x slower: smaller steps)
    "mb2_g4": ("micro-batch 2, 4 micro-batches per optimizer step", 2, 4, {}),
    "mb4_g2": ("micro-batch 4, 2 micro-batches per optimizer step", 4, 2, {}),
}


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
    cfg = helpers.offload_config(CONFIG, runtime, largest_param=shape.largest_layer_params, nvme_path=nvme,
                                 micro_batch_size=mb, grad_accum_steps=accum, lr=LR, warmup_steps=1,
                                 initial_scale_power=12, check_paths=False)
    return patched(cfg, patch)


def measure_limits_in(enclosure: Any, nvme: str, aio: dict[str, Any], out: Path) -> RuntimeLimits:
    """helpers.limits measured in a child process (inside `enclosure` when given: its CPUs, its RAM)."""
    argv = ["--nvme", nvme, "--aio", json.dumps(aio), "--out", str(out), "--refresh"]
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
    if m.error:
        return False, m.error
    if len(m.losses) < 2 or not m.losses[-1] < m.losses[0]:
        return False, "loss did not fall"
    if m.extras.get("skipped_steps", 0) and m.extras["skipped_steps"] >= len(m.losses):
        return False, f"{m.extras['skipped_steps']} step(s) skipped by fp16 overflow: no optimizer step was timed"
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
    for r in report["rows"]:
        if r.get("breakdown"):
            lines += ["", f"### One optimizer step of {r['lever']}: predicted against measured", "", "```",
                      r["breakdown"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-xl")
    p.add_argument("--levers", nargs="+", default=["mb8_g16", "mb8_g4", "baseline", "mb8_g16_pinned",
                                                    "mb8_g16_aio", "mb8_g16_pipelined", "mb16_g8", "mb8"],
                   choices=list(LEVERS))
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--untimed-steps", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--nvme-path", default="/tmp/ds-course-nvme")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--deadline-s", type=float, default=0.0)
    p.add_argument("--hard-stop-s", type=float, default=0.0)
    p.add_argument("--rerun", nargs="*", default=[])
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "offload_speed.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args(argv)

    started = time.perf_counter()
    runtime = helpers.detect_runtime()
    enclosure_cls = limits_cls = None
    if args.emulate:
        import dataclasses

        from colab_emulation import ColabLimits, Enclosure, probe

        enclosure_cls, limits_cls = Enclosure, ColabLimits
        runtime = dataclasses.replace(runtime, emulation=probe()[0], ram_total_bytes=ColabLimits().ram_bytes,
                                      ram_budget_bytes=ColabLimits().ram_bytes, cpu_cores=ColabLimits().cpus,
                                      is_colab=True)
    ram_gb = COLAB_RAM_GB if (runtime.t4_budget or runtime.is_colab) else runtime.ram_budget_bytes / GB
    shape = helpers.model_shape(helpers.gpt2_config(args.model))
    ds = helpers.load_text_dataset("local")
    helpers.train_tokenizer(ds["train"]["text"], args.work_dir / "tokenizer")
    nvme_root = Path(args.nvme_path)
    nvme_root.mkdir(parents=True, exist_ok=True)
    settings = {"seq_len": args.seq_len, "steps": args.steps, "untimed_steps": args.untimed_steps}
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
    if same and old.get("limits"):
        limits = RuntimeLimits.from_dict(old["limits"])
    else:
        enc = enclosure("limits")
        if enc is None:
            limits = measure_limits_in(None, str(nvme_root), base_cfg.get("aio", {}), limits_file)
        else:
            with enc:
                limits = measure_limits_in(enc, str(nvme_root), base_cfg.get("aio", {}), limits_file)
    print(limits.table(), flush=True)
    rows: list[dict[str, Any]] = []

    def write() -> None:
        fitting = [r for r in rows if r["fits"]]
        base = next((r for r in rows if r["lever"] == "baseline"), None)
        best = max(fitting, key=lambda r: r["tokens_per_s"], default=None)
        report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "model": args.model,
                  "params": shape.n_params, "config": CONFIG, "settings": settings, "ram_budget_gb": ram_gb,
                  "emulation": limits_cls().as_report(runtime.emulation) if limits_cls else None,
                  "limits": limits.as_dict(), "rows": rows,
                  "baseline": base and {k: base[k] for k in ("lever", "tokens_per_s", "predicted_tokens_per_s",
                                                             "roofline_tokens_per_s", "peak_rss_gb", "disk_gb",
                                                             "grad_accum", "micro_batch")},
                  "best": best and {k: best[k] for k in ("lever", "tokens_per_s", "predicted_tokens_per_s",
                                                         "roofline_tokens_per_s", "bottleneck", "peak_rss_gb",
                                                         "disk_gb", "grad_accum", "micro_batch")}}
        _bench.write_report(report, args.out, markdown)

    for name in args.levers:
        what, mb, accum, patch = LEVERS[name]
        if name in kept:
            rows.append(kept[name])
            continue
        if args.deadline_s and time.perf_counter() - started > args.deadline_s:
            print(f"{name}: not started (deadline)", flush=True)
            continue
        nvme = nvme_root / name
        shutil.rmtree(nvme, ignore_errors=True)
        nvme.mkdir(parents=True)
        cfg = lever_config(name, runtime, shape, str(nvme))
        est = estimate_step_time(cfg, shape, limits, seq_len=args.seq_len, name=name)
        left = args.hard_stop_s - (time.perf_counter() - started) if args.hard_stop_s else None
        kwargs = dict(tokenizer_dir=args.work_dir / "tokenizer", steps=args.steps, seq_len=args.seq_len,
                      nvme_path=nvme, max_blocks=max(64, args.steps * mb * accum + 8),
                      untimed_steps=args.untimed_steps, timeout_s=left, progress=False, time_micro_batches=True)
        enc = enclosure(f"os-{name}")
        if enc is None:
            m = helpers.train_in_fresh_process(name, cfg, args.model, **kwargs)
            enc_report = None
        else:
            with enc:
                m = helpers.train_in_fresh_process(name, cfg, args.model, wrap=enc.join_argv(),
                                                   env=enc.environment(), **kwargs)
            enc_report = enc.stats.as_report()
            m.peak_rss_gb = max(m.peak_rss_gb, enc_report.get("peak_ram_gb", 0.0))
            if enc_report.get("oom_kills") and not m.error:
                m.error = f"{enc_report['oom_kills']} process(es) killed at the RAM limit"
        shutil.rmtree(nvme, ignore_errors=True)
        fits, reason = verdict(m, ram_gb)
        timings = m.extras.get("micro_batch_s", [])
        measured = measured_breakdown(timings, args.untimed_steps) if timings else {}
        row = {"lever": name, "what": what, "micro_batch": mb, "grad_accum": accum, "patch": patch,
               "tokens_per_s": m.tokens_per_s, **{k: v for k, v in est.as_dict().items() if k != "config"},
               "peak_rss_gb": m.peak_rss_gb, "disk_gb": m.disk_gb, "peak_vram_gib": m.peak_vram_gib,
               "losses": m.losses, "skipped_steps": m.extras.get("skipped_steps"), "micro_batch_s": timings,
               "measured": measured, "rss_by_phase_gb": m.rss_by_phase, "run_seconds": m.seconds, "fits": fits,
               "reason": reason, "enclosure": enc_report}
        if measured:
            detail = (f"a micro-batch {measured['micro_batch_s']:.2f} s; the last one, with the optimizer step, adds "
                      f"{measured['boundary_and_optimizer_step_s']:.2f} s" if measured["micro_batch_s"] is not None
                      else "one micro-batch per optimizer step")
            row["breakdown"] = est.table() + f"\nmeasured: {measured['step_s']:.2f} s per optimizer step ({detail})"
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
