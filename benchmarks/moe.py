"""Dense vs Mixture of Experts at equal active compute, with DeepSpeed MoE under ZeRO-2 (notebook 03).

    DS_COURSE_T4_BUDGET=1 python benchmarks/moe.py

Trains the dense twin, MoE top-1 and MoE top-2 (same data, steps, batch and config) and writes
reports/moe.json (+ moe.md): per row params_total, params_active, measured FLOPs per token, tokens_per_s (the
run's average, validation included), step_seconds and tokens_per_s_steps (quartiles of the per-step tokens/s),
peak_vram_gib, val_loss and the expert load per expert; then the aux-loss coefficient sweep (top-1), a
capacity-factor sweep on the trained top-1 model, DeepSpeed's ZeRO-3 refusal, and with --ep the 2-process
expert-parallel run (2 GPUs if the machine has them, else 2 CPU processes over gloo).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
from helpers.gpt import GPTConfig, build_gpt
from helpers.moe import MoEHooks, run_from_report_row

ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--texts", type=int, default=0, help="use only the first N paragraphs of the corpus (0: all)")
    p.add_argument("--aux-sweep", type=float, nargs="*", default=[0.0, 0.01, 0.1])
    p.add_argument("--capacity-sweep", type=float, nargs="*", default=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0])
    p.add_argument("--ep", action="store_true", help="also run scripts/moe_expert_parallel.py on 2 processes")
    p.add_argument("--ep-steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "moe.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench_moe")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def row(run: helpers.train.RunResult) -> dict:
    """A report row of one MoE run (`train_run` with `MoEHooks`): the record without its per-step curves, plus the
    LM and aux losses rounded, the first/last-5 means, the expert load and the routing's headline numbers."""
    e = run.extras
    d = {k: v for k, v in run.as_dict().items() if k not in ("losses", "extras")}
    d.update({k: v for k, v in e.items() if k not in ("lm_losses", "aux_losses", "load_history", "probe")})
    d["val_loss"] = run.val_loss
    d["expert_load"] = e["routing"].get("load", [])
    d["lm_losses"] = [round(x, 4) for x in e["lm_losses"]]
    d["aux_losses"] = [round(x, 4) for x in e["aux_losses"]]
    d["loss_first5"] = round(sum(e["lm_losses"][:5]) / 5, 4)
    d["loss_last5"] = round(sum(e["lm_losses"][-5:]) / 5, 4)
    d["dropped_fraction"] = e["routing"].get("dropped_fraction")
    d["imbalance"] = e["routing"].get("imbalance")
    # per-step tokens/s: lower quartile, median, upper quartile of the timed steps (validation excluded)
    d["tokens_per_s_steps"] = [round(x, 1) for x in run.speed_spread()]
    return d


def expert_parallel(args: argparse.Namespace, runtime: helpers.hardware.Runtime, blocks, vocab: int) -> dict:
    """Run the 2-process expert-parallel script; return its per-rank reports."""
    device = "cuda" if runtime.gpu_count >= 2 else "cpu"
    out = args.work_dir / "expert_parallel"
    shutil.rmtree(out, ignore_errors=True)
    saved = args.work_dir / "ep_blocks"
    shutil.rmtree(saved, ignore_errors=True)
    blocks.select(range(min(len(blocks), 256))).with_format(None).save_to_disk(str(saved))  # rows, no transform
    shape = (["--hidden", str(args.hidden), "--layers", str(args.layers), "--heads", str(args.heads),
              "--ffn", str(args.ffn)] if device == "cuda" else
             ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn", "256"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(helpers.free_port()), str(ROOT / "notebooks" / "programs" / "moe_expert_parallel.py"), "--out", str(out),
           "--device", device, "--blocks", str(saved), "--vocab", str(vocab), "--experts", str(args.experts),
           "--steps", str(args.ep_steps), "--micro-batch", str(min(args.micro_batch, 4)), *shape]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    if device == "cpu":  # CPU processes even where a GPU is present: hide it from them
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"device": device, "error": proc.stderr[-3000:]}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {"device": device, "ranks": ranks}


