"""Code that runs inside a launched rank: the lesson programs of notebook 05 (notebooks/programs/scale_out_train.py,
pipeline_train.py, tp_train.py) import it.

A rank picks its device before DeepSpeed is imported (`choose_device`: one GPU each over NCCL where the machine has
a GPU per rank, otherwise CPU processes over gloo), joins the group (`init_rank`, `setup_rank`), draws its share of
the data (`rank_batches`) and writes rank<r>.json (`finish_rank`), which `helpers.launch.run_ranks` reads.

What a rank holds is read off the engine, not estimated (`rank_state_bytes`): the unique storages behind the
module's parameters (under ZeRO-3 the partition `param.ds_tensor`), behind the gradients (``param.grad``, and the
optimizer's gradient buffers: reduction buckets, gradient partitions) and behind the optimizer (Adam's moments, and
the fp32 master copy where it is a tensor of its own). Gradients are sampled in hooks all through backward
(`GradientPeak`), because their peak is what differs between ZeRO-1 (every rank holds all the gradients until
backward ends, then reduces them and keeps its partition) and ZeRO-2 (each bucket is reduce-scattered as soon as it
fills).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NoReturn

from helpers.atomic import write_atomically
from helpers.scale_out import SCALE_OUT_SHAPES, corpus_blocks, gpt_config

if TYPE_CHECKING:
    from helpers.gpt import GPTConfig

__all__ = ["finish_rank", "exit_rank"]


def choose_device(requested: str = "auto", world: int | None = None) -> str:
    """'cuda' when each of the `world` ranks can have a GPU of its own, else 'cpu'; call before importing deepspeed.

    On CPU it hides the GPUs and makes DeepSpeed pick its CPU accelerator (gloo), so a 1-GPU machine can still
    run 2 or 4 ranks.
    """
    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # count GPUs without initialising CUDA
    import torch

    device = requested
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return device


def init_rank(device: str) -> tuple[int, int]:
    """Join the process group the launcher described (NCCL on GPUs, gloo on CPU); returns (rank, world size)."""
    import torch

    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        # ranks share the cores: one thread each, or OpenMP threads spin waiting on each other
        torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def write_rank_report(out: Path, rank: int, report: dict[str, Any]) -> Path:
    """Write `report` to out/rank<r>.json (what `helpers.launch.run_ranks` reads back)."""
    text = json.dumps(report, indent=2) + "\n"
    return write_atomically(Path(out) / f"rank{rank}.json", lambda tmp: tmp.write_text(text))


def finish_rank(out: Path, rank: int, report: dict[str, Any]) -> None:
    """Write rank<r>.json, wait for every rank, leave the process group (notebook 03)."""
    import torch.distributed as dist

    write_rank_report(out, rank, report)
    dist.barrier()
    dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a launched rank with `code` without Python's interpreter shutdown: flush stdout and stderr, then
    `os._exit` (the programs' last line: ``rank.exit_rank(main())``) (notebook 03).

    After its report is written and the group destroyed, a rank has nothing left to do, but at shutdown torch's gloo
    worker threads can still hold work objects whose release needs the interpreter being torn down: the process
    then aborts ("terminate called without an active exception", SIGABRT) and the launcher reports the whole run
    failed (seen once in CI, tests/test_moe.py, after barrier + destroy_process_group; pytorch/pytorch#179291
    describes the mechanism). Leaving with os._exit skips that teardown; the operating system frees the rest."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or redirected to a dead pipe
            pass
    os._exit(code)


def load_blocks(path: str | Path | None, seq_len: int, vocab: int, work: Path, rank: int) -> Any:
    """Token blocks (a LongTensor [blocks, seq_len]) from `path` (torch.save), or the local corpus tokenized here.

    Without `path`, rank 0 tokenizes the corpus into `work` (`corpus_blocks`), the others wait, then load it.
    """
    import torch
    import torch.distributed as dist

    if path is None:
        if rank == 0:
            corpus_blocks(work, vocab, seq_len)
        dist.barrier()
        path = corpus_blocks(work, vocab, seq_len)
    return torch.load(path)


def add_rank_args(parser: Any) -> Any:
    """The arguments every scale-out program takes (output folder, device, model shape, data, seed)."""
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: one GPU per rank over NCCL where there are enough, else CPU ranks over gloo")
    parser.add_argument("--shape", choices=("auto", *SCALE_OUT_SHAPES), default="auto",
                        help="model shape (SCALE_OUT_SHAPES); auto: 'gpu' on GPUs, 'cpu' on CPU ranks")
    parser.add_argument("--blocks", type=Path, default=None,
                        help="token blocks saved with torch.save (default: the local corpus, tokenized here)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary of --blocks (default: the shape's)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                        help="auto: fp32 on CPU, bf16 on Ampere or newer, fp16 before")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser


@dataclass
class RankSetup:
    """What a scale-out program knows once its rank has joined the group."""

    device: str
    rank: int
    world: int
    precision: str
    cfg: "GPTConfig"
    blocks: Any
    backend: str


def setup_rank(args: Any) -> RankSetup:
    """Device (before DeepSpeed is imported), process group, precision, model shape and token blocks."""
    device = choose_device(args.device)
    rank, world = init_rank(device)
    import torch
    import torch.distributed as dist

    from helpers.hardware import choose_precision

    precision = args.precision
    if precision == "auto":
        precision = choose_precision(torch.cuda.get_device_capability() if device == "cuda" else None)
    shape = dict(SCALE_OUT_SHAPES[args.shape if args.shape != "auto" else ("gpu" if device == "cuda" else "cpu")])
    if args.vocab:
        shape["vocab"] = args.vocab
    blocks = load_blocks(args.blocks, shape["seq_len"], shape["vocab"], args.out.parent / "data", rank)
    shape["seq_len"] = int(blocks.shape[1])
    shape["vocab"] = max(shape["vocab"], int(blocks.max()) + 1)
    return RankSetup(device, rank, world, precision, gpt_config(**shape), blocks, dist.get_backend())


def rank_batches(blocks: Any, micro_batch: int, rank: int, world: int, seed: int = 0) -> Iterator[Any]:
    """Micro-batches for one data-parallel rank: rank r takes every world-th block of a seeded shuffle, forever."""
    import torch

    epoch = 0
    while True:
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world]
        for i in range(0, len(mine) - micro_batch + 1, micro_batch):
            yield blocks[mine[i:i + micro_batch]]
        epoch += 1


# ---------------------------------------------------------------- what a rank holds


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """{storage address: bytes} of the tensors' storages; views of one buffer count once."""
    import torch

    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr():
                out[s.data_ptr()] = s.nbytes()
    return out


