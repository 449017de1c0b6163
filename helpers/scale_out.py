"""Scaling out (notebook 05): N ranks under a launcher, and what each rank holds under data, pipeline and tensor
parallelism.

The scripts `scripts/scale_out_train.py` (data parallel + ZeRO 0-3), `scripts/pipeline_train.py` (2-stage
`PipelineModule`) and `scripts/tp_train.py` (AutoTP) run one process per rank: one GPU each over NCCL where the
machine has a GPU per rank, otherwise CPU processes over gloo (CI, and a Colab runtime with one GPU). Each rank
writes rank<r>.json; this module starts them, reads what they wrote, and counts bytes.

What a rank holds is read off the engine, not estimated: the unique storages behind the module's parameters
(under ZeRO-3 the partition `param.ds_tensor`), behind the gradients (``param.grad``, and the optimizer's
gradient buffers: reduction buckets, gradient partitions) and behind the optimizer (Adam's moments, and the fp32
master copy where it is a tensor of its own). Gradients are sampled in hooks all through backward, because their
peak is what differs between ZeRO-1 (every rank holds all the gradients until backward ends, then reduces them and
keeps its partition) and ZeRO-2 (each bucket is reduce-scattered as soon as it fills).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from helpers.atomic import write_atomically
from helpers.memory import model_states_per_gpu
from helpers.moe import MoEConfig
from helpers.runtime import DIST_ENV_VARS, free_port

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
STATE_PARTS = ("params", "grads", "optimizer")

# Model shapes of the scripts' course GPT (helpers.moe's dense model): tiny on CPU ranks, GPT-2-small-like on GPUs.
SCALE_OUT_SHAPES: dict[str, dict[str, int]] = {
    "cpu": dict(vocab=512, seq_len=32, hidden=128, layers=4, heads=4, ffn=512),
    "gpu": dict(vocab=8192, seq_len=256, hidden=768, layers=12, heads=12, ffn=3072),
}


def gpt_config(vocab: int, seq_len: int, hidden: int, layers: int, heads: int, ffn: int) -> MoEConfig:
    """The dense course GPT (notebook 03's `dense_twin`) of this shape; dropout off so runs can be compared."""
    return MoEConfig(vocab_size=vocab, seq_len=seq_len, hidden=hidden, layers=layers, heads=heads, ffn=ffn,
                     num_experts=0, dropout=0.0).check()


# ---------------------------------------------------------------- inside a rank


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


def finish_rank(out: Path, rank: int, report: dict[str, Any]) -> None:
    """Write rank<r>.json, wait for every rank, leave the process group."""
    import torch.distributed as dist

    text = json.dumps(report, indent=2) + "\n"
    write_atomically(out / f"rank{rank}.json", lambda tmp: tmp.write_text(text))
    dist.barrier()
    dist.destroy_process_group()


def corpus_blocks(work: Path, vocab: int, seq_len: int, texts: int = 2000) -> Path:
    """The local corpus (its first `texts` paragraphs) tokenized into `seq_len`-token blocks: the torch.save file."""
    import torch

    path = Path(work) / f"blocks-{vocab}-{seq_len}-{texts}.pt"
    if not path.exists():
        from helpers.data import load_text_dataset, pack_blocks, train_tokenizer

        ds = load_text_dataset("local")["train"]
        ds = ds.select(range(min(texts, len(ds))))
        tok = train_tokenizer(ds["text"], Path(work) / f"tokenizer-{vocab}-{texts}", vocab_size=vocab)
        blocks = pack_blocks(ds, tok, seq_len)[:]["input_ids"]
        write_atomically(path, lambda tmp: torch.save(blocks, tmp))
    return path


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
    """The arguments every scale-out script takes (output folder, device, model shape, data, seed)."""
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
    """What a scale-out script knows once its rank has joined the group."""

    device: str
    rank: int
    world: int
    precision: str
    cfg: MoEConfig
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


# ---------------------------------------------------------------- launching ranks


def launch_argv(script: str | Path, n: int, *, launcher: str = "deepspeed", device: str = "cpu",
                port: int | None = None, args: Sequence[str] = ()) -> list[str]:
    """The command that starts `n` ranks of `script`, as a list for subprocess (python -m form of each launcher).

    `deepspeed` is ``python -m deepspeed.launcher.runner`` (GPUs: --num_gpus; CPU ranks: --num_accelerators),
    `torchrun` is ``python -m torch.distributed.run``.
    """
    port = port or free_port()
    if launcher == "deepspeed":
        count = "--num_gpus" if device == "cuda" else "--num_accelerators"
        head = [sys.executable, "-m", "deepspeed.launcher.runner", count, str(n), "--master_port", str(port)]
    elif launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(port)]
    else:
        raise ValueError(f"launcher must be 'deepspeed' or 'torchrun' (got {launcher!r})")
    return head + [str(script), *map(str, args)]


