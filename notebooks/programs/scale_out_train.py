"""Data parallel + ZeRO stages 0-3 on N ranks: the bytes each rank holds (notebook 05, benchmarks/scale_out.py).

    deepspeed --num_gpus 2 notebooks/programs/scale_out_train.py --out build/scale_out/n2                # 2 GPUs, NCCL
    deepspeed --num_accelerators 2 notebooks/programs/scale_out_train.py --out build/scale_out/n2 --device cpu  # gloo
    torchrun --nproc_per_node 2 notebooks/programs/scale_out_train.py --out build/scale_out/n2           # torchrun

Every rank builds the same model (same seed), trains it on its own share of the data for a few steps, once per
ZeRO stage asked for, and records what it holds: parameters, gradients (the peak during backward, and what is
kept for the optimizer step), optimizer states (Adam's moments and the fp32 master copy). One launch measures
all stages; each rank writes rank<r>.json to --out and prints one line per stage.
"""
from __future__ import annotations

import argparse
import gc
import time

from helpers import rank  # light: DeepSpeed is imported once the device is chosen


def train_stage(stage: int, run: rank.RankSetup, args: argparse.Namespace) -> dict:
    """Train a fresh model under ZeRO `stage` on this rank's data and measure what the rank holds."""
    import deepspeed
    import torch

    from helpers.config import ConfigSettings, build_ds_config
    from helpers.gpt import build_gpt

    model = build_gpt(run.cfg, seed=args.seed)  # the same weights on every rank
    n_params = sum(p.numel() for p in model.parameters())
    bucket = max(1, int(n_params * args.bucket_fraction))
    config = build_ds_config(stage, precision=run.precision, micro_batch_size=args.micro_batch,
                             settings=ConfigSettings(world_size=run.world, lr=args.lr, scheduler=None,
                                                     initial_scale_power=8))
    if stage >= 1:  # gradients are reduced in buckets of this many elements
        config["zero_optimization"]["reduce_bucket_size"] = bucket
    if stage == 3:  # partition every parameter, however small; fetch them in buckets of the same size
        config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                           stage3_prefetch_bucket_size=bucket)
    config["comms_logger"] = {"enabled": True}  # deepspeed.comm counts every collective's calls and bytes
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    deepspeed.comm.comms_logger.comms_dict.clear()  # count the training steps only, not the start
    batches = rank.rank_batches(run.blocks, args.micro_batch, run.rank, run.world, seed=args.seed)
    losses, held = [], {}
    start = time.perf_counter()
    with rank.GradientPeak(engine) as grad_peak:  # samples the gradient bytes all through backward
        for _ in range(args.steps):
            ids = next(batches).to(engine.device)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)  # ZeRO-2/3 reduce-scatter gradient buckets here, as they fill
            held = rank.rank_state_bytes(engine)  # what is kept for the step
            engine.step()  # ZeRO-1/2 update their optimizer partition, then all-gather the parameters
            losses.append(round(loss.item(), 6))
    seconds = time.perf_counter() - start
    sent = {op: sum(size * calls[0] for size, calls in sizes.items())  # {op: {message bytes: [calls, ...]}}
            for op, sizes in deepspeed.comm.comms_logger.comms_dict.items()}
    after = rank.rank_state_bytes(engine)
    row = {"stage": stage, "world": run.world, "rank": run.rank, "device": run.device, "backend": run.backend,
           "precision": run.precision, "n_params": n_params, "bucket_elements": bucket,
           "params": after["params"], "grads_peak": grad_peak.peak, "grads_held": held["grads"],
           "optimizer": after["optimizer"], "optimizer_master": after["optimizer_master"],
           "optimizer_moments": after["optimizer_moments"], "peak_gpu_bytes": rank.peak_gpu_bytes(),
           "losses": losses, "seconds": round(seconds, 2), "config": config,
           "comm_bytes_per_step": {op: b // args.steps for op, b in sorted(sent.items()) if b}}
    row["model_states"] = row["params"] + row["grads_peak"] + row["optimizer"]  # the most held at once
    if not after["optimizer_moments"]:
        row["note"] = "no optimizer state yet: every step was skipped (fp16 overflow); run more --steps"
    engine.destroy()
    del engine, optimizer, model
    gc.collect()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = rank.add_rank_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--bucket-fraction", type=float, default=0.125,
                        help="gradient reduction bucket (and ZeRO-3 prefetch) as a share of the parameters")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    run = rank.setup_rank(args)
    from helpers.runtime import quiet_deepspeed

    rows = []
    for stage in args.stages:
        with quiet_deepspeed():
            rows.append(train_stage(stage, run, args))
        r = rows[-1]
        print(f"rank {run.rank}/{run.world} ({run.device}, {run.backend}) ZeRO-{stage}: params {r['params']:,} B, "
              f"grads peak {r['grads_peak']:,} B, optimizer {r['optimizer']:,} B; loss {r['losses'][0]:.4f} -> "
              f"{r['losses'][-1]:.4f}", flush=True)
    rank.finish_rank(args.out, run.rank, {"rank": run.rank, "world": run.world, "device": run.device,
                                               "backend": run.backend, "shape": run.cfg.__dict__, "stages": rows})
    return 0


if __name__ == "__main__":
    rank.exit_rank(main())
