"""Tensor parallelism with DeepSpeed AutoTP: each linear layer split over the ranks (notebook 05).

    deepspeed --num_gpus 2 notebooks/programs/tp_train.py --out build/tp                      # 2 GPUs, NCCL
    torchrun --nproc_per_node 2 notebooks/programs/tp_train.py --out build/tp --device cpu    # CPU, gloo
    ... --tp-config tp.json    # the tensor_parallel section from a file, as notebook 05 writes it

AutoTP training is switched on by the config alone: ``"tensor_parallel": {"autotp_size": N, ...}`` (no
``train_batch_size``: DeepSpeed derives it, the ranks of one tensor-parallel group form one data-parallel replica).
The attention's q/k/v and the MLP's up projection are split by output features (column-parallel), the attention
output and the MLP's down projection by input features (row-parallel, outputs summed over the ranks). All ranks
of a group see the same micro-batches. The section is ``scale_out.autotp_config(N)`` unless ``--tp-config FILE``
gives a JSON file holding ``{"tensor_parallel": {...}}`` (notebook 05 writes its literal section there). Every rank
also trains the unsplit model, plain PyTorch, on them.
If this DeepSpeed cannot train with AutoTP here, the script falls back to AutoTP inference
(`deepspeed.init_inference(tensor_parallel=...)`) and records why. Each rank writes rank<r>.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import traceback
from pathlib import Path

from helpers import rank, scale_out


def tensor_parallel_section(tp_config: Path | None, world: int) -> dict:
    """The config's `tensor_parallel` section: read from the JSON file `tp_config` ({"tensor_parallel": {...}}), or
    scale_out.autotp_config(world) without one; refused when its autotp_size is not the number of ranks."""
    if tp_config is None:
        return scale_out.autotp_config(world)
    section = json.loads(Path(tp_config).read_text())["tensor_parallel"]
    if section.get("autotp_size") != world:
        raise ValueError(f"{tp_config}: autotp_size {section.get('autotp_size')} but {world} ranks were started: "
                         f"start {section.get('autotp_size')} ranks, or write autotp_size {world}")
    return section


def main(argv: list[str] | None = None) -> int:
    parser = rank.add_rank_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--mode", choices=("auto", "inference"), default="auto",
                        help="auto: AutoTP training, inference where training fails; inference: skip training")
    parser.add_argument("--tp-config", type=Path, default=None, metavar="FILE",
                        help='JSON file with the config\'s {"tensor_parallel": {...}} (default: the course GPT\'s '
                             "section from helpers.scale_out.autotp_config)")
    parser.set_defaults(precision="fp32")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    run = rank.setup_rank(args)
    import deepspeed
    import torch

    from helpers.config import ConfigSettings, build_ds_config
    from helpers.gpt import build_gpt
    from helpers.runtime import quiet_deepspeed

    reference = build_gpt(run.cfg, seed=args.seed)
    full_shapes = {n: list(p.shape) for n, p in reference.named_parameters()}
    batches = rank.rank_batches(run.blocks, args.micro_batch, rank=0, world=1, seed=args.seed)
    data = [next(batches) for _ in range(args.steps)]  # the same micro-batches on every rank of the group

    plain = copy.deepcopy(reference).to(run.device)
    opt = torch.optim.AdamW(plain.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    plain_losses = []
    for ids in data:
        ids = ids.to(run.device)
        loss = plain(ids, labels=ids).lm_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        plain_losses.append(loss.item())
    del plain, opt

    config = build_ds_config(0, precision=run.precision, micro_batch_size=args.micro_batch,
                             settings=ConfigSettings(lr=args.lr, scheduler=None, gradient_clipping=0.0))
    # no train_batch_size (build_ds_config writes none without world_size): DeepSpeed derives it for the ranks of one
    # tensor-parallel group, which form one data-parallel replica; written for the world, its batch check would fail
    assert "train_batch_size" not in config
    config["tensor_parallel"] = tensor_parallel_section(args.tp_config, run.world)
    model = copy.deepcopy(reference)
    report = {"rank": run.rank, "world": run.world, "device": run.device, "backend": run.backend,
              "tensor_parallel": config["tensor_parallel"], "plain_losses": plain_losses,
              "params_total": sum(p.numel() for p in reference.parameters())}
    engine, tp_losses = None, []
    if args.mode == "auto":
        try:
            with quiet_deepspeed():
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            for ids in data:
                ids = ids.to(engine.device)
                loss = engine(ids, labels=ids).lm_loss
                engine.backward(loss)
                engine.step()
                tp_losses.append(loss.item())
            report["mode"] = "training"
        except Exception as exc:  # an older DeepSpeed, or a runtime AutoTP training does not support
            report["training_error"] = f"{type(exc).__name__}: {exc}"[:600]
            report["training_traceback"] = traceback.format_exc()[-2000:]
            engine, model = None, copy.deepcopy(reference)
    if engine is None:
        from deepspeed.comm import comm as ds_comm

        from helpers.gpt import Block

        if run.device == "cpu":  # DeepSpeed 0.19.8's shared-memory inference all-reduce segfaulted on CPU ranks here:
            ds_comm.cdb.shm_vector_kernel_level = 0  # use the process group's all_reduce (gloo) instead

        # the course GPT is no Hugging Face model: name its block and the layers whose outputs are summed
        engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": run.world},
                                          dtype=torch.float32 if run.precision == "fp32" else torch.float16,
                                          injection_policy={Block: ("attn.out", "mlp.down")})
        with torch.no_grad():
            tp_losses = [engine(ids.to(run.device), labels=ids.to(run.device)).lm_loss.item() for ids in data]
        report["mode"] = "inference"
    module = engine.module
    local = {n: list(p.shape) for n, p in module.named_parameters()}
    report.update(
        # inference does not train: only its first loss (the untrained model's) compares with the plain run's
        tp_losses=tp_losses, max_loss_gap=max(abs(a - b) for a, b in zip(
            tp_losses if report["mode"] == "training" else tp_losses[:1], plain_losses)),
        params_local=sum(p.numel() for p in module.parameters()),
        split={n: {"local": local[n], "full": full_shapes[n]} for n in local if local[n] != full_shapes[n]},
        layer_types=sorted({f"{type(m).__name__}" for m in module.modules() if hasattr(m, "weight")}),
        peak_gpu_bytes=rank.peak_gpu_bytes())
    if report["mode"] == "training":
        report.update({k: v for k, v in rank.rank_state_bytes(engine).items() if k in scale_out.STATE_PARTS})
    print(f"rank {run.rank}/{run.world} ({run.device}, {run.backend}) AutoTP {report['mode']}: "
          f"{report['params_local']:,} of {report['params_total']:,} parameters, {len(report['split'])} tensors split; "
          f"loss {tp_losses[0]:.6f} -> {tp_losses[-1]:.6f} (plain {plain_losses[0]:.6f} -> {plain_losses[-1]:.6f})",
          flush=True)
    if report["mode"] == "training":  # an InferenceEngine's destroy() fails without DeepSpeed's kernels
        engine.destroy()
    rank.finish_rank(args.out, run.rank, report)
    return 0


if __name__ == "__main__":
    rank.exit_rank(main())