def shown(argv: Sequence[str]) -> str:
    """`launch_argv` as one would type it: `deepspeed ...` / `torchrun ...`, paths relative to the course."""
    words = list(argv)
    if words[1:3] == ["-m", "deepspeed.launcher.runner"]:
        words = ["deepspeed"] + words[3:]
    elif words[1:3] == ["-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    root = str(ROOT) + os.sep
    return shlex.join(w.replace(root, "") for w in words)


def single_node_commands(script: str | Path, n: int, device: str = "cuda", args: Sequence[str] = ()) -> dict[str, str]:
    """The same `n`-rank start of `script` with each launcher, as typed (port 29500).

    `accelerate launch --multi_gpu` starts one process per GPU through torchrun; the script itself calls
    deepspeed.initialize, so no accelerate config is needed (notebook 04 drives DeepSpeed through Accelerate).
    Without GPUs, accelerate launch runs its simple launcher: one process, whatever --num_processes says.
    """
    cmds = {name: shown(launch_argv(script, n, launcher=name, device=device, port=29500, args=args))
            for name in ("deepspeed", "torchrun")}
    rel = str(script).replace(str(ROOT) + os.sep, "")
    cmds["accelerate launch"] = shlex.join(["accelerate", "launch", "--multi_gpu", "--num_processes", str(n),
                                            "--main_process_port", "29500", rel, *map(str, args)])
    return cmds


def function_source(path: str | Path, name: str) -> str:
    """The source text of function `name` in the file `path` (to show a script's core in a notebook)."""
    import ast

    text = Path(path).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "\n".join(text.splitlines()[node.lineno - 1:node.end_lineno])
    raise ValueError(f"no function {name!r} in {path}")


def run_ranks(script: str | Path, n: int, out: Path, *, device: str = "cpu", launcher: str = "deepspeed",
              args: Sequence[str] = (), timeout: int = 600) -> list[dict[str, Any]]:
    """Launch `n` ranks of `script` with --out `out` and return what each wrote (rank<r>.json), rank 0 first.

    The five variables a launcher sets are removed from the children's environment (a notebook's own
    single-process values would clash); on CPU the GPUs are hidden from them.
    """
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    argv = launch_argv(script, n, launcher=launcher, device=device, args=[*args, "--out", str(out),
                                                                           "--device", device])
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    from helpers.fresh_process import run_process_group

    proc = run_process_group(argv, cwd=ROOT, env=env, timeout=timeout)  # an interrupt stops every rank
    if proc.returncode != 0:
        raise RuntimeError(f"{shown(argv)} failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    for r in reports:
        r["launch_seconds"] = round(time.perf_counter() - start, 1)
        r["command"] = shown(argv)
    return reports


def hostfile_text(hosts: dict[str, int]) -> str:
    """A DeepSpeed hostfile: one `hostname slots=<GPUs>` line per node (the launcher reaches them over ssh)."""
    for host, slots in hosts.items():
        if not host or any(c.isspace() for c in host) or int(slots) < 1:
            raise ValueError(f"bad host entry {host!r}: {slots!r} (a hostname and at least 1 slot)")
    return "".join(f"{host} slots={int(slots)}\n" for host, slots in hosts.items())


def parse_hostfile(text: str) -> dict[str, int]:
    """{host: slots} from hostfile text, as DeepSpeed's launcher reads it (comments and blank lines skipped)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host, slots = line.split()
            key, value = slots.split("=")
            if key != "slots":
                raise ValueError
            slots = int(value)
        except ValueError:
            raise ValueError(f"hostfile line {number} {raw!r}: expected 'hostname slots=N'") from None
        if host in hosts:
            raise ValueError(f"hostfile line {number}: host {host!r} is listed twice")
        hosts[host] = slots
    return hosts


def multi_node_commands(script: str, config: str, hosts: dict[str, int], master: str | None = None,
                        port: int = 29500) -> dict[str, str]:
    """The commands that start `script` on every GPU of `hosts` (not run here: they need the machines and ssh)."""
    nodes, gpus = len(hosts), min(hosts.values())
    master = master or next(iter(hosts))
    return {
        "deepspeed launcher (hostfile, ssh to each node)":
            f"deepspeed --hostfile hostfile --num_nodes {nodes} --num_gpus {gpus} --master_addr {master} "
            f"--master_port {port} {script} --deepspeed_config {config}",
        f"torchrun (run on every node, NODE_RANK 0 ... {nodes - 1})":
            f"torchrun --nnodes {nodes} --nproc_per_node {gpus} --node_rank $NODE_RANK --master_addr {master} "
            f"--master_port {port} {script} --deepspeed_config {config}",
        "accelerate launch (run on every node)":
            f"accelerate launch --multi_gpu --num_machines {nodes} --num_processes {nodes * gpus} "
            f"--machine_rank $NODE_RANK --main_process_ip {master} --main_process_port {port} "
            f"{script} --deepspeed_config {config}",
    }


# ---------------------------------------------------------------- reading the ZeRO runs


def zero_rows(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (stage, N): rank 0's bytes and the largest of any rank, from the ranks' reports of one launch."""
    rows = []
    for i, row in enumerate(reports[0]["stages"]):
        ranks = [r["stages"][i] for r in reports]
        out = dict(row)
        out["max_model_states"] = max(x["model_states"] for x in ranks)
        out["max_peak_gpu_bytes"] = max(x["peak_gpu_bytes"] for x in ranks)
        out["ranks"] = len(ranks)
        rows.append(out)
    return rows


def with_estimates(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the estimator's bytes per rank (helpers.model_states_per_gpu, no buffers) and ratio to 1/N of N=1."""
    single = {r["stage"]: r["model_states"] for r in rows if r["world"] == 1}
    out = []
    for r in rows:
        est = model_states_per_gpu(r["n_params"], r["precision"], gpu_counts=(r["world"],))[r["stage"]][r["world"]]
        r = dict(r, estimate=est)
        if r["stage"] in single:
            r["ratio_to_1_over_n"] = round(r["model_states"] / (single[r["stage"]] / r["world"]), 3)
        out.append(r)
    return out


def estimate_parts(n_params: int, stage: int, world: int, precision: str) -> dict[str, int]:
    """The estimator's params / grads / optimizer bytes per rank (no buckets)."""
    from helpers.memory import estimate_model_states

    est = estimate_model_states(n_params, stage, precision=precision, n_gpus=world, reduce_bucket_elements=0)
    return {k: est.gpu.get(k, 0) for k in STATE_PARTS}


def scaling_table(rows: Sequence[dict[str, Any]]) -> str:
    """Measured per-rank MB of params / peak grads / optimizer and their sum, next to the estimate, per (stage, N)."""
    mb = 1e6
    head = (f"{'stage':>5}{'N':>3}{'params':>9}{'grads peak':>12}{'(kept)':>8}{'optimizer':>11}{'states':>9}"
            f"{'estimate':>10}{'states / (N=1 states / N)':>27}")
    lines = ["MB per rank (rank 0)", head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["stage"], r["world"])):
        ratio = r.get("ratio_to_1_over_n")
        lines.append(f"{r['stage']:>5}{r['world']:>3}{r['params'] / mb:>9.3f}{r['grads_peak'] / mb:>12.3f}"
                     f"{r['grads_held'] / mb:>8.3f}{r['optimizer'] / mb:>11.3f}{r['model_states'] / mb:>9.3f}"
                     f"{r.get('estimate', 0) / mb:>10.3f}{'' if ratio is None else f'{ratio:.2f}':>27}")
    return "\n".join(lines)


def plot_zero_scaling(rows: Sequence[dict[str, Any]], title: str = "Model states per rank") -> "Figure":
    """Per-rank bytes of each part against N, one panel per ZeRO stage; dashed: the estimator."""
    from matplotlib.figure import Figure

    stages = sorted({r["stage"] for r in rows})
    fig = Figure(figsize=(3.2 * len(stages), 3.4), layout="constrained")
    axes = fig.subplots(1, len(stages), sharey=True, squeeze=False)[0]
    colors = {"params": "tab:blue", "grads_peak": "tab:orange", "optimizer": "tab:green"}
    labels = {"params": "params", "grads_peak": "grads (peak)", "optimizer": "optimizer"}
    for ax, stage in zip(axes, stages):
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["world"])
        ns = [r["world"] for r in mine]
        for key, color in colors.items():
            ax.plot(ns, [r[key] / 1e6 for r in mine], "o-", color=color, label=f"{labels[key]}, measured")
            part = "grads" if key == "grads_peak" else key
            ax.plot(ns, [estimate_parts(r["n_params"], stage, r["world"], r["precision"])[part] / 1e6 for r in mine],
                    "--", color=color, alpha=0.6, label=f"{part}, estimate")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)  # 1/N: a straight line down; not partitioned: flat
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_title(f"ZeRO-{stage}")
        ax.set_xlabel("ranks N")
    axes[0].set_ylabel("MB per rank (log scale)")
    axes[-1].legend(fontsize=7)
    fig.suptitle(title)
    return fig


