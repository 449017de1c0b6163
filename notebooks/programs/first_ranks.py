"""One DeepSpeed training program, started N times by a launcher (notebook 05, section 1).

    deepspeed --num_gpus 2 notebooks/programs/first_ranks.py --out build/first --device cuda
    torchrun --nproc_per_node 2 notebooks/programs/first_ranks.py --out build/first --device cpu   # CPU-only: gloo

Notebook 00's loop (a literal config dict, deepspeed.initialize, engine.backward, engine.step) plus
deepspeed.init_distributed(); each rank writes what it holds to rank<r>.json.
"""
import argparse, json, os
from pathlib import Path

import deepspeed
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--device", default="cpu")
parser.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher passes it (torchrun does not)
args = parser.parse_args()
torch.set_num_threads(1)
# joins the other ranks through the variables the launcher set: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

torch.manual_seed(0)  # every rank builds the same model ...
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
config = {
    "train_micro_batch_size_per_gpu": 4,  # per rank; the global batch is 4 x WORLD_SIZE
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # split every parameter
}
engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
torch.manual_seed(1 + rank)  # ... and sees its own data
losses = []
for step in range(5):
    x = torch.randn(4, 256, device=engine.device)
    loss = (engine(x) - x).pow(2).mean()  # learn the identity
    engine.backward(loss)  # gradients are averaged over the ranks (and, at stage 3, partitioned)
    engine.step()
    losses.append(loss.item())
held = sum(p.ds_tensor.numel() for p in engine.module.parameters())  # this rank's share of every parameter
total = sum(p.ds_numel for p in engine.module.parameters())
args.out.mkdir(parents=True, exist_ok=True)
(args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "held": held, "total": total,
    "global_batch": engine.train_batch_size(), "losses": losses}))
torch.distributed.barrier()  # wait for every rank, then leave the group (a rank that just exits can crash its peers)
torch.distributed.destroy_process_group()
