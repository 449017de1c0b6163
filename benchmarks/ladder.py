"""Benchmark: the largest GPT-2-family model that fits a T4 budget per config, and whether it learns (notebook 02).

    DS_COURSE_T4_BUDGET=1 python benchmarks/ladder.py --nvme-path /tmp/nvme --deadline-s 500
    python benchmarks/ladder.py --sizes gpt2-tiny gpt2 --configs plain zero2_offload_cpu --steps 3 --seq-len 32  # CPU

Each rung (a model size with a config) trains a few steps in a FRESH Python process, as a new Colab kernel
would: peak RSS then belongs to that rung alone (pinned and cached host memory of an earlier rung would
otherwise stay in the process). A rung *fits* when it ran its steps within the budgets: VRAM (the T4 cap makes
PyTorch raise out-of-memory), peak process RSS <= 12.7 GB and NVMe folder <= 60 GB. Whether it *learns* is judged
apart (issue 42): the loss fell by helpers.train.LOSS_FALL_NATS (first loss against the mean of the last three) and no
timed step was skipped by fp16 overflow. `--rejudge` judges the rows of --out again by these rules, running nothing;
`--merge-from REPORT` puts the rungs another report ran (issue 42's 2.7B curve, run on its own with its own batch,
steps and warm-up) into --out in place, with those settings, then judges again:
    python benchmarks/ladder.py --out reports/ladder_colab_emulation.json --merge-from reports/ladder_2p7b_curve.json

Search: plain PyTorch climbs from the smallest size until its first failure (the OOM wall). Each DeepSpeed
config starts AT that wall: it climbs while it fits, and if the wall itself does not fit it steps down until
a size fits (rungs below the start are not run: a config that fits a model fits a smaller one).
Before a rung runs, the estimator (helpers.estimate_for_config + the fresh-process RSS baseline) predicts
its RAM and disk; a rung predicted over budget is recorded as refused by pre-flight and not run, except for
the configs in --verify-refusals (cheap ones), which run anyway so the report shows the measured wall.
With --deadline-s, no rung starts after that many seconds (the report says which were left); the run can
be continued later: rows already in --out are kept and not run again (--fresh starts over).
Writes reports/ladder.json and reports/ladder.md; target: DeepSpeed's best >= 4x plain's parameters.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import helpers
from helpers.config import LADDER_CONFIGS
from helpers.hardware import COLAB_NVME_BUDGET_BYTES, COLAB_RAM_GB
from helpers.memory import estimate_run
from helpers.models import GPT2_LADDER
from helpers.planner import LADDER_LR, LADDER_MICRO_BATCH, LADDER_UNTIMED_STEPS, ladder_flags, ladder_warmup_steps
from helpers.records import report_gb
from helpers.train import LOSS_FALL_NATS, loss_fell

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # colab_emulation, for --emulate
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench, also when loaded by path (tests)
import _bench  # noqa: E402

GB = 1e9
GiB = 2**30
DISK_BUDGET_GB = COLAB_NVME_BUDGET_BYTES / GB
CONFIGS = LADDER_CONFIGS  # helpers.config.NAMED_CONFIGS marked ladder=True, cheapest first
CHEAP = ("plain", "zero2_offload_cpu", "zero3_offload_cpu")
FRESH_PROCESS_RSS_GB = 1.5  # until a child reports its own baseline
LR = LADDER_LR  # helpers.planner: the fresh-runtime command names a rung's lr only where it differs


def ladder_config(name: str, runtime, nvme_path: str | None, largest_param: int, *, micro_batch: int, steps: int,
                  check_paths: bool = True, lr: float = LR, warmup_steps: int | None = None, grad_accum: int = 1,
                  **overrides) -> dict:
    """The config of a ladder column: micro-batch, gradient accumulation, lr and warm-up (`warmup_steps`, default
    helpers.planner.ladder_warmup_steps: half the steps) for every column, plain
    PyTorch included (it trains without DeepSpeed, reading these from its config); fp16 starts at loss scale 2^12
    (few steps). `overrides` go to helpers.config.offload_config (benchmarks/host_memory.py: precision="bf16" on CPU)."""
    run = dict(micro_batch_size=micro_batch, grad_accum_steps=grad_accum, lr=lr,
               warmup_steps=warmup_steps or ladder_warmup_steps(steps))
    if name == "plain":
        return helpers.course_config("plain", runtime, **run)
    if name not in CONFIGS:
        raise ValueError(f"unknown ladder config {name!r}; choose from {CONFIGS}")
    return helpers.config.offload_config(name, runtime, largest_param=largest_param, nvme_path=nvme_path,
                                  initial_scale_power=12, check_paths=check_paths, **run, **overrides)


def verdict(r: dict, ram_budget_gb: float) -> tuple[bool, str]:
    """(fits, reason) of one measured rung: it ran its steps within the budgets (memory; whether it learned is
    `learns`)."""
    if r["error"]:
        return False, r["error"]
    if not r["losses"]:
        return False, "no steps ran"
    if report_gb(r, "peak_rss") > ram_budget_gb:
        return False, f"peak RSS {report_gb(r, 'peak_rss'):.1f} GB > {ram_budget_gb} GB RAM budget"
    if report_gb(r, "disk") > DISK_BUDGET_GB:
        return False, f"NVMe folder {report_gb(r, 'disk'):.1f} GB > {DISK_BUDGET_GB} GB disk budget"
    return True, ""


NOT_JUDGED = "not judged: the rung does not fit"


def learns(r: dict, on_gpu: bool) -> tuple[bool, str]:
    """(learns, why) of one rung that ran (issue 42): its loss fell by helpers.train.LOSS_FALL_NATS (the first loss
    against the mean of the last three; on CPU smoke runs it only has to fall) and no timed step was skipped by fp16
    overflow after the loss scale settled."""
    if r.get("skipped_timed_steps"):
        return False, (f"{r['skipped_timed_steps']} timed step(s) skipped by fp16 overflow (the loss scale was still "
                       "settling): run it with more --untimed-steps")
    return loss_fell(r["losses"], on_gpu=on_gpu)


def judged(measured: dict, ram_budget_gb: float, on_gpu: bool) -> dict:
    """{fits, reason, learns, learn_reason} of a rung that ran: `verdict` (memory), then `learns` for one that fits."""
    fits, reason = verdict(measured, ram_budget_gb)
    taught, why = learns(measured, on_gpu) if fits else (False, NOT_JUDGED)
    return {"fits": fits, "reason": reason, "learns": taught, "learn_reason": why}


def _loss_reason(reason: str) -> bool:
    """A reason the ladder gave before issue 42 split memory from learning: the loss's, not the memory's."""
    return reason.startswith("loss did not fall") or "timed step(s) skipped" in reason


def judge(row: dict, ram_budget_gb: float, on_gpu: bool) -> dict:
    """A committed row judged again by today's rules (--rejudge): fits/reason from its memory (a failure it recorded
    stays one), learns/learn_reason from its losses; a rung that did not run keeps its reason."""
    if not row.get("ran", True):
        return {**row, "fits": False, "learns": False, "learn_reason": "not run"}
    error = row.get("error") or ("" if row["fits"] or _loss_reason(row["reason"]) else row["reason"])
    return {**row, **judged({**row, "error": error}, ram_budget_gb, on_gpu)}


def rejudge(path: Path, report: dict | None = None) -> dict:
    """Rewrite the report at `path` (and its .md) with every row judged by `judge`, against the report's own RAM
    budget; nothing is run again. `report`: the rows to judge (`merge_from`'s), instead of the file's."""
    report = report if report is not None else json.loads(path.read_text())
    on_gpu = not report["runtime"].startswith("CPU")
    report["rows"] = [judge(r, report["budgets"]["ram_gb"], on_gpu) for r in report["rows"]]
    report["summary"] = summary(report["rows"])
    path.write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown(report))
    return report


# what a merged row keeps of its own report's settings where the target report's differ (ladder_flags reads them)
RUN_SETTINGS = ("micro_batch", "grad_accum", "warmup_steps", "steps")


def merge_from(path: Path, source: Path) -> dict:
    """Merge the rungs that ran in the ladder report `source` into the report at `path`, replacing its rows of the same
    (config, model), then judge every row again (`rejudge`). Each merged row carries the settings of its own run
    (RUN_SETTINGS, its runtime) so that helpers.planner.fresh_runtime_command repeats that run (issue 42: the 2.7B
    curve, run on its own, into the emulated ladder). Both must have been measured with the same budgets."""
    target, extra = json.loads(path.read_text()), json.loads(source.read_text())
    same = ("ram_gb", "disk_gb")  # the VRAM cap may differ (helpers.T4_VRAM_GIB moved): each row's runtime names its own
    if ([extra["budgets"][k] for k in same] != [target["budgets"][k] for k in same]
            or target["precision"] != extra["precision"]):
        raise SystemExit(f"--merge-from {source}: its budgets/precision ({extra['budgets']}, {extra['precision']}) are "
                         f"not {path}'s ({target['budgets']}, {target['precision']}); a rung is only comparable under "
                         f"the same RAM and disk limits. Fix: run it again with {path}'s settings (--emulate for an "
                         "emulated ladder)")
    ran = [r for r in extra["rows"] if r.get("ran") and not r.get("timed_out")]
    if not ran:
        raise SystemExit(f"--merge-from {source}: no rung ran to the end there, nothing to merge. Fix: run the rung "
                         "again (benchmarks/ladder.py --rerun CONFIG:SIZE)")
    settings = {"grad_accum": 1, **extra["settings"]}
    stamped = [{**r, "runtime": r.get("runtime") or extra["runtime"], "date": r.get("date") or extra["date"],
                **{k: r.get(k, settings[k]) for k in RUN_SETTINGS if k in settings}} for r in ran]
    new = {(r["config"], r["model"]): r for r in stamped}
    rows = [new.pop((r["config"], r["model"]), r) for r in target["rows"]]  # in place, the report's order kept
    target["rows"] = rows + list(new.values())
    return rejudge(path, target)


def predict(name: str, size: str, runtime, nvme: str | None, micro_batch: int, seq_len: int,
            baseline_rss_gb: float, chunked_overflow_check: bool = False) -> dict:
    """Estimated peak VRAM (GiB), RSS (GB) and disk (GB) of a rung, before running it."""
    shape = helpers.model_shape(helpers.gpt2_config(size))
    plain = name == "plain"
    cfg = ladder_config(name, runtime, nvme or "/nvme", shape.largest_layer_params, micro_batch=micro_batch, steps=1,
                        check_paths=False)
    est = estimate_run(None if plain else cfg, shape, seq_len=seq_len, precision=runtime.precision,
                       checkpointing=True, micro_batch=micro_batch if plain else None)
    states = est.states
    if not plain:
        states = helpers.estimate_for_config(cfg, shape.n_params, largest_layer_params=shape.largest_layer_params,
                                             zero_init=cfg["zero_optimization"]["stage"] == 3,
                                             chunked_overflow_check=chunked_overflow_check, on_gpu=runtime.has_gpu)
    cpu = states.n_params * 4 if plain else states.cpu_total  # plain: the fp32 model built on CPU
    return {"predicted_vram_gib": round(est.peak_bytes / GiB, 2),
            "predicted_rss_gb": round(cpu / GB + baseline_rss_gb, 2),
            "predicted_disk_gb": round(states.nvme_total / GB, 2)}


# ------------------------------------------------------------------------------------------ one rung (child)

def measure_in_child(args: argparse.Namespace, name: str, size: str, nvme: Path | None, gpu: str | None,
                     cpus: set[int] | None = None, timeout_s: float | None = None) -> dict:
    """Run one rung in a fresh process (helpers.fresh_process.train_in_fresh_process) on GPU `gpu`, CPU cores `cpus`.

    With --emulate the child runs inside its own Colab enclosure (scripts/colab_emulation.py: the RAM limit, two
    CPUs, the Colab profile), alone, as a learner would run it from a fresh runtime; the row records the enclosure's
    peak memory and out-of-memory kills. A crash or a kill becomes the rung's error.
    """
    runtime = helpers.detect_runtime()
    shape = helpers.model_shape(helpers.gpt2_config(size))
    cfg = ladder_config(name, runtime, str(nvme) if nvme else None, shape.largest_layer_params,
                        micro_batch=args.micro_batch, steps=args.steps, lr=args.lr, warmup_steps=args.warmup_steps,
                        grad_accum=args.grad_accum)
    fp = helpers.fresh_process
    spec = fp.FreshRunSpec(f"{name} {size}", cfg, size, tokenizer_dir=args.work_dir / "tokenizer",
                           plain_pytorch=name == "plain", steps=args.steps, untimed_steps=args.untimed_steps,
                           seq_len=args.seq_len, max_blocks=256, timeout_s=timeout_s, gpu=gpu,
                           progress=False, mmap_threshold_mib=args.mmap_threshold_mib,
                           chunked_overflow_check=args.chunked_overflow_check)
    if not args.emulate:
        r = fp.train_in_fresh_process(dataclasses.replace(spec, cpus=cpus))
        enclosure = None
    else:
        from colab_emulation import ColabLimits, Enclosure

        limits = ColabLimits()
        pair = sorted(cpus or os.sched_getaffinity(0))[:limits.cpus]
        with Enclosure(f"rung-{size}", limits, cpus=pair, nvme_dir=str(nvme) if nvme else None,
                       gpu_index=int(gpu) if gpu else None) as enc:
            r = fp.train_in_fresh_process(dataclasses.replace(spec, wrap=enc.join_argv(), env=enc.environment()))
        enclosure = enc.stats.as_report()
    if not r.error and r.params != shape.n_params:
        r.error = f"the child trained {r.params:,} parameters, not {size}'s {shape.n_params:,}"
    out = {k: getattr(r, k) for k in ("peak_vram_gib", "peak_rss_gb", "disk_gb", "tokens_per_s", "losses",
                                      "error", "seconds", "params", "rss_by_phase", "baseline_rss_gb")}
    out["skipped_steps"] = r.extras.get("skipped_steps")  # fp16 steps DeepSpeed skipped on overflow (all steps)
    out["skipped_timed_steps"] = len([s for s in r.extras.get("skipped_at_steps", []) if s >= args.untimed_steps])
    if r.error.startswith("stopped after the time limit"):
        out["timed_out"] = True
        out["error"] = f"not finished within this run's time budget ({timeout_s:.0f} s left when it started)"
    if enclosure is not None:
        out["enclosure"] = enclosure
        if enclosure["oom_kills"] and not out["error"]:
            out["error"] = f"{enclosure['oom_kills']} process(es) killed at the RAM limit"
    return out


# ---------------------------------------------------------------------------------------------- the search

def _largest_per_config(rows: list[dict]) -> dict[str, dict]:
    """{config: {model, params}} of the largest rung of each config among `rows`."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["params"] > best.get(r["config"], {}).get("params", 0):
            best[r["config"]] = {"model": r["model"], "params": r["params"]}
    return best


def summary(rows: list[dict]) -> dict:
    best = _largest_per_config([r for r in rows if r["fits"]])
    plain = best.get("plain", {}).get("params", 0)
    ds_best = max((v["params"] for k, v in best.items() if k != "plain"), default=0)
    # the largest rung per config whose loss fell by the margin (issue 42)
    learned = _largest_per_config([r for r in rows if r["fits"] and r.get("learns")])
    return {"largest_per_config": best, "deepspeed_over_plain": round(ds_best / plain, 2) if plain else None,
            "target_4x_met": bool(plain and ds_best >= 4 * plain), "largest_learning_per_config": learned}


def _learns_cell(r: dict) -> str:
    """The `learns` column: yes/no and the loss's reason, or '-' for a rung that did not run its steps."""
    if not r.get("fits") or "learns" not in r:
        return "-"
    return f"{'yes' if r['learns'] else 'no'}: {r.get('learn_reason', '')}"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# Largest model per config ({report['runtime']}, {report['date']})", "",
             f"micro-batch {s['micro_batch']} x {s['seq_len']} tokens"
             + (f", {s['grad_accum']} micro-batches per optimizer step" if s.get("grad_accum", 1) != 1 else "")
             + f", {s['steps']} steps, activation checkpointing, "
             f"{report['precision']}; budgets: VRAM {report['budgets']['vram_gib']} GiB, RAM {report['budgets']['ram_gb']} "
             f"GB, disk {report['budgets']['disk_gb']} GB. Each rung ran in a fresh process.", "",
             "A rung *fits* when it ran its steps within the budgets (memory). It *learns* when its loss fell by "
             f"{LOSS_FALL_NATS:g} nat or more (the first loss against the mean of the last three; issue 42) with no "
             "timed step skipped by fp16 overflow.", "",
             "| model | params | config | ran | fits | learns | peak VRAM GiB | peak RSS GB (predicted) "
             "| disk GB (predicted) | tokens/s | reason |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        ran = r.get("ran", True)
        m = (lambda v: f"{v:.2f}" if ran else "-")
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:,.0f}M | {r['config']} | {'yes' if ran else 'no'} | "
            f"{'yes' if r['fits'] else 'no'} | {_learns_cell(r)} | {m(r['peak_vram_gib'])} | "
            f"{m(report_gb(r, 'peak_rss'))} ({r.get('predicted_rss_gb', 0):.1f}) | "
            f"{m(report_gb(r, 'disk'))} ({r.get('predicted_disk_gb', 0):.1f}) | "
            f"{r['tokens_per_s']:,.0f} | {r['reason'][:160]} |")
    sm = report["summary"]
    fitting = [r for r in report["rows"] if r["fits"]]
    lines += ["", f"DeepSpeed's largest / plain PyTorch's largest: {sm['deepspeed_over_plain']} "
              f"(target >= 4: {'met' if sm['target_4x_met'] else 'NOT met'}); of the {len(fitting)} rungs that fit, "
              f"{sum(bool(r.get('learns')) for r in fitting)} learned by that rule"]
    phased = [r for r in report["rows"] if r.get("rss_by_phase_gb")]
    if phased:
        lines += ["", "Where the RAM peak happens (peak process RSS in GB while the model is built, while "
                  "`deepspeed.initialize` runs, while training):", "",
                  "| model | config | build model | initialize | train | predicted |", "|---|---|---|---|---|---|"]
        for r in phased:
            p = r["rss_by_phase_gb"]
            lines.append(f"| {r['model']} | {r['config']} | {p.get('build model', 0):.2f} | {p.get('initialize', 0):.2f} "
                         f"| {p.get('train', 0):.2f} | {r.get('predicted_rss_gb', 0):.2f} |")
    own = [r for r in report["rows"] if r.get("ran", True) and ladder_flags(r, s)]
    if own:
        lines += ["", "Rungs run with their own settings (the rest: lr "
                  f"{LR:g}, {s['steps']} steps, micro-batch {s['micro_batch']}, DeepSpeed's overflow check):", ""]
        report_batch = (s["micro_batch"], s.get("grad_accum", 1))
        for r in own:
            steps = r.get("steps", s["steps"])
            mb, accum = r.get("micro_batch", report_batch[0]), r.get("grad_accum", report_batch[1])
            batch = (f"micro-batch {mb} x {accum} per optimizer step ({mb * accum * s['seq_len']:,} tokens), "
                     if (mb, accum) != report_batch else "")
            lines.append(f"- {r['model']} {r['config']}: {batch}lr {r.get('lr', LR):g}, {steps} steps "
                         f"({r.get('untimed_steps', LADDER_UNTIMED_STEPS)} untimed, warm-up "
                         f"{helpers.planner._warmup_ran(r, steps)}), losses "
                         f"{', '.join(f'{x:.2f}' for x in r['losses'])}, skipped steps {r.get('skipped_steps')}"
                         + (", chunked overflow check (`helpers.chunk_zero3_overflow_check`)"
                            if r.get("chunked_overflow_check") else ""))
    if report.get("not_run"):
        lines += ["", "Not run (time budget): " + ", ".join(report["not_run"])]
    if report.get("notes"):  # written by hand into the JSON, kept through --rejudge
        lines += ["", report["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=[s for s in GPT2_LADDER if s != "gpt2-tiny"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--verify-refusals", nargs="*", default=list(CHEAP), choices=CONFIGS,
                   help="configs whose rungs run even when pre-flight predicts they will not fit")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=LADDER_MICRO_BATCH)
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (issue 42's 2.7B curve: 16 x 4 x 512 = 32,768 tokens a step)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--nvme-path", default="/tmp/ds-course-nvme")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "ladder.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench")
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no rung after this many seconds (0: none)")
    p.add_argument("--hard-stop-s", type=float, default=0.0,
                   help="kill a rung still running this many seconds after the start (0: never); it is run again "
                        "when the ladder is continued")
    p.add_argument("--fresh", action="store_true", help="ignore rows already in --out")
    p.add_argument("--rerun", nargs="*", default=[], metavar="CONFIG:SIZE", help="measure these rungs again")
    p.add_argument("--mmap-threshold-mib", type=float, default=0.0,
                   help="in each rung, helpers.mmap_large_allocations(this) first (0: glibc's default)")
    p.add_argument("--lr", type=float, default=LR, help=f"peak learning rate of every rung (default {LR:g}); "
                   "recorded in each row")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="linear warm-up over this many optimizer steps (default: half the steps, "
                        "helpers.planner.ladder_warmup_steps)")
    p.add_argument("--untimed-steps", type=int, default=LADDER_UNTIMED_STEPS,
                   help="steps before the timed ones (fp16's loss scale settles in them); recorded in each row")
    p.add_argument("--chunked-overflow-check", action="store_true",
                   help="each rung calls helpers.chunk_zero3_overflow_check() first: DeepSpeed 0.19.8's fp16 ZeRO-3 "
                        "overflow check without its whole-model temporaries (~3 B/param of host RAM at each step)")
    p.add_argument("--emulate", action="store_true",
                   help="run each rung inside its own Colab T4 enclosure (scripts/colab_emulation.py): RAM limit, "
                        "2 CPUs, the Colab profile")
    p.add_argument("--lanes", nargs="*", default=[], metavar="GPU:CONFIG,CONFIG",
                   help="after plain, run these groups of configs in parallel, one GPU and an equal share of the "
                        "CPU cores each (e.g. 0:zero3_nvme_optimizer,zero2_offload_cpu 1:zero3_nvme_all)")
    p.add_argument("--rejudge", action="store_true",
                   help="judge the rows of --out again by today's rules (fits, learns) and rewrite it; run nothing")
    p.add_argument("--merge-from", type=Path, default=None, metavar="REPORT",
                   help="merge the rungs that ran in REPORT (another ladder report, same budgets) into --out, each "
                        "with its own settings, replacing the same rungs there; then --rejudge; run nothing")
    args = p.parse_args(argv)
    args.warmup_steps = args.warmup_steps or ladder_warmup_steps(args.steps)
    if args.merge_from is not None:
        for f in (args.out, args.merge_from):
            if not f.is_file():
                raise SystemExit(f"--merge-from merges one ladder report into --out, and {f} is not a file. Fix: "
                                 "--out reports/ladder_colab_emulation.json --merge-from <the rung's report>")
        print(markdown(merge_from(args.out, args.merge_from)))
        return 0
    if args.rejudge:
        if not args.out.is_file():
            raise SystemExit(f"--rejudge reads --out, and {args.out} is not a file. Fix: --out reports/ladder.json")
        print(markdown(rejudge(args.out)))
        return 0

    bad = [x for x in args.rerun if x.count(":") != 1 or x.split(":")[0] not in CONFIGS
           or x.split(":")[1] not in GPT2_LADDER]
    if bad:  # issue 41: a garbage --rerun was ignored
        raise SystemExit(f"--rerun {' '.join(bad)}: each is CONFIG:SIZE with CONFIG one of {list(CONFIGS)} and SIZE "
                         f"one of {list(GPT2_LADDER)}. Fix: e.g. --rerun zero3_nvme_optimizer:gpt2-xl")
    started = time.perf_counter()
    # --emulate: the whole emulation, fp16 and the T4 budget too, here and in every child (issue 41: without
    # DS_COURSE_T4_BUDGET it ran bf16 with the whole GPU's memory)
    runtime = _bench.emulated_runtime() if args.emulate else helpers.detect_runtime()
    ram_budget_gb = COLAB_RAM_GB if (runtime.t4_budget or runtime.is_colab) else runtime.ram_budget_bytes / GB
    _bench.local_corpus(args.work_dir)  # the tokenizer its rungs' processes load
    if set(args.configs) - {"plain"}:  # the offload configs' C++ ops, compiled here before any measured rung
        helpers.runtime.build_ops("cpu_adam", *(["async_io"] if any("nvme" in c for c in args.configs) else []))
    old = json.loads(args.out.read_text()) if (args.out.exists() and not args.fresh) else {}
    settings = {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps,
                "warmup_steps": args.warmup_steps}
    if args.grad_accum != 1:
        settings["grad_accum"] = args.grad_accum
    if args.mmap_threshold_mib:
        settings["mmap_threshold_mib"] = args.mmap_threshold_mib
    if args.chunked_overflow_check:
        settings["chunked_overflow_check"] = True
    if args.emulate:
        from colab_emulation import ColabLimits

        settings["emulation"] = ColabLimits().as_report(runtime.emulation)
    same = old.get("runtime") == runtime.label and old.get("settings") == settings
    rerun = {tuple(x.split(":")) for x in args.rerun}
    # measured rungs are kept (their predictions are recomputed: they follow the current estimator); refused
    # or unfinished ones are decided again
    done = {(r["config"], r["model"]): r for r in old.get("rows", [])
            if r.get("ran", True) and not r.get("timed_out") and (r["config"], r["model"]) not in rerun} if same else {}
    rows: list[dict] = []
    not_run: list[str] = []
    baseline = [FRESH_PROCESS_RSS_GB]
    sizes = list(args.sizes)

    lock = threading.RLock()

    def write() -> dict:
        report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "precision": runtime.precision,
                  "settings": settings,
                  "budgets": {"vram_gib": round(runtime.vram_budget_bytes / GiB, 1), "ram_gb": round(ram_budget_gb, 1),
                              "disk_gb": DISK_BUDGET_GB},
                  "method": "fresh process per rung; DeepSpeed configs start at plain PyTorch's first failing size",
                  "lanes": args.lanes or None,
                  "rows": rows, "summary": summary(rows), "not_run": not_run}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))
        return report

    def rung(name: str, size: str, gpu: str | None = None, cpus: set[int] | None = None) -> dict | None:
        """Measure (or refuse) one rung; None when the deadline has passed."""
        if (name, size) in done:
            baseline[0] = max(baseline[0], done[(name, size)].get("baseline_rss_gb", 0.0))
            kept = done[(name, size)]  # its prediction follows the check it ran with (a merged rung may differ)
            row = {**kept, **predict(name, size, runtime, None, args.micro_batch, args.seq_len, baseline[0],
                                     kept.get("chunked_overflow_check", args.chunked_overflow_check))}
            with lock:
                rows.append(row)
            return row
        if args.deadline_s and time.perf_counter() - started > args.deadline_s:
            with lock:
                not_run.append(f"{name} {size}")
                write()
            return None
        shape = helpers.model_shape(helpers.gpt2_config(size))
        nvme = Path(args.nvme_path) / f"{name}-{size}" if "nvme" in name else None
        if nvme:
            shutil.rmtree(nvme, ignore_errors=True)
            nvme.mkdir(parents=True)
        pred = predict(name, size, runtime, str(nvme) if nvme else None, args.micro_batch, args.seq_len, baseline[0],
                       args.chunked_overflow_check)
        row = {"model": size, "params": shape.n_params, "config": name, "runtime": runtime.label, **pred}
        over = [f"RAM {pred['predicted_rss_gb']:.1f} GB > {ram_budget_gb} GB"] if pred["predicted_rss_gb"] > ram_budget_gb else []
        if pred["predicted_disk_gb"] > DISK_BUDGET_GB:
            over.append(f"disk {pred['predicted_disk_gb']:.1f} GB > {DISK_BUDGET_GB} GB")
        free_gb = shutil.disk_usage(nvme).free / GB if nvme else 0.0
        if over and name not in args.verify_refusals:
            row.update(ran=False, fits=False, learns=False, learn_reason="not run", peak_vram_gib=0.0,
                       peak_rss_gb=0.0, disk_gb=0.0, tokens_per_s=0.0, losses=[], reason="refused by pre-flight, not run: predicted " + ", ".join(over))
        elif nvme and pred["predicted_disk_gb"] > 0.95 * free_gb:
            # within the 60 GB budget, but this machine's disk is smaller: a limit of the machine, not of the config
            row.update(ran=False, fits=False, learns=False, learn_reason="not run", peak_vram_gib=0.0,
                       peak_rss_gb=0.0, disk_gb=0.0, tokens_per_s=0.0, losses=[], machine_limit=True,
                       reason=f"not run: this machine's disk has {free_gb:.1f} GB free at {args.nvme_path}, the rung "
                              f"is predicted to write {pred['predicted_disk_gb']:.1f} GB")
        else:
            left = args.hard_stop_s - (time.perf_counter() - started) if args.hard_stop_s else None
            m = measure_in_child(args, name, size, nvme, gpu, cpus, timeout_s=left)
            baseline[0] = max(baseline[0], m.get("baseline_rss_gb", 0))
            if m.get("timed_out"):
                row["timed_out"] = True
            row["baseline_rss_gb"] = round(m.get("baseline_rss_gb", 0), 2)
            row.update(lr=args.lr, steps=args.steps, untimed_steps=args.untimed_steps, warmup_steps=args.warmup_steps,
                       micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                       chunked_overflow_check=args.chunked_overflow_check,
                       skipped_timed_steps=m.get("skipped_timed_steps"))
            row.update(ran=True, **judged(m, ram_budget_gb, runtime.has_gpu), **{k: m[k] for k in (
                "peak_vram_gib", "peak_rss_gb", "disk_gb", "tokens_per_s", "losses", "seconds")},
                       skipped_steps=m.get("skipped_steps"),
                       rss_by_phase_gb={k: round(v, 2) for k, v in m.get("rss_by_phase", {}).items()})
            if "enclosure" in m:
                row["enclosure"] = m["enclosure"]
        if nvme:
            shutil.rmtree(nvme, ignore_errors=True)
        with lock:
            rows.append(row)
            write()
        print(f"{name:<22}{size:<12}{'ran' if row['ran'] else 'refused':<9}{'fits' if row['fits'] else 'no':<6}"
              f"{'learns' if row.get('learns') else '':<8}"
              f"{row['peak_vram_gib']:>7.2f} GiB {report_gb(row, 'peak_rss'):>6.2f} GB RSS "
              f"(pred {row['predicted_rss_gb']:.1f}) {report_gb(row, 'disk'):>6.2f} GB disk "
              f"{row['tokens_per_s']:>8,.0f} tok/s  {row['reason'][:100]}", flush=True)
        return row

    # plain PyTorch: climb from the smallest size to its first failure (the OOM wall)
    wall = len(sizes) - 1
    if "plain" in args.configs:
        for i, size in enumerate(sizes):
            r = rung("plain", size)
            if r is None or not r["fits"]:
                wall = i
                break
    start = wall if "plain" in args.configs else 0

    def column(name: str, gpu: str | None = None, cpus: set[int] | None = None) -> None:
        r = rung(name, sizes[start], gpu, cpus)
        if r is None:
            return
        if r["fits"]:
            for size in sizes[start + 1:]:  # climb
                r = rung(name, size, gpu, cpus)
                if r is None or not r["fits"]:
                    return
        else:
            for size in reversed(sizes[:start]):  # step down to the largest that fits
                r = rung(name, size, gpu, cpus)
                if r is None or r["fits"]:
                    return

    others = [c for c in args.configs if c != "plain"]
    if not args.lanes:
        for name in others:
            column(name)
    else:
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, len(cores) // len(args.lanes))
        threads = []
        for i, lane in enumerate(args.lanes):
            gpu, names = lane.split(":")
            cpus = set(cores[i * share:(i + 1) * share])
            todo = [n for n in names.split(",") if n in others]
            threads.append(threading.Thread(target=lambda t=todo, g=gpu, c=cpus: [column(n, g, c) for n in t]))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    report = write()
    print(args.out.with_suffix(".md").read_text())
    print(f"ladder: {time.perf_counter() - started:.0f} s; summary {json.dumps(report['summary'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