# ---------------------------------------------------------------- pipeline parallelism


def pipeline_layers(reference: Any) -> list[Any]:
    """The course GPT as a list of pipeline layers, with the weights of `reference` (a helpers.build_gpt_moe model).

    token embedding (tied to the output layer, as in GPT-2) -> + position embedding -> the blocks -> final norm ->
    output layer. The tied pair is a `TiedLayerSpec`: the first and last stage each hold the embedding, and
    DeepSpeed all-reduces its gradient between them.
    """
    import copy

    import torch.nn.functional as F
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from torch import nn

    class TokenEmbedding(nn.Module):
        def __init__(self, tok: nn.Embedding) -> None:
            super().__init__()
            self.weight = nn.Parameter(tok.weight.detach().clone())

        def forward(self, ids: Any) -> Any:
            return F.embedding(ids, self.weight)

    class AddPositions(nn.Module):
        def __init__(self, pos: nn.Embedding) -> None:
            super().__init__()
            self.pos = copy.deepcopy(pos)

        def forward(self, x: Any) -> Any:
            import torch

            return x + self.pos(torch.arange(x.shape[1], device=x.device))

    class BlockLayer(nn.Module):  # the course's Block returns (x, aux loss): a pipeline layer passes x only
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = copy.deepcopy(block)

        def forward(self, x: Any) -> Any:
            return self.block(x)[0]

    def logits(embedding: Any, x: Any) -> Any:
        return F.linear(x, embedding.weight)

    return [TiedLayerSpec("tok", TokenEmbedding, reference.tok, tied_weight_attr="weight"),
            LayerSpec(AddPositions, reference.pos),
            *[LayerSpec(BlockLayer, b) for b in reference.blocks],
            copy.deepcopy(reference.ln_f),
            TiedLayerSpec("tok", TokenEmbedding, reference.tok, forward_fn=logits, tied_weight_attr="weight")]


