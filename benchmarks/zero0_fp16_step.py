"""Why does ZeRO-0 in fp16 train at a fraction of plain PyTorch AMP's speed (notebook 01, section 6: x0.17 on the
H200, where ZeRO-1/2 run at x0.78-0.87)? Time one training step four ways on one GPU (GPU only).

    python benchmarks/zero0_fp16_step.py --profile          # ~2 minutes on an H100/H200 (scripts/gpu_pending.sh zero0)

GPT-2 small built from `GPT2Config()` (no download), fp16, micro-batch 4 x 512 tokens, one process, activation
checkpointing on as in notebook 01 (`--no-checkpointing` turns it off); a fixed random batch (speed only); 3 warm-up
and 10 timed steps per run:
  plain PyTorch AMP + AdamW (helpers/train.py's plain_step: autocast, GradScaler, clipping at 1.0);
  ZeRO-0, torch_adam=true (configs/zero0.json: torch.optim.AdamW, so DeepSpeed wraps it in FP16_UnfusedOptimizer);
  ZeRO-0, torch_adam=false (DeepSpeed's FusedAdam, so FP16_Optimizer; its first use JIT-builds the fused_adam op:
  the run's "build_s" holds that build);
  ZeRO-2, torch_adam=true (configs/zero2.json).
The DeepSpeed runs pass `helpers.train.stage0_fp16_loss(engine, loss)` to `engine.backward`, as `train_run` does.
Prints tokens/s and the ratio to plain AMP; `--profile` also runs torch.profiler over 2 more steps of each run and
counts the host-device synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize) and device-to-host copies per
step, and keeps ZeRO-0's (torch_adam=true) top 15 ops by device and by CPU time. Writes --out (JSON) and a .md
beside it. What the code predicts: docs/decisions.md ("ZeRO-0 in fp16 is slow").
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
RUNS = [  # name, course config (None: plain PyTorch AMP), torch_adam
    ("plain PyTorch AMP", None, True),
    ("ZeRO-0, torch_adam=true", "zero0", True),
    ("ZeRO-0, torch_adam=false (FusedAdam)", "zero0", False),
    ("ZeRO-2, torch_adam=true", "zero2", True),
]
PROFILED = "ZeRO-0, torch_adam=true"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--profile", action="store_true", help="torch.profiler over 2 more steps of each run")
    p.add_argument("--cpus", type=int, default=0,
                   help="run on this many CPU cores (affinity and torch threads), as notebook 01's Colab emulation "
                        "runs on 2; 0: all this process may use")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "zero0_fp16_step.json")
    args = p.parse_args(argv)
    for name in ("warmup", "steps", "micro_batch", "seq_len", "cpus"):
        if getattr(args, name) < (0 if name in ("warmup", "cpus") else 1):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is too small. Fix: --{name.replace('_', '-')} "
                    f"{p.get_default(name)}")
    return args


def build_model(checkpointing: bool) -> Any:
    """GPT-2 small (124M parameters, 148 parameter tensors) from its config, on the GPU, in fp32."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model.cuda().train()


def plain_run(args: argparse.Namespace) -> tuple[Callable[[Any], float], dict[str, Any], dict[str, Any]]:
    """helpers/train.py's plain_step with one micro-batch: autocast fp16, scaled backward, unscale, clip 1.0, step."""
    import torch

    model = build_model(args.checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16)

    def step(ids: Any) -> float:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        value = loss.item()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return value

    return step, {"model": model, "optimizer": optimizer}, {"optimizer": "torch.optim.AdamW + GradScaler"}


def engine_run(args: argparse.Namespace, config: str,
               torch_adam: bool) -> tuple[Callable[[Any], float], dict[str, Any], dict[str, Any]]:
    """A DeepSpeed engine from the course's config `config` in fp16; helpers/train.py's engine_step."""
    import deepspeed

    import helpers
    from helpers.runtime import setup_single_process
    from helpers.train import stage0_fp16_loss

    cfg = helpers.course_config(config, helpers.detect_runtime(), micro_batch_size=args.micro_batch,
                                precision="fp16", lr=1e-4, warmup_steps=1)
    if not torch_adam:
        cfg["optimizer"]["params"].pop("torch_adam", None)
    setup_single_process()
    model = build_model(args.checkpointing)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(ids: Any) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(stage0_fp16_loss(engine, loss))
        engine.step()
        return loss.item()

    info = {"optimizer": type(engine.optimizer).__name__,
            "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
            "zero_stage": engine.zero_optimization_stage(), "fp16": engine.fp16_enabled(),
            "parameter_tensors": sum(1 for p in engine.module.parameters() if p.requires_grad)}
    return step, {"engine": engine, "optimizer": optimizer, "model": model}, info


