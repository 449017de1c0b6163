"""Pipeline parallelism: the course GPT cut into 2 stages with deepspeed.pipe.PipelineModule (notebook 05).

    deepspeed --num_gpus 2 notebooks/programs/pipeline_train.py --out build/pipeline                    # 2 GPUs, NCCL
    torchrun --nproc_per_node 2 notebooks/programs/pipeline_train.py --out build/pipeline --device cpu  # CPU, gloo

Rank 0 holds the embeddings and the first half of the blocks, rank 1 the rest, the final norm and the output
layer (tied to the embedding: each of the two stages holds a copy, their gradients are summed). Each batch is
cut into --micro-batches micro-batches that flow through the stages one behind the other (DeepSpeed's 1F1B
schedule). Every rank also trains the same model unsplit, plain PyTorch, on the same micro-batches from the
same seed: the two loss curves must agree. Runs in fp32 so that they can. Each rank writes rank<r>.json.
"""
from __future__ import annotations

import argparse
import copy

from helpers import rank, scale_out


def main(argv: list[str] | None = None) -> int:
    parser = rank.add_rank_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per batch (per optimizer step)")
    parser.set_defaults(precision="fp32")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    run = rank.setup_rank(args)
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from helpers.config import ConfigSettings, build_ds_config
    from helpers.gpt import build_gpt
    from helpers.runtime import quiet_deepspeed

    stages, m = run.world, args.micro_batches
    reference = build_gpt(run.cfg, seed=args.seed)
    batches = rank.rank_batches(run.blocks, args.micro_batch, rank=0, world=1, seed=args.seed)
    data = [[next(batches) for _ in range(m)] for _ in range(args.steps)]  # the same micro-batches for both runs

    # 1. the plain run: the whole model in this process, gradients accumulated over the m micro-batches
    plain = copy.deepcopy(reference).to(run.device)
    opt = torch.optim.AdamW(plain.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    plain_losses = []
    for batch in data:
        total = 0.0
        for ids in batch:
            ids = ids.to(run.device)
            loss = plain(ids, labels=ids).lm_loss / m
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        plain_losses.append(total)
    del plain, opt

    # 2. the pipeline: the same layers and weights as a list, cut into `stages` parts with equal numbers of blocks
    model = PipelineModule(layers=scale_out.pipeline_layers(reference), num_stages=stages, loss_fn=scale_out.lm_loss,
                           partition_method="type:BlockLayer")
    config = build_ds_config(0, precision="fp32", micro_batch_size=args.micro_batch, grad_accum_steps=m,
                             settings=ConfigSettings(world_size=run.world // stages, lr=args.lr, scheduler=None,
                                                     gradient_clipping=0.0))
    with quiet_deepspeed():
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                              if p.requires_grad], config=config)
    pipe_losses = []
    for batch in data:
        micro = iter([(ids.to(engine.device), ids.to(engine.device)) for ids in batch])  # (inputs, labels)
        loss = engine.train_batch(data_iter=micro)  # m forwards and m backwards in the 1F1B order, then one step
        pipe_losses.append(loss.item())
    layers = [spec.typename.__name__ if hasattr(spec, "typename") else type(spec).__name__
              for spec in scale_out.pipeline_layers(reference)]
    start, stop = model.parts[engine.stage_id], model.parts[engine.stage_id + 1]
    held = rank.rank_state_bytes(engine)
    report = {
        "rank": run.rank, "world": run.world, "device": run.device, "backend": run.backend, "stages": stages,
        "stage_id": engine.stage_id, "micro_batches": m, "micro_batch": args.micro_batch,
        "layers_held": list(range(start, stop)), "layer_names": layers[start:stop], "all_layers": layers,
        "params_local": sum(p.numel() for p in model.parameters()),
        "params_total": sum(p.numel() for p in reference.parameters()),
        **{k: held[k] for k in scale_out.STATE_PARTS}, "peak_gpu_bytes": rank.peak_gpu_bytes(),
        "pipeline_losses": pipe_losses, "plain_losses": plain_losses,
        "max_loss_gap": max(abs(a - b) for a, b in zip(pipe_losses, plain_losses)),
    }
    print(f"rank {run.rank} = pipeline stage {engine.stage_id} ({run.device}, {run.backend}): layers "
          f"{start}-{stop - 1} {layers[start:stop]}, {report['params_local']:,} of {report['params_total']:,} "
          "parameters; loss "
          f"{pipe_losses[0]:.6f} -> {pipe_losses[-1]:.6f} (plain {plain_losses[0]:.6f} -> {plain_losses[-1]:.6f})",
          flush=True)
    engine.destroy()
    rank.finish_rank(args.out, run.rank, report)
    return 0


if __name__ == "__main__":
    rank.exit_rank(main())