def lm_loss(logits: Any, labels: Any) -> Any:
    """Next-token cross-entropy, as the course GPT computes it (the pipeline's last stage calls it)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


@dataclass
class PipelineSchedule:
    """DeepSpeed's 1F1B training schedule for `stages` x `micro_batches`, tick by tick."""

    stages: int
    micro_batches: int
    grid: list[list[str]]  # grid[stage][tick]: "F3" forward of micro-batch 3, "B3" backward, "" idle

    @property
    def ticks(self) -> int:
        return len(self.grid[0])

    @property
    def idle_fraction(self) -> float:
        """Share of (stage, tick) slots with neither a forward nor a backward: the bubble."""
        slots = self.stages * self.ticks
        return sum(1 for row in self.grid for c in row if not c) / slots

    @property
    def bubble_formula(self) -> float:
        """(S - 1) / (M + S - 1), the bubble of a GPipe / 1F1B schedule (forward and backward of equal cost)."""
        return (self.stages - 1) / (self.micro_batches + self.stages - 1)

    def table(self) -> str:
        width = max(3, max(len(c) for row in self.grid for c in row) + 1)
        lines = ["tick    " + "".join(f"{t:>{width}}" for t in range(self.ticks))]
        for s, row in enumerate(self.grid):
            lines.append(f"stage {s} " + "".join(f"{c or '.':>{width}}" for c in row))
        return "\n".join(lines)


