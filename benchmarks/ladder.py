"""Benchmark: the largest GPT-2-family model that trains on a T4 budget, per config (notebook 02).

    DS_COURSE_T4_BUDGET=1 python benchmarks/ladder.py --nvme-path /tmp/nvme
    python benchmarks/ladder.py --sizes gpt2-tiny --configs plain zero2_offload_cpu --steps 3 --seq-len 32  # CPU smoke

For plain PyTorch AMP and each DeepSpeed config, climb the size ladder (models built from their configs, ZeRO-3
ones partitioned under HfDeepSpeedConfig) and train a few steps. A rung *fits* when it ran, the loss fell, and it
stayed within the budgets: VRAM (the T4 cap makes PyTorch raise out-of-memory), peak process RSS <= 12.7 GB and
NVMe folder <= 60 GB. A config stops climbing at its first rung that does not fit.
Writes reports/ladder.json (model, params, config, fits, peak_vram_gib, peak_rss_gib, disk_gib, tokens_per_s,
runtime; failures with their reason) and reports/ladder.md; target: DeepSpeed's best >= 4x plain's parameters.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import helpers  # noqa: E402
from helpers.config import build_ds_config  # noqa: E402
from helpers.hardware import COLAB_RAM_GB  # noqa: E402
from helpers.models import GPT2_LADDER  # noqa: E402

GB = 1e9
DISK_BUDGET_GB = 60.0
CONFIGS = ("plain", "zero2_offload_cpu", "zero3_offload_cpu", "zero3_nvme_optimizer", "zero3_nvme_all")


def ladder_config(name: str, runtime, nvme_path: str | None, largest_param: int) -> dict | None:
    """The DeepSpeed config of a ladder column (None: plain PyTorch)."""
    if name == "plain":
        return None
    if name == "zero2_offload_cpu":
        return build_ds_config(2, runtime=runtime, offload_optimizer="cpu")
    if name == "zero3_offload_cpu":
        return build_ds_config(3, runtime=runtime, offload_optimizer="cpu", offload_param="cpu")
    if name == "zero3_nvme_optimizer":
        return build_ds_config(3, runtime=runtime, offload_optimizer="nvme", offload_param="cpu", nvme_path=nvme_path)
    if name == "zero3_nvme_all":
        # every parameter in flight takes a whole swap buffer: the buffer must hold the largest one
        size = max(100_000_000, int(largest_param * 1.05))
        return build_ds_config(3, runtime=runtime, offload_optimizer="nvme", offload_param="nvme",
                               nvme_path=nvme_path, nvme_buffer_count=16, nvme_buffer_size=size)
    raise ValueError(f"unknown ladder config {name!r}; choose from {CONFIGS}")


def factory(size: str, cfg: dict | None, vocab: int):
    config = helpers.gpt2_config(size, vocab_size=vocab)
    if cfg is not None and cfg["zero_optimization"]["stage"] == 3:
        return lambda: helpers.build_zero3_model(cfg, config=config, seed=0)

    def build():
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)

    return build


def verdict(r, ram_budget_gb: float) -> tuple[bool, str]:
    if r.error:
        return False, r.error
    if len(r.losses) < 2 or not r.losses[-1] < r.losses[0]:
        return False, f"loss did not fall ({r.losses[0]:.3f} -> {r.losses[-1]:.3f})"
    if r.peak_rss_gib * 2**30 / GB > ram_budget_gb:
        return False, f"peak RSS {r.peak_rss_gib * 2**30 / GB:.1f} GB > {ram_budget_gb} GB RAM budget"
    if r.disk_gib * 2**30 / GB > DISK_BUDGET_GB:
        return False, f"NVMe folder {r.disk_gib * 2**30 / GB:.1f} GB > {DISK_BUDGET_GB} GB disk budget"
    return True, ""


def summary(rows: list[dict]) -> dict:
    best = {}
    for r in rows:
        if r["fits"] and r["params"] > best.get(r["config"], {}).get("params", 0):
            best[r["config"]] = {"model": r["model"], "params": r["params"]}
    plain = best.get("plain", {}).get("params", 0)
    ds_best = max((v["params"] for k, v in best.items() if k != "plain"), default=0)
    return {"largest_per_config": best, "deepspeed_over_plain": round(ds_best / plain, 2) if plain else None,
            "target_4x_met": bool(plain and ds_best >= 4 * plain)}


def markdown(report: dict) -> str:
    lines = [f"# Largest model per config ({report['runtime']}, {report['date']})", "",
             f"micro-batch {report['settings']['micro_batch']} x {report['settings']['seq_len']} tokens, "
             f"{report['settings']['steps']} steps; budgets: VRAM {report['budgets']['vram_gib']} GiB, "
             f"RAM {report['budgets']['ram_gb']} GB, disk {report['budgets']['disk_gb']} GB.", "",
             "| model | params | config | fits | peak VRAM GiB | peak RSS GiB | disk GiB | tokens/s | reason |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['model']} | {r['params'] / 1e6:,.0f}M | {r['config']} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['peak_vram_gib']:.2f} | {r['peak_rss_gib']:.2f} | {r['disk_gib']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['reason']} |")
    s = report["summary"]
    lines += ["", f"DeepSpeed's largest / plain PyTorch's largest: {s['deepspeed_over_plain']} "
              f"(target >= 4: {'met' if s['target_4x_met'] else 'NOT met'})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=[s for s in GPT2_LADDER if s != "gpt2-tiny"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--steps", type=int, default=8)  # fp16 skips its first steps while the loss scale settles
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--nvme-path", default="/tmp/ds-course-nvme")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "ladder.json")
    p.add_argument("--work-dir", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args(argv)

    runtime = helpers.detect_runtime()
    ram_budget_gb = COLAB_RAM_GB if (runtime.t4_budget or runtime.is_colab) else runtime.ram_budget_bytes / GB
    ds = helpers.load_text_dataset("local")
    tok = helpers.train_tokenizer(ds["train"]["text"], args.work_dir / "tokenizer")
    blocks = helpers.pack_blocks(ds["train"], tok, args.seq_len, max_blocks=256)
    rows: list[dict] = []
    for name in args.configs:
        for size in args.sizes:
            shape = helpers.model_shape(helpers.gpt2_config(size))
            nvme = None
            if "nvme" in name:
                nvme = Path(args.nvme_path) / f"{name}-{size}"
                shutil.rmtree(nvme, ignore_errors=True)
                nvme.mkdir(parents=True)
            try:
                cfg = ladder_config(name, runtime, str(nvme) if nvme else None, shape.largest_layer_params)
            except helpers.ConfigError as exc:
                rows.append({"model": size, "params": shape.n_params, "config": name, "fits": False,
                             "peak_vram_gib": 0.0, "peak_rss_gib": 0.0, "disk_gib": 0.0, "tokens_per_s": 0.0,
                             "runtime": runtime.label, "reason": f"config refused: {exc}"})
                break
            r = helpers.train_run(f"{name} {size}", factory(size, cfg, shape.vocab), blocks, runtime=runtime,
                                  ds_config=cfg, steps=args.steps, micro_batch=args.micro_batch, lr=1e-4,
                                  checkpointing=True, warmup_steps=1, model_name=size, nvme_path=nvme,
                                  progress=False)
            if nvme:
                shutil.rmtree(nvme, ignore_errors=True)
            fits, reason = verdict(r, ram_budget_gb)
            rows.append({"model": size, "params": shape.n_params, "config": name, "fits": fits,
                         "peak_vram_gib": r.peak_vram_gib, "peak_rss_gib": r.peak_rss_gib, "disk_gib": r.disk_gib,
                         "tokens_per_s": r.tokens_per_s, "runtime": runtime.label, "reason": reason,
                         "losses": r.losses})
            print(f"{name:<22}{size:<12}{'fits' if fits else 'does not fit':<14}{r.peak_vram_gib:>7.2f} GiB "
                  f"{r.peak_rss_gib:>7.2f} GiB RSS {r.disk_gib:>7.2f} GiB disk {r.tokens_per_s:>9,.0f} tok/s {reason}",
                  flush=True)
            report = {"runtime": runtime.label, "date": dt.date.today().isoformat(), "precision": runtime.precision,
                      "settings": {"micro_batch": args.micro_batch, "seq_len": args.seq_len, "steps": args.steps},
                      "budgets": {"vram_gib": round(runtime.vram_budget_bytes / 2**30, 1), "ram_gb": round(ram_budget_gb, 1),
                                  "disk_gb": DISK_BUDGET_GB},
                      "rows": rows, "summary": summary(rows)}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            args.out.with_suffix(".md").write_text(markdown(report))
            if not fits:
                break
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
