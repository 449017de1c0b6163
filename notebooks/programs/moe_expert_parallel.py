"""Expert parallelism with DeepSpeed MoE on 2 processes: each rank holds only its experts (notebook 03).

    python -m torch.distributed.run --nproc_per_node 2 --master_port 29511 \
        notebooks/programs/moe_expert_parallel.py --out build/ep

(`torchrun` is the same launcher; `deepspeed --num_accelerators 2 notebooks/programs/moe_expert_parallel.py` works
too.)
With ep_size = world size, the experts of every MoE layer are split across the ranks: rank r holds experts
r * E/ep ... (r + 1) * E/ep - 1, and an all-to-all sends each token to the rank holding its expert and back.
The shared weights (embeddings, attention, dense MLPs, gates) are replicated and trained data-parallel.
Runs on GPUs (NCCL) when there is one per process, otherwise on CPU processes over gloo (--device cpu forces
it). Each rank writes rank<r>.json to --out and prints one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from helpers.rank import exit_rank, finish_rank


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--blocks", type=Path, default=None,
                   help="token blocks saved with Dataset.save_to_disk (default: the local corpus, tokenized here)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size of --blocks (default: largest id + 1)")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--ffn", type=int, default=0, help="dense MLP width (default 4 x hidden); experts get ffn // k")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world < 2:
        print("Launch this with 2 (or more) processes: python -m torch.distributed.run --nproc_per_node 2 "
              f"{Path(__file__).name} --out DIR", file=sys.stderr)
        return 2
    # count GPUs through NVML, without initialising CUDA: CUDA_VISIBLE_DEVICES can still hide them below
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    if device == "cpu":  # before DeepSpeed picks its accelerator
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import deepspeed
    import torch.distributed as dist

    from helpers import gpt, moe
    from helpers.data import as_tensors, block_loader, load_text_dataset, pack_blocks, train_tokenizer
    from helpers.hardware import apply_t4_budget, choose_precision, detect_runtime, t4_budget_requested
    from helpers.runtime import quiet_deepspeed

    if device == "cuda":
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    # detect_runtime's T4 budget mode caps GPU 0; here each rank caps its own GPU
    runtime = detect_runtime(t4_budget=False)
    if device == "cuda" and t4_budget_requested():
        runtime = dataclasses.replace(runtime, t4_budget=True, vram_budget_bytes=apply_t4_budget(local_rank),
                                      precision=choose_precision(runtime.compute_capability, t4_budget=True))
    if args.blocks is not None:
        from datasets import load_from_disk

        blocks = load_from_disk(str(args.blocks)).with_transform(as_tensors)  # Colab's datasets: see as_tensors
        vocab = args.vocab or int(blocks[:]["input_ids"].max()) + 1
    else:
        ds = load_text_dataset("local")
        texts = ds["train"].select(range(2000))
        if rank != 0:
            dist.barrier()  # rank 0 trains and saves the tokenizer, the others load it
        tok = train_tokenizer(texts["text"], args.out / "tokenizer", vocab_size=2048)
        if rank == 0:
            dist.barrier()
        blocks = pack_blocks(texts, tok, args.seq_len)
        vocab = len(tok)
    seq_len = int(blocks[0]["input_ids"].shape[-1])
    cfg = gpt.GPTConfig(vocab_size=vocab, seq_len=seq_len, hidden=args.hidden, layers=args.layers,
                        heads=args.heads, ffn=args.ffn or 4 * args.hidden, num_experts=args.experts, k=args.k, ep_size=world)
    with quiet_deepspeed():
        model = gpt.build_gpt(cfg, seed=args.seed)
        # the same model unsplit (ep_size 1, every expert in one process): global expert e must match
        whole = gpt.build_gpt(cfg.replace(ep_size=1), seed=args.seed)
    held = moe.expert_parallel_summary(model)
    same_as_unsplit = all(
        torch.equal(p, q)
        for layer, ids in held["experts_held"].items()
        for local, e in enumerate(ids)
        for p, q in zip(model.get_submodule(layer).deepspeed_moe.experts.deepspeed_experts[local].parameters(),
                        whole.get_submodule(layer).deepspeed_moe.experts.deepspeed_experts[e].parameters()))
    del whole
    recorder = moe.RoutingRecorder(model)
    ds_config = moe.moe_ds_config(runtime, micro_batch=args.micro_batch, lr=args.lr, steps=args.steps,
                                   world_size=world)
    with quiet_deepspeed():
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=moe.moe_param_groups(model),
                                               config=ds_config)
    batches = block_loader(blocks, args.micro_batch, seed=args.seed + 1000 * rank)  # each rank its own data
    losses = []
    for _ in range(args.steps):
        ids = next(batches)["input_ids"].to(engine.device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        recorder.end_step()
        losses.append(round(out.lm_loss.item(), 4))
    summary = recorder.summary()
    first_layer = next(iter(held["experts_held"]))
    mine = set(held["experts_held"][first_layer])
    kept = summary.load[0]
    # shared weights must be equal on every rank (data parallel), experts differ (each rank its own)
    shared = [p for n, p in engine.module.named_parameters() if "deepspeed_experts" not in n]
    experts = [p for n, p in engine.module.named_parameters() if "deepspeed_experts" in n]
    sums = torch.tensor([float(sum(p.detach().float().sum() for p in shared)),
                         float(sum(p.detach().float().sum() for p in experts))], dtype=torch.float64,
                        device=engine.device)
    gathered = [torch.zeros_like(sums) for _ in range(world)]  # NCCL gathers into device tensors
    dist.all_gather(gathered, sums)
    gathered = [g.cpu() for g in gathered]
    report = {
        "rank": rank, "world_size": world, "ep_size": cfg.ep_size, "device": device,
        "backend": dist.get_backend(), "num_experts": cfg.num_experts, "k": cfg.k,
        **held,
        "same_weights_as_unsplit_model": same_as_unsplit,
        "routes_to_own_experts": sum(kept[e] for e in mine),
        "routes_to_other_ranks": sum(c for e, c in enumerate(kept) if e not in mine),
        "dropped_routes": summary.dropped_routes[0],
        "losses": losses,
        "shared_weights_equal_on_all_ranks": all(torch.allclose(g[0], gathered[0][0], rtol=0, atol=1e-6)
                                                 for g in gathered),
        "expert_weights_differ_between_ranks": len({round(float(g[1]), 6) for g in gathered}) == world,
        "peak_gpu_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 4) if device == "cuda" else None,
        "runtime": runtime.label,
    }
    print(f"rank {rank}/{world} ({device}, {report['backend']}): experts {held['experts_held'][first_layer]} of "
          f"{cfg.num_experts} per MoE layer, {held['expert_params_local']:,} of {held['expert_params_total']:,} "
          f"expert parameters, {held['params_local']:,} parameters in all; loss {losses[0]:.3f} -> {losses[-1]:.3f}",
          flush=True)
    engine.destroy()
    finish_rank(args.out, rank, report)  # rank<r>.json, then wait for every rank and leave the group
    return 0


if __name__ == "__main__":
    exit_rank(main())