def profile_steps(step: Callable[[Any], float], ids: Any, steps: int, top: bool) -> dict[str, Any]:
    """torch.profiler over `steps` steps: host-device syncs and device-to-host copies per step; with `top`, the 15 ops
    with the most device time and the 15 with the most CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(ids)
        torch.cuda.synchronize()
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    out: dict[str, Any] = {
        "steps": steps,
        "syncs_per_step": {k: count.get(k, 0) / steps for k in SYNC_EVENTS},
        "memcpy_dtoh_per_step": sum(n for k, n in count.items() if "DtoH" in k or "Device -> " in k) / steps,
        "memcpy_calls_per_step": sum(n for k, n in count.items() if k.startswith("cudaMemcpy")) / steps,
        "kernel_launches_per_step": sum(n for k, n in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                              "cudaLaunchKernelExC")) / steps,
    }
    if top:
        def device_us(e: Any) -> float:
            return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))

        def row(e: Any) -> dict[str, Any]:
            return {"op": e.key, "calls": e.count, "device_ms": round(device_us(e) / 1e3, 3),
                    "cpu_ms": round(e.cpu_time_total / 1e3, 3), "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}

        out["top_by_device_time"] = [row(e) for e in sorted(events, key=device_us, reverse=True)[:15]]
        out["top_by_cpu_time"] = [row(e) for e in sorted(events, key=lambda e: e.cpu_time_total, reverse=True)[:15]]
    return out


def measure(args: argparse.Namespace, name: str, config: str | None, torch_adam: bool) -> dict[str, Any]:
    """Build one run, warm it up, time `args.steps` steps (and profile 2 more with --profile); tear it down."""
    import torch

    from helpers.runtime import teardown

    t0 = time.perf_counter()
    step, ns, info = plain_run(args) if config is None else engine_run(args, config, torch_adam)
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, 50257, (args.micro_batch, args.seq_len), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    for _ in range(args.warmup):
        step(ids)
    step_s, losses = [], []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        losses.append(step(ids))
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t)
    seconds = time.perf_counter() - start
    row = {"name": name, "config": config or "plain", "torch_adam": torch_adam, **info,
           "build_s": round(build_s, 1), "tokens_per_s": round(args.steps * args.micro_batch * args.seq_len / seconds),
           "median_step_ms": round(1e3 * statistics.median(step_s), 2), "losses": [round(x, 4) for x in losses]}
    if args.profile:
        row["profile"] = profile_steps(step, ids, 2, top=name == PROFILED)
    teardown(ns, *list(ns))
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return row


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: one row per run, then ZeRO-0's top ops."""
    s = report["settings"]
    lines = [f"# ZeRO-0 in fp16: one step four ways ({report['device']}, {report['date']})", "",
             f"GPT-2 small, fp16, micro-batch {s['micro_batch']} x {s['seq_len']} tokens, activation checkpointing "
             f"{'on' if s['checkpointing'] else 'off'}, {s.get('cpus', '?')} CPU cores, {s['warmup']} warm-up + "
             f"{s['steps']} timed steps; torch {report['torch']}, DeepSpeed {report['deepspeed']}.", "",
             "| run | optimizer (DeepSpeed's wrapper) | tokens/s | x plain | median step ms | build s | syncs/step "
             "| DtoH copies/step | kernel launches/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][:120]} | | | | | | | |")
            continue
        prof = r.get("profile", {})
        syncs = sum(prof.get("syncs_per_step", {}).values()) if prof else ""
        lines.append(f"| {r['name']} | {r['optimizer']} ({r.get('basic_optimizer', '')}) | {r['tokens_per_s']:,} | "
                     f"x{r.get('ratio', float('nan')):.2f} | {r['median_step_ms']} | {r['build_s']} | {syncs} | "
                     f"{prof.get('memcpy_dtoh_per_step', '')} | {prof.get('kernel_launches_per_step', '')} |")
    for r in report["runs"]:
        for key, what in (("top_by_device_time", "device"), ("top_by_cpu_time", "CPU")):
            rows = r.get("profile", {}).get(key)
            if rows:
                lines += ["", f"{r['name']}: top 15 ops by {what} time over {r['profile']['steps']} steps", "",
                          "| op | calls | device ms | CPU ms (total) | self CPU ms |", "|---|---|---|---|---|"]
                lines += [f"| `{x['op']}` | {x['calls']} | {x['device_ms']} | {x['cpu_ms']} | {x['self_cpu_ms']} |"
                          for x in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("zero0_fp16_step.py needs a CUDA GPU: it times DeepSpeed's fp16 optimizers, which DeepSpeed refuses on "
              "CPU. Fix: run it on the GPU machine (scripts/gpu_pending.sh zero0).", file=sys.stderr)
        return 2
    if args.cpus:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cpus])
        torch.set_num_threads(args.cpus)
    import deepspeed

    import _bench

    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "settings": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "warmup": args.warmup,
                     "steps": args.steps, "checkpointing": args.checkpointing, "precision": "fp16",
                     "cpus": args.cpus or len(os.sched_getaffinity(0))},
        "runs": []}
    plain_tps = None
    for name, config, torch_adam in RUNS:
        try:
            row = measure(args, name, config, torch_adam)
        except Exception as exc:  # noqa: BLE001 - e.g. the fused_adam build failing: the other runs still count
            row = {"name": name, "config": config, "torch_adam": torch_adam, "error": f"{type(exc).__name__}: {exc}"}
        if config is None and "tokens_per_s" in row:
            plain_tps = row["tokens_per_s"]
        if plain_tps and "tokens_per_s" in row:
            row["ratio"] = round(row["tokens_per_s"] / plain_tps, 3)
        report["runs"].append(row)
        print(f"{name:<40} " + (f"{row['tokens_per_s']:>8,} tokens/s  x{row.get('ratio', float('nan')):.2f}  "
                                f"{row['optimizer']}  build {row['build_s']} s" if "error" not in row
                                else f"failed: {row['error']}"), flush=True)
        _bench.write_report(report, args.out, markdown)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0 if all("error" not in r for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
