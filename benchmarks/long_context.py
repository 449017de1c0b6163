"""Benchmark: the longest sequence that trains, technique by technique, for one Llama-shaped model (issue 26,
notebook 06).

    python benchmarks/long_context.py --emulate          # GPU: Colab enclosure (T4_VRAM_GIB, fp16, 12.1 GB RAM, 2 CPUs)
    python benchmarks/long_context.py --hidden 64 --intermediate 176 --layers 2 --heads 4 --kv-heads 2 \\
        --lengths 256 512 --out build/long_context_cpu.json    # CPU smoke: fixed lengths, no search

Model: `helpers.long_context.long_context_config` (~222M parameters by default: h 1024, MLP 2816, 16 layers, 16 heads each with its
own key/value head (grouped-query attention has no fused kernel on a T4: `helpers.long_context.attention_kernel`), RoPE) with the
course's tokenizer (8192 tokens), trained by a DeepSpeed ZeRO-2 engine (fp16 on a GPU, torch's AdamW, constant
learning rate) on one sequence of the shipped corpus (batch 1). The rungs (`helpers.long_context.TECHNIQUES`) each add one
technique: plain; activation checkpointing (transformers' non-reentrant); DeepSpeed's TiledFusedLogitsLoss; its
TiledMLP; DeepSpeed's cpu_checkpointing (layer inputs in page-locked RAM); then the optimizer on the CPU
(ZeRO-Offload) when `--optimizer-offload`. Each rung runs in a fresh process (inside its own enclosure with
--emulate): the estimate (`helpers.long_context.estimate_activation_peak` + the model states) predicts its longest length; the
child trains at the longest step of the length grid predicted to fit (a step is 1/8 of the power of two below,
at least 1024 tokens), then one step up or down until it has one length that trains and the next that does not.
"Trains" = forward + backward + optimizer step with no out-of-memory error, at least two steps not skipped by the
fp16 loss scaler, and a lower loss on the second (the same sequence, so it must fall). Each length also records the
peak GPU memory (allocated, as torch counts it), peak RSS and tokens/s of the last step, beside the estimate. A rung
killed at the RAM limit keeps the lengths it finished. `--lengths` measures fixed lengths instead of searching.
Writes reports/long_context.json and .md.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import helpers
from helpers.config import ConfigSettings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "scripts"))  # colab_emulation, for --emulate
import _bench  # noqa: E402

OPTIMIZER_ON_CPU = "+ optimizer on CPU"
SPEED_SEQ_LEN = 4096  # every rung also measured here: tokens/s at one common length
LR = 1e-3


def rungs(optimizer_offload: bool) -> dict[str, str]:
    """Rung name -> the technique of helpers.long_context.TECHNIQUES it trains with (the last rung adds the optimizer on CPU)."""
    out = {name: name for name in helpers.long_context.TECHNIQUES}
    if optimizer_offload:
        out[OPTIMIZER_ON_CPU] = "+ checkpoints on CPU"
    return out


def ds_config(rung: str, runtime: Any) -> dict[str, Any]:
    """ZeRO-2, batch 1, constant lr; the runtime's precision (fp16 from loss scale 2^8 on a T4 budget, fp32 on CPU);
    optimizer on CPU for the last rung."""
    return helpers.build_ds_config(2, runtime=runtime, micro_batch_size=1,
                                   offload_optimizer="cpu" if rung == OPTIMIZER_ON_CPU else "none",
                                   settings=ConfigSettings(lr=LR, scheduler=None, warmup_steps=0,
                                                           initial_scale_power=8))


def grid_step(seq_len: int) -> int:
    """The search's resolution near `seq_len`: 1/8 of the power of two at or below it, at least 1024 tokens."""
    return max(1024, (1 << (max(seq_len, 1).bit_length() - 1)) // 8)


WARM_UP_SEQ_LEN = 1024


def estimate_row(shape: Any, n_params: int, config: dict[str, Any], seq_len: int, technique: str, tile: int,
                 base_rss: int) -> dict[str, Any]:
    """The estimate of one length, as a row stores it: GPU peak and its parts, and RAM = the process's measured base
    (`warmed_base_rss`) + what the estimate adds on the host (page-locked checkpoints, model states on the CPU)."""
    e = helpers.estimate_long_context_run(shape, n_params, config, seq_len, technique, logits_tile_tokens=tile)
    return {"gpu_peak": e.gpu_peak, "activation_peak": e.activation_peak, "states_gpu": e.states_gpu,
            "saved": e.activations.saved.gpu_total, "transient": e.activations.peak_transient,
            "ram": base_rss + e.ram_added, "ram_base": base_rss, "cpu_pinned": e.cpu_pinned,
            "states_cpu": e.states_cpu}


def warmed_base_rss(config: Any, warm_up_ds_config: dict[str, Any], technique: str, tokens: Any, tile: int) -> int:
    """This process's RSS once a step has run: the base the RAM estimate adds to (measured, not estimated).

    A first step loads what a fresh process does not have yet: CUDA kernels (loaded lazily, on first use), the
    communicator of DeepSpeed's process group, cuBLAS state: about 0.5 GB on the H200 (2026-12-03: RSS 1.83 GB
    before the first step, 2.30 after, at every length). One step at WARM_UP_SEQ_LEN tokens of a throwaway engine with
    the model states on the GPU (`warm_up_ds_config`) loads them; the engine is then freed, so for the optimizer on
    CPU the base holds none of its states (the estimate counts them)."""
    import torch

    warm = helpers.long_context.build_long_context_engine(config, warm_up_ds_config, technique)
    helpers.long_context.train_at_length(warm, tokens, min(WARM_UP_SEQ_LEN, len(tokens)), technique, logits_tile_tokens=tile,
                            max_steps=1)
    helpers.runtime.destroy_engine(warm)
    del warm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return helpers.release_host_memory()  # freed heap and cached page-locked blocks back to the OS: the RSS after


# ---------------------------------------------------------------------------------------------------------- child


def child(spec_path: Path) -> int:
    """One rung, in a process of its own: search (or measure the fixed lengths), one JSON line per length."""
    spec = json.loads(spec_path.read_text())
    helpers.detect_runtime()  # in the enclosure (T4 budget mode): caps this process's allocator at T4_VRAM_GIB
    if spec.get("allocator") == "expandable":
        helpers.use_expandable_segments()  # before the first allocation: every segment of this process expands
    helpers.runtime.setup_single_process()
    import torch

    out = Path(spec["result"])
    tokens = torch.load(spec["stream"])
    rung, technique, tile = spec["rung"], spec["technique"], spec["logits_tile"]
    config = helpers.long_context.long_context_config(spec["vocab"], hidden=spec["hidden"], intermediate=spec["intermediate"],
                                         layers=spec["layers"], heads=spec["heads"], kv_heads=spec["kv_heads"])
    shape = helpers.long_context_shape(config)
    helpers.runtime.warm_up_cuda()
    base_rss = warmed_base_rss(config, spec["warm_up_ds_config"], technique, tokens, tile)
    engine = helpers.long_context.build_long_context_engine(config, spec["ds_config"], technique)
    n_params = sum(p.numel() for p in engine.module.parameters())
    kernel = helpers.long_context.attention_kernel(config, next(engine.module.parameters()).dtype)  # the engine refused "math"
    engine_rss = helpers.memory.rss_bytes()  # with the engine: for the optimizer on CPU, its states are here already

    def est(seq_len: int) -> dict[str, Any]:
        return estimate_row(shape, n_params, spec["ds_config"], seq_len, technique, tile, base_rss)

    ram_left = max(spec["ram_budget"] - base_rss, 1) if spec["ram_budget"] else 0
    predicted = helpers.predict_longest_seq_len(shape, n_params, spec["ds_config"], technique,
                                                vram_bytes=spec["vram_budget"], ram_bytes=ram_left,
                                                logits_tile_tokens=tile, upper=spec["max_seq_len"])

    def write(row: dict[str, Any]) -> None:
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    write({"kind": "start", "n_params": n_params, "predicted_longest": predicted, "base_rss": base_rss,
           "baseline_rss": engine_rss, "ds_config": spec["ds_config"], "shape": shape.__dict__, "attention_kernel": kernel})
    print(f"[{rung}] {n_params / 1e6:.0f}M params; estimate: longest {predicted:,} tokens", flush=True)

    earlier = {int(k): v for k, v in spec.get("earlier", {}).items()}  # --resume-from: length -> trained

    done: dict[int, dict[str, Any]] = {}  # this run's lengths: the speed length may also be the search's first

    def run(seq_len: int) -> dict[str, Any]:
        nonlocal engine
        if seq_len in done:
            return done[seq_len]
        if seq_len in earlier and not spec["lengths"]:  # measured by the run resumed: the search goes on from it
            print(f"[{rung}] {seq_len:>8,} tokens: {'trains' if earlier[seq_len] else 'fails'} (earlier run)", flush=True)
            return {"seq_len": seq_len, "ok": earlier[seq_len]}
        write({"kind": "trying", "seq_len": seq_len})  # a rung killed or stopped mid-length: which length it was
        t0 = time.perf_counter()
        r = helpers.long_context.train_at_length(engine, tokens, seq_len, technique, logits_tile_tokens=tile,
                                    max_steps=spec["max_steps"])
        if not r.engine_usable:  # an out-of-memory error left a half-done backward in it
            helpers.runtime.destroy_engine(engine)
            engine = None
            gc.collect()
            engine = helpers.long_context.build_long_context_engine(config, spec["ds_config"], technique)
        row = {**r.as_dict(), "kind": "attempt", "seconds": round(time.perf_counter() - t0, 1),
               "estimate": est(seq_len)}
        write(row)
        got = (f"{r.tokens_per_s:,.0f} tok/s, peak GPU {r.peak_gpu_allocated / 2**30:.2f} GiB (estimate "
               f"{row['estimate']['gpu_peak'] / 2**30:.2f}), RSS {r.peak_rss / 1e9:.2f} GB" if r.ok else "")
        print(f"[{rung}] {seq_len:>8,} tokens: {'trains' if r.ok else r.error[:90]} {got}", flush=True)
        done[seq_len] = row
        return row

    if spec["lengths"]:
        for seq_len in spec["lengths"]:
            run(seq_len)
        return 0
    if SPEED_SEQ_LEN <= predicted and SPEED_SEQ_LEN not in earlier:
        run(SPEED_SEQ_LEN)
    seq_len = max(1024, predicted // grid_step(predicted) * grid_step(predicted))
    first = run(seq_len)
    direction = 1 if first["ok"] else -1
    while True:
        nxt = seq_len + direction * grid_step(seq_len if direction > 0 else seq_len - 1)
        if nxt < 1024 or nxt > spec["max_seq_len"]:
            break
        row = run(nxt)
        seq_len = nxt
        if row["ok"] != first["ok"]:
            break
    return 0



# --------------------------------------------------------------------------------------------------------- parent


def token_stream(work_dir: Path, n_tokens: int) -> tuple[Path, int]:
    """The shipped corpus through the course's tokenizer as one stream of `n_tokens` ids (helpers.data.token_stream),
    saved for the rungs' processes; returns (its path, the vocabulary size)."""
    import torch

    ds, tok = _bench.local_corpus(work_dir)
    path = work_dir / f"stream_{n_tokens}.pt"
    if not path.exists():
        torch.save(helpers.data.token_stream(ds["train"], tok, n_tokens), path)
    return path, len(tok)


def measured_label(date: str, side_by_side: int) -> str:
    """When a row was measured and beside how many rungs (its tokens/s depend on it): kept with the row when a later
    run merges it (--keep-rows-from)."""
    return f"{date}, {side_by_side} rung(s) side by side"


def summarize(rung: str, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """One rung's row from its result lines (this run's, after those of a resumed run). A length tried with no result
    ended with its process ("ended" line): killed (RAM) counts as failing; stopped (timeout) is `unfinished`,
    neither trained nor failed. A length measured again (`--lengths` in a later run) keeps its newest result."""
    start = next((x for x in reversed(lines) if x.get("kind") == "start"), {})
    by_length: dict[int, dict[str, Any]] = {}  # in the lines' order: a later result of a length replaces an earlier
    killed, unfinished = None, None
    for i, x in enumerate(lines):
        ended = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].get("kind") == "ended" else None
        if x.get("kind") == "start":  # a new process: how an earlier one ended is not this row's end
            killed, unfinished = None, None
        elif x.get("kind") == "attempt":
            by_length[x["seq_len"]] = x
        elif x.get("kind") == "ended":
            killed = x["killed"]  # the last process's end is the row's
        elif x.get("kind") == "trying" and ended and ended["timed_out"]:
            unfinished = x["seq_len"]
        elif x.get("kind") == "trying" and ended:
            by_length[x["seq_len"]] = {"kind": "attempt", "seq_len": x["seq_len"], "ok": False,
                                       "error": ended["killed"], "losses": [], "estimate": x.get("estimate", {}),
                                       "measured": x.get("measured")}
    attempts = sorted(by_length.values(), key=lambda a: a["seq_len"])
    ok = [a for a in attempts if a["ok"]]
    longest = max(ok, key=lambda a: a["seq_len"]) if ok else None
    failing = sorted((a for a in attempts if not a["ok"] and (longest is None or a["seq_len"] > longest["seq_len"])),
                     key=lambda a: a["seq_len"])
    row: dict[str, Any] = {"rung": rung, "predicted_longest": start.get("predicted_longest"),
                           "attention_kernel": start.get("attention_kernel"),
                           "n_params": start.get("n_params"), "attempts": attempts, "killed": killed,
                           "unfinished": unfinished, "ram_base_gb": round(start["base_rss"] / 1e9, 2)
                           if start.get("base_rss") else None,
                           "longest": longest["seq_len"] if longest else 0,
                           "first_failing": failing[0]["seq_len"] if failing else None,
                           "first_failing_error": failing[0]["error"] if failing else killed}
    labels = list(dict.fromkeys(a["measured"] for a in attempts if a.get("measured")))
    if labels:
        row["measured"] = "; ".join(labels)
    if longest:
        est = longest["estimate"]
        row.update(peak_gpu_gib=round(longest["peak_gpu_allocated"] / 2**30, 3),
                   peak_reserved_gib=round(longest.get("peak_gpu_reserved", 0) / 2**30, 3),
                   estimate_gpu_gib=round(est["gpu_peak"] / 2**30, 3),
                   gpu_ratio=round(longest["peak_gpu_allocated"] / est["gpu_peak"], 3) if est["gpu_peak"] else None,
                   peak_rss_gb=round(longest["peak_rss"] / 1e9, 2), estimate_ram_gb=round(est["ram"] / 1e9, 2),
                   ram_ratio=round(longest["peak_rss"] / est["ram"], 3) if est["ram"] else None,
                   tokens_per_s=longest["tokens_per_s"])
    return row


def markdown(report: dict[str, Any]) -> str:
    kernels = ", ".join(sorted({r["attention_kernel"] for r in report["rows"] if r.get("attention_kernel")}))
    lines = [f"# Long sequences on one GPU: the longest that trains, by technique ({report['runtime']})", "",
             f"{report['date']}. Model: {report['model']}. {report['how']}"
             + (f" Attention kernel: {kernels}." if kernels else ""), "",
             "| rung | longest trained | predicted | first failing | peak GPU GiB (estimate, ratio) | "
             "peak RSS GB (estimate) | tokens/s at longest |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        gpu = f"{r['peak_gpu_gib']:.2f} ({r['estimate_gpu_gib']:.2f}, {r['gpu_ratio']:.2f})" if r.get("peak_gpu_gib") else "-"
        ram = f"{r['peak_rss_gb']:.2f} ({r['estimate_ram_gb']:.2f})" if r.get("peak_rss_gb") else "-"
        fail = (f"{r['first_failing']:,}: {r['first_failing_error'][:60]}" if r.get("first_failing") else
                f"{r['unfinished']:,}: unfinished, {r['killed']}" if r.get("unfinished") else r.get("killed") or "-")
        lines.append(f"| {r['rung']} | {r['longest']:,} | {r['predicted_longest'] or 0:,} | {fail} | {gpu} | {ram} | "
                     f"{r.get('tokens_per_s') or 0:,.0f} |")
    s = report.get("summary", {})
    if s:
        lines += ["", f"Best: {s['best_rung']} at {s['best_longest']:,} tokens = {s['ratio_to_plain']:.1f}x plain's "
                      f"{s['plain_longest']:,}. Largest estimate error at the longest: {s['worst_gpu_error_pct']:.1f} % "
                      "(GPU peak)."]
    lines += ["", "Every length tried (a failed step: GiB allocated / reserved when it failed, and the request):", "",
              "| rung | tokens | trains | peak GPU GiB (reserved) | estimate GiB | RSS GB | "
              "estimate RAM GB | tokens/s | losses | measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        for a in r["attempts"]:
            how = "yes" if a["ok"] else a["error"][:50]
            if a.get("oom_at_step") is not None:
                how = (f"out of GPU memory in step {a['oom_at_step'] + 1}: {a['oom_allocated'] / 2**30:.2f} / "
                       f"{a['oom_reserved'] / 2**30:.2f} GiB, asked {a['oom_tried'] / 2**30:.2f}")
            gpu = f"{a.get('peak_gpu_allocated', 0) / 2**30:.2f}" + (
                f" ({a['peak_gpu_reserved'] / 2**30:.2f})" if a.get("peak_gpu_reserved") else "")
            lines.append(f"| {r['rung']} | {a['seq_len']:,} | {how} | "
                         f"{gpu} | {a['estimate']['gpu_peak'] / 2**30:.2f} | "
                         f"{a.get('peak_rss', 0) / 1e9:.2f} | {a['estimate']['ram'] / 1e9:.2f} | "
                         f"{a.get('tokens_per_s', 0):,.0f} | {a.get('losses', '')} | {a.get('measured', '')} |")
    return "\n".join(lines) + "\n"


def with_summary(report: dict[str, Any]) -> dict[str, Any]:
    rows = {r["rung"]: r for r in report["rows"]}
    if "plain" in rows and rows["plain"]["longest"]:
        best = max(report["rows"], key=lambda r: r["longest"])
        errors = [abs(r["gpu_ratio"] - 1) * 100 for r in report["rows"] if r.get("gpu_ratio")]
        report["summary"] = {"plain_longest": rows["plain"]["longest"], "best_rung": best["rung"],
                             "best_longest": best["longest"], "ratio_to_plain": best["longest"] / rows["plain"]["longest"],
                             "worst_gpu_error_pct": max(errors) if errors else 0.0}
    return report


def slug(rung: str) -> str:
    """The rung's file name stem in the work folder (its result lines, its spec)."""
    return rung.replace(" ", "_").replace("+", "plus")


RESUMED_SETTINGS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "logits_tile", "max_steps",
                    "allocator")


def resumed_lines(folders: list[Path], settings: dict[str, Any], rung_names: list[str]
                  ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The result lines of earlier runs (`--resume-from`: their work folders, each with the run.json it wrote), in
    the folders' order, each line labelled with when it was measured, and the newest run.json; refused if a run's
    model or allocator differ from this one's (the settings given: called before the tokenizer exists without
    "vocab", and again after with it)."""
    out: dict[str, list[dict[str, Any]]] = {}
    meta: dict[str, Any] = {}
    for folder in folders:
        meta_path = folder / "run.json"
        if not meta_path.exists():
            raise SystemExit(f"--resume-from {folder}: no run.json there (the work folder of a run of this benchmark "
                             "has one). Fix: pass that folder, or leave --resume-from out")
        meta = json.loads(meta_path.read_text())
        differ = {k: (meta["settings"].get(k), settings[k]) for k in RESUMED_SETTINGS
                  if k in settings and meta["settings"].get(k) != settings[k]}
        if differ:
            raise SystemExit(f"--resume-from {folder}: measured with other settings {differ} (earlier, now). Fix: "
                             "run with the earlier settings, or leave --resume-from out")
        label = measured_label(meta["date"], meta["side_by_side"])
        for name in rung_names:  # the rungs that run measured (a folder may hold older files of others)
            path = folder / f"{slug(name)}.jsonl"
            if name in meta["rungs"] and path.exists():
                out.setdefault(name, []).extend({**json.loads(x), "measured": label}
                                                for x in path.read_text().splitlines() if x.strip())
    return out, meta


def reestimated(lines: list[dict[str, Any]], config: dict[str, Any], technique: str, tile: int) -> list[dict[str, Any]]:
    """The lines with every length's estimate computed now, from the newest start line's shape and RAM base: rows
    of a resumed run and of this one share one estimate (`estimate_row`)."""
    starts = [x for x in lines if x.get("kind") == "start"]
    start = next((x for x in reversed(starts) if x.get("base_rss")), starts[-1] if starts else None)
    if start is None:
        return lines
    shape = helpers.long_context.LongContextShape(**start["shape"])
    base = start.get("base_rss") or start["baseline_rss"]
    config = start.get("ds_config") or config  # the runtime's the rung ran on (a report-only run may be on a CPU)
    return [{**x, "estimate": estimate_row(shape, start["n_params"], config, x["seq_len"], technique, tile, base)}
            if x.get("kind") in ("attempt", "trying") else x for x in lines]


def check_model_arguments(args: argparse.Namespace, shape: bool = True) -> None:
    """The model's shape and the lengths, refused up front with the fix (helpers.long_context.long_context_config's own check)."""
    for name in ("logits_tile", "max_seq_len", "max_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: must be 1 or more")
    bad = [n for n in args.lengths if n < 1]
    if bad:
        raise SystemExit(f"--lengths {' '.join(map(str, args.lengths))}: every length must be 1 token or more "
                         f"(got {bad}). Fix: drop them, e.g. --lengths {' '.join(str(n) for n in args.lengths if n >= 1) or 4096}")
    if not shape:
        return
    try:
        helpers.long_context.long_context_config(hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                                    heads=args.heads, kv_heads=args.kv_heads, vocab=256)
    except ValueError as err:
        raise SystemExit(f"the model's shape: {err}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rungs", nargs="*", default=None, help="rung names (default: all)")
    p.add_argument("--optimizer-offload", action="store_true", help="add the rung with the optimizer on the CPU")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--logits-tile", type=int, default=1024)
    p.add_argument("--max-seq-len", type=int, default=262144)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="*", default=[], help="measure these lengths, no search")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no rung after this many seconds")
    p.add_argument("--rung-timeout-s", type=float, default=900.0)
    p.add_argument("--parallel", type=int, default=1,
                   help="rungs side by side on the one GPU, each in its own process (and enclosure) on cores of its own")
    p.add_argument("--allocator", choices=["expandable", "default"], default="expandable",
                   help="PyTorch's CUDA allocator: expandable segments (helpers.use_expandable_segments) or its default")
    p.add_argument("--keep-rows-from", type=Path, default=None,
                   help="a report whose rows of the rungs not run now are kept (each says when it was measured)")
    p.add_argument("--resume-from", type=Path, nargs="+", default=[],
                   help="work folders of earlier runs: their lengths are kept and each rung's search goes on from them")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the report of the --resume-from folders (header from the newest run.json)")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "long_context.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench" / "long_context")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    if args.child:
        return child(args.child)
    # before any rung builds a 222M engine (issue 41: --heads 7 failed five times, exit 0); a resumed run's shape is
    # checked against the earlier run's instead (resumed_lines names the settings to run with)
    check_model_arguments(args, shape=not args.resume_from)

    started = time.perf_counter()
    runtime = helpers.detect_runtime(t4_budget=True if args.emulate else None)  # the emulation: fp16, T4_VRAM_GIB
    enclosure = limits = None
    cores = sorted(os.sched_getaffinity(0))
    cores_per_rung = 1
    if args.emulate:
        import dataclasses

        from colab_emulation import ColabLimits, Enclosure, probe

        limits = ColabLimits()
        cores_per_rung = limits.cpus
        runtime = dataclasses.replace(runtime, emulation=probe()[0], ram_total_bytes=limits.ram_bytes,
                                      ram_budget_bytes=limits.ram_bytes, cpu_cores=limits.cpus, is_colab=True)

        def enclosure(name: str, cpus: list[int]) -> Any:
            return Enclosure(name, ColabLimits(), cpus=cpus)
    if args.parallel < 1 or args.parallel * cores_per_rung > len(cores):
        fits = max(1, len(cores) // cores_per_rung)
        raise SystemExit(f"--parallel {args.parallel}: each rung needs {cores_per_rung} core(s) of its own and this "
                         f"process may use {len(cores)}. Fix: --parallel {fits}")
    chosen = rungs(args.optimizer_offload)
    names = [] if args.report_only else args.rungs or list(chosen)
    unknown = [n for n in names if n not in chosen]
    if unknown:
        raise SystemExit(f"unknown rung(s) {unknown}: choose from {list(chosen)}")
    if args.report_only and not args.resume_from:
        raise SystemExit("--report-only reports earlier runs. Fix: add --resume-from FOLDER (a run's --work-dir)")
    newest: dict[str, Any] = {}
    if args.resume_from:  # refused now if the model differs, before the tokenizer is trained
        _, newest = resumed_lines(args.resume_from, {k: getattr(args, k) for k in RESUMED_SETTINGS
                                                     if hasattr(args, k)}, [])
    args.work_dir.mkdir(parents=True, exist_ok=True)
    stream, vocab = (None, newest["settings"]["vocab"]) if args.report_only else \
        token_stream(args.work_dir, max(args.max_seq_len, *args.lengths, 1))
    vram_budget = runtime.vram_budget_bytes or 0
    ram_budget = runtime.ram_budget_bytes if (args.emulate or runtime.is_colab) else 0
    side_by_side = min(args.parallel, len(names))
    model = (f"Llama-shaped, hidden {args.hidden}, MLP {args.intermediate}, {args.layers} layers, {args.heads} heads "
             f"({args.kv_heads} KV), vocabulary {vocab} (the course's tokenizer)")
    report: dict[str, Any] = {
        "runtime": runtime.label, "date": dt.date.today().isoformat(), "model": model,
        "settings": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                     "heads": args.heads, "kv_heads": args.kv_heads, "vocab": vocab, "logits_tile": args.logits_tile,
                     "max_seq_len": args.max_seq_len, "max_steps": args.max_steps, "lr": LR, "batch": 1,
                     "zero_stage": 2, "parallel": side_by_side, "allocator": args.allocator},
        "vram_budget_gib": round(vram_budget / 2**30, 2), "ram_budget_gb": round(ram_budget / 1e9, 2),
        "emulation": limits.as_report(runtime.emulation) if limits else None,
        "how": ("Each rung in a fresh process" + (" inside the Colab enclosure" if args.emulate else "") +
                (f", {side_by_side} rungs side by side on the one GPU, each on cores of its own (memory is per "
                 "process; tokens/s were measured beside the others)" if side_by_side > 1 else "") +
                "; PyTorch's CUDA allocator " + ("with expandable segments" if args.allocator == "expandable" else
                                                 "as it comes (no expandable segments)") +
                "; peak GPU = torch's max_memory_allocated over the steps at that length (the cap applies to what "
                "the allocator reserves: both are recorded); RSS sampled every 0.05 s; estimated RAM = the process's RSS "
                f"after one {WARM_UP_SEQ_LEN}-token step of a throwaway engine (measured: libraries, CUDA context, "
                "kernels) + the page-locked checkpoints and model states on the CPU (estimated)."),
        "rows": []}
    rows: dict[str, dict[str, Any]] = {}
    if args.keep_rows_from:  # rungs measured in an earlier run, kept beside this run's (each row says its run)
        earlier = json.loads(args.keep_rows_from.read_text())
        its_allocator = earlier["settings"].get("allocator", "default")  # reports before --allocator: the default
        if its_allocator != args.allocator:
            raise SystemExit(f"--keep-rows-from {args.keep_rows_from}: measured with another allocator. Fix: run "
                             f"with --allocator {its_allocator} or no --keep-rows-from")
        for r in earlier["rows"]:
            if r["rung"] not in names:
                rows[r["rung"]] = {**r, "measured": r.get("measured") or
                                   measured_label(earlier["date"], earlier["settings"]["parallel"])}
    if args.report_only:  # the header of the newest run reported
        report.update(newest.get("header", {}), date=newest["date"])
        report["settings"]["parallel"] = newest["settings"]["parallel"]
    this_run = measured_label(report["date"], side_by_side)
    earlier_lines = resumed_lines(args.resume_from, report["settings"], list(chosen))[0] if args.resume_from else {}
    for name, lines in earlier_lines.items():
        if name not in names:  # measured earlier only: its row from those lines
            rows[name] = summarize(name, reestimated(lines, ds_config(name, runtime), chosen[name], args.logits_tile))
    if names:  # for a later --resume-from of this folder
        header = {k: report[k] for k in ("runtime", "vram_budget_gib", "ram_budget_gb", "emulation", "how")}
        (args.work_dir / "run.json").write_text(json.dumps(
            {"date": report["date"], "side_by_side": side_by_side, "rungs": names, "settings": report["settings"],
             "header": header}, indent=1))
    order = [n for n in chosen if n in names or n in rows]  # the report's rows: the rungs' order
    report["rows"] = [rows[n] for n in order if n in rows]
    lock = threading.Lock()

    def run_rung(index: int, name: str, cpus: list[int]) -> None:
        if args.deadline_s and time.perf_counter() - started > args.deadline_s:
            print(f"{name}: not started (deadline)", flush=True)
            return
        result = args.work_dir / f"{slug(name)}.jsonl"
        result.unlink(missing_ok=True)
        spec = {"rung": name, "technique": chosen[name], "ds_config": ds_config(name, runtime), "vocab": vocab,
                "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers, "heads": args.heads,
                "kv_heads": args.kv_heads, "seed": 0, "stream": str(stream), "result": str(result),
                "logits_tile": args.logits_tile, "max_seq_len": args.max_seq_len, "max_steps": args.max_steps,
                "lengths": args.lengths, "vram_budget": vram_budget or (1 << 62), "ram_budget": ram_budget,
                "allocator": args.allocator, "warm_up_ds_config": ds_config("plain", runtime),
                "earlier": {a["seq_len"]: a["ok"] for a in earlier_lines.get(name, []) if a.get("kind") == "attempt"}}
        spec_path = args.work_dir / f"spec_{slug(name)}.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)]
        env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        killed, timed_out = None, False
        enc = enclosure(f"lc-{os.getpid()}-{index}", cpus) if enclosure else None  # two benchmarks may run at once
        try:
            if enc is None:
                rc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.rung_timeout_s).returncode
            else:
                with enc:
                    rc = subprocess.run(enc.join_argv() + cmd, env=dict(env, **enc.environment()), cwd=ROOT,
                                        timeout=args.rung_timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc, killed, timed_out = -1, f"stopped after {args.rung_timeout_s:.0f} s", True
        if rc and not killed:
            kills = (enc.stats.as_report().get("oom_kills") if enc else 0) or 0
            killed = f"killed at the RAM limit ({kills} OOM kill(s))" if kills else f"exit code {rc}"
        if killed:  # kept in the lines: a later --resume-from / --report-only knows how that length ended
            with result.open("a") as f:
                f.write(json.dumps({"kind": "ended", "killed": killed, "timed_out": timed_out}) + "\n")
        lines = [{**json.loads(x), "measured": this_run} for x in result.read_text().splitlines()
                 if x.strip()] if result.exists() else []
        lines = reestimated(earlier_lines.get(name, []) + lines, ds_config(name, runtime), chosen[name],
                            args.logits_tile)
        row = summarize(name, lines)
        if enc is not None:
            row["enclosure"] = enc.stats.as_report()
        with lock:  # rows in the rungs' order, whichever finished first; the report rewritten after each
            rows[name] = row
            report["rows"] = [rows[n] for n in order if n in rows]
            _bench.write_report(with_summary(report), args.out, markdown)

    slots = [cores[k * cores_per_rung:(k + 1) * cores_per_rung] for k in range(side_by_side)]
    free = list(range(side_by_side))  # a rung takes a free slot of cores and gives it back when it ends

    def in_a_slot(index: int, name: str) -> None:
        with lock:
            slot = free.pop(0)
        try:
            run_rung(index, name, slots[slot])
        finally:
            with lock:
                free.append(slot)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(side_by_side, 1)) as pool:
        for future in [pool.submit(in_a_slot, i, n) for i, n in enumerate(names)]:
            future.result()
    _bench.write_report(with_summary(report), args.out, markdown)
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