def _tensors_in(obj: Any, depth: int = 0, seen: set[int] | None = None) -> Iterator[Any]:
    """Tensors in `obj`: lists, tuples, dicts and dataclasses (DeepSpeed's gradient buckets), 3 levels deep."""
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x, depth + 1, seen)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x, depth + 1, seen)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors_in(getattr(obj, name), depth + 1, seen)


def rank_state_bytes(engine: Any, extra_grad: Any = None) -> dict[str, int]:
    """Bytes this rank holds now: params, grads, optimizer (= Adam's moments + the fp32 master copy, also shown apart).

    Parameters: the module's tensors (the ZeRO-3 partition `ds_tensor`, not the gathered view). Gradients:
    `param.grad`, the optimizer's attributes named *grad* / *ipg* (buckets, partitions) and the inner optimizer's
    fp32 gradients. Optimizer: the inner torch optimizer's state and the tensors it steps on where they are not the
    module's (the fp32 master partition). `extra_grad`: a gradient about to be stored (sampled in a hook).
    """
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    held = _storages(params)
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    grads = _storages([p.grad for p in engine.module.parameters()] + [extra_grad])
    if zero is not inner:
        for name, value in vars(zero).items():
            if "grad" in name.lower() or "ipg" in name.lower():
                grads.update(_storages(_tensors_in(value)))
    # what the torch optimizer steps on: its groups' parameters and the keys of its state (ZeRO-3 empties the groups
    # between steps; the state stays keyed by its fp32 partitions)
    inner_params = [p for g in inner.param_groups for p in g["params"]] + list(inner.state)
    grads.update(_storages(p.grad for p in inner_params))
    master = {k: v for k, v in _storages(inner_params).items() if k not in held}
    moments = _storages(t for s in inner.state.values() for t in s.values())
    grads = {k: v for k, v in grads.items() if k not in held and k not in master}
    return {"params": sum(held.values()), "grads": sum(grads.values()),
            "optimizer": sum(moments.values()) + sum(master.values()),
            "optimizer_master": sum(master.values()), "optimizer_moments": sum(moments.values())}


class GradientPeak:
    """Samples a rank's gradient bytes in hooks through backward (`with GradientPeak(engine) as gp: ...; gp.peak`).

    A hook on each parameter fires when its gradient arrives (counted with what is already held) and, after
    DeepSpeed's own hook has reduced or copied it, once more. The peak is the most seen at once.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.peak = 0
        self._handles: list[Any] = []

    def _sample(self, extra: Any = None) -> None:
        self.peak = max(self.peak, rank_state_bytes(self.engine, extra_grad=extra)["grads"])

    def __enter__(self) -> "GradientPeak":
        for p in self.engine.module.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(lambda g: self._sample(g)))
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _p: self._sample()))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sample()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def peak_gpu_bytes() -> int:
    """Peak CUDA bytes allocated by this process since the last reset (0 on CPU)."""
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0