def speed(row: dict) -> str:
    """A row's tokens/s: the median step and its middle half when the steps were timed, else the run's average."""
    steps = row.get("tokens_per_s_steps")
    if steps and len(row.get("step_seconds", [])) >= 2:
        return f"{steps[1]:,.0f} ({steps[0]:,.0f}-{steps[2]:,.0f})"
    return f"{row['tokens_per_s']:,.0f}"


def markdown(report: dict) -> str:
    lines = [f"# Dense vs Mixture of Experts at equal active compute ({report['runtime']}, {report['date']})", "",
             f"GPT-style model, hidden {report['shape']['hidden']}, {report['shape']['layers']} layers, "
             f"{report['shape']['num_experts']} experts in blocks {report['moe_layers']}, capacity factor "
             f"{report['shape']['capacity_factor']}, aux coefficient {report['shape']['aux_loss_coef']}; "
             f"{report['steps']} steps of {report['micro_batch']} x {report['seq_len']} tokens, ZeRO-2, "
             f"{report['precision']}.", "",
             "| model | params total | params active | fwd FLOP/token | tokens/s | peak VRAM GiB | loss first5 -> last5 "
             "| val loss | dropped | busiest/mean |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in report["rows"]:
        dropped = "-" if r["dropped_fraction"] is None else f"{100 * r['dropped_fraction']:.1f} %"
        imb = "-" if r["imbalance"] is None else f"{r['imbalance']:.2f}"
        lines.append(f"| {r['name']} | {r['params_total']:,} | {r['params_active']:,} | {r['flops_per_token'] / 1e6:.2f}M "
                     f"| {speed(r)} | {r['peak_vram_gib']:.3f} | {r['loss_first5']:.3f} -> "
                     f"{r['loss_last5']:.3f} | {r['val_loss']:.3f} | {dropped} | {imb} |")
    runs = [run_from_report_row(r) for r in report["rows"]]
    if len(runs) > 1 and all(len(r.step_seconds) >= 2 for r in runs):
        lines += ["", "tokens/s: the median timed step (the middle half of the steps in brackets, validation excluded); "
                  "a difference counts only where the middle halves do not overlap:", ""]
        lines += [f"- {c}" for c in helpers.moe.speed_verdicts(runs)]
    else:
        lines += ["", "tokens/s: the average over the timed steps, validation included; no per-step times recorded, "
                  "so no spread and no faster/slower verdict."]
    lines += ["", "Aux-loss coefficient (top-1):", "",
              "| aux coef | busiest/mean (per step) | dropped | val loss |", "|---:|---:|---:|---:|"]
    for r in report["aux_sweep"]:
        lines.append(f"| {r['aux_loss_coef']:g} | {r['imbalance']:.2f} | {100 * r['dropped_fraction']:.1f} % "
                     f"| {r['val_loss']:.3f} |")
    lines += ["", "Capacity factor on the trained top-1 model (validation data):", "",
              "| capacity factor | routes dropped | val loss |", "|---:|---:|---:|"]
    for r in report["capacity_sweep"]:
        lines.append(f"| {r['capacity_factor']:g} | {100 * r['dropped_fraction']:.1f} % | {r['val_loss']:.3f} |")
    lines += ["", f"ZeRO-3: `{report['zero3_refusal']}`"]
    ep = report.get("expert_parallel")
    if ep and "ranks" in ep:
        lines += ["", f"Expert parallel, ep_size 2 on 2 {ep['device']} processes ({ep['ranks'][0]['backend']}):"]
        for r in ep["ranks"]:
            layer = next(iter(r["experts_held"]))
            lines.append(f"- rank {r['rank']}: experts {r['experts_held'][layer]}, {r['expert_params_local']:,} of "
                         f"{r['expert_params_total']:,} expert parameters; routes kept {r['routes_to_own_experts']:,}, "
                         f"sent to the other rank {r['routes_to_other_ranks']:,}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import deepspeed
    import torch

    runtime = helpers.detect_runtime()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    ds = helpers.load_text_dataset("local", seed=args.seed)
    texts = ds["train"] if not args.texts else ds["train"].select(range(min(args.texts, len(ds["train"]))))
    tok = helpers.train_tokenizer(texts["text"], args.work_dir / f"tokenizer-{args.vocab}-{args.texts}",
                                  vocab_size=args.vocab)
    train_blocks = helpers.pack_blocks(texts, tok, args.seq_len)
    val_blocks = helpers.pack_blocks(ds["validation"], tok, args.seq_len, max_blocks=64)
    shape = GPTConfig(vocab_size=len(tok), seq_len=args.seq_len, hidden=args.hidden, layers=args.layers,
                      heads=args.heads, ffn=args.ffn, num_experts=args.experts, k=1,
                      capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_coef)
    ds_config = helpers.moe.moe_ds_config(runtime, micro_batch=args.micro_batch, lr=args.lr, steps=args.steps)
    report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "precision": runtime.precision,
              "gpu": runtime.gpu_name, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
              "shape": dataclasses.asdict(shape), "moe_layers": list(shape.moe_layers), "steps": args.steps,
              "micro_batch": args.micro_batch, "seq_len": args.seq_len, "lr": args.lr,
              "zero_stage": ds_config["zero_optimization"]["stage"], "rows": [], "aux_sweep": [],
              "capacity_sweep": []}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    def sweep(model):
        return helpers.moe.capacity_sweep(model, val_blocks, args.capacity_sweep, batches=8,
                                      batch_size=args.micro_batch, seed=args.seed)

    def train(name, cfg, eval_every, probe=None):
        """One run: train_run with the MoE hooks, validation every `eval_every` steps and at the end."""
        measure = helpers.train.MeasureSettings(val_blocks=val_blocks, eval_every=eval_every, eval_batches=8,
                                                progress=False, hooks=MoEHooks(cfg, seed=args.seed, probe=probe))
        return helpers.train_run(name, lambda: build_gpt(cfg, seed=args.seed), train_blocks, runtime=runtime,
                                 ds_config=ds_config, steps=args.steps, seed=args.seed, measure=measure)

    configs = {"dense": shape.dense_twin(), "MoE top-1": shape, "MoE top-2": shape.replace(k=2)}
    runs = {}
    for name, cfg in configs.items():
        r = train(name, cfg, max(1, args.steps // 5), probe=sweep if name == "MoE top-1" else None)
        runs[name] = r
        report["rows"].append(row(r))
        if "probe" in r.extras:
            report["capacity_sweep"] = r.extras["probe"]
        print(f"{name:<12} total {r.extras['params_total']:>11,} active {r.extras['params_active']:>11,} "
              f"{r.speed_text()} {r.peak_vram_gib:>7.3f} GiB val {r.val_loss:.3f}", flush=True)
        write()
    for coef in args.aux_sweep:
        r = runs["MoE top-1"] if coef == args.aux_coef else train(
            f"top-1, aux {coef:g}", shape.replace(aux_loss_coef=coef), args.steps)  # validation at the end only
        routing = r.extras["routing"]
        report["aux_sweep"].append({"aux_loss_coef": coef, "imbalance": routing["imbalance"],
                                    "dropped_fraction": routing["dropped_fraction"], "val_loss": r.val_loss,
                                    "aux_last5": round(sum(r.extras["aux_losses"][-5:]) / 5, 4),
                                    "demand": routing["demand"]})
        print(f"aux {coef:<6g} busiest/mean {routing['imbalance']:.2f} dropped "
              f"{100 * routing['dropped_fraction']:.1f} % val {r.val_loss:.3f}", flush=True)
        write()
    report["zero3_refusal"] = helpers.moe.zero3_refusal(configs["MoE top-2"], runtime)
    if args.ep:
        report["expert_parallel"] = expert_parallel(args, runtime, train_blocks, len(tok))
    write()
    args.out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