def pipeline_schedule(stages: int, micro_batches: int) -> PipelineSchedule:
    """The forward/backward slots of DeepSpeed's `TrainSchedule` (what `engine.train_batch` runs) per stage and tick."""
    from deepspeed.runtime.pipe import schedule

    grid = []
    for stage in range(stages):
        sched = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        row = []
        for tick, cmds in enumerate(sched.steps()):
            micro_batch = sched._step_to_micro_batch(tick)[0]  # the schedule's own step -> micro-batch map
            kinds = {type(c) for c in cmds}
            row.append(f"F{micro_batch}" if schedule.ForwardPass in kinds else
                       f"B{micro_batch}" if schedule.BackwardPass in kinds else "")
        grid.append(row)
    return PipelineSchedule(stages, micro_batches, grid)


# ---------------------------------------------------------------- tensor parallelism and 3D


def autotp_config(world: int) -> dict[str, Any]:
    """The `tensor_parallel` section for AutoTP training of the course GPT over `world` ranks.

    Column-parallel (each rank a slice of the outputs): the fused q/k/v projection (3 equal parts, split each)
    and the MLP's up projection. Row-parallel (each rank a slice of the inputs, outputs all-reduced): the
    attention output and the MLP's down projection. Embeddings and norms stay whole on every rank.
    """
    return {"autotp_size": world, "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": [r".*\.attn\.qkv\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
        {"patterns": [r".*\.mlp\.up\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.attn\.out\.weight$", r".*\.mlp\.down\.weight$"], "partition_type": "row"},
    ]}}


def topology_table(pp: int, tp: int, dp: int) -> str:
    """Which (pipe, data, model) coordinates each global rank gets in DeepSpeed's 3D topology."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    lines = [f"{'rank':>5}{'pipe stage':>12}{'data replica':>14}{'tensor slice':>14}"]
    for rank in range(topo.world_size()):
        c = topo.get_coord(rank)
        lines.append(f"{rank:>5}{c.pipe:>12}{c.data:>14}{c.model:>14}")
    return "\n".join(lines)
