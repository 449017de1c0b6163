"""Scaling out (notebook 05): the lesson's tables. What each rank holds under data parallelism and ZeRO 0-3 (read
from the ranks' reports), the pipeline's layers and schedule, AutoTP's config, DeepSpeed's 3D topology.

The lesson programs in notebooks/programs/ (scale_out_train.py: data parallel + ZeRO 0-3; pipeline_train.py: a
2-stage `PipelineModule`; tp_train.py: AutoTP) run one process per rank with `helpers.rank`; `helpers.launch`
starts them and reads the rank<r>.json each wrote; this module turns those reports into rows and tables
(`helpers.plots.plot_zero_scaling` draws them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from helpers.atomic import write_atomically
from helpers.memory import model_states_per_gpu

if TYPE_CHECKING:
    from helpers.gpt import GPTConfig

__all__ = ["SCALE_OUT_SHAPES", "corpus_blocks", "zero_rows", "with_estimates", "scaling_table", "wire_bytes",
           "comm_table", "zero_findings", "pipeline_schedule"]

STATE_PARTS = ("params", "grads", "optimizer")  # the parts `helpers.rank.rank_state_bytes` measures

# Model shapes of the programs' course GPT (helpers.gpt, dense): tiny on CPU ranks, GPT-2-small-like on GPUs.
SCALE_OUT_SHAPES: dict[str, dict[str, int]] = {
    "cpu": dict(vocab=512, seq_len=32, hidden=128, layers=4, heads=4, ffn=512),
    "gpu": dict(vocab=8192, seq_len=256, hidden=768, layers=12, heads=12, ffn=3072),
}


def gpt_config(vocab: int, seq_len: int, hidden: int, layers: int, heads: int, ffn: int) -> "GPTConfig":
    """The dense course GPT (notebook 03's `dense_twin`) of this shape; dropout off so runs can be compared."""
    from helpers.gpt import GPTConfig

    return GPTConfig(vocab_size=vocab, seq_len=seq_len, hidden=hidden, layers=layers, heads=heads, ffn=ffn,
                     num_experts=0, dropout=0.0).check()


def corpus_blocks(work: Path, vocab: int, seq_len: int, texts: int = 2000) -> Path:
    """The local corpus (its first `texts` paragraphs) tokenized into `seq_len`-token blocks: the torch.save file
    (notebook 05)."""
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


# ---------------------------------------------------------------- reading the ZeRO runs


def zero_rows(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (stage, N): rank 0's bytes and the largest of any rank, from the ranks' reports of one launch
    (notebook 05)."""
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
    """Rows with the estimator's bytes per rank (helpers.model_states_per_gpu, no buffers) and ratio to 1/N of N=1
    (notebook 05)."""
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
    """Measured per-rank MB of params / peak grads / optimizer and their sum, next to the estimate, per (stage, N)
    (notebook 05)."""
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


# what a ring algorithm moves per rank, as a multiple of the message each rank hands in (N ranks): an all-reduce
# sends and receives ~2(N-1)/N of it, a reduce-scatter (N-1)/N, an all-gather receives the N-1 other parts, and a
# broadcast passes the message on once; nothing crosses at N=1
WIRE_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter_tensor": lambda n: (n - 1) / n,
                "all_gather_into_tensor": lambda n: n - 1, "broadcast": lambda n: 1.0 if n > 1 else 0.0}


def wire_bytes(sent: dict[str, int], world: int) -> float:
    """Bytes a rank moves over its links for the messages `sent` ({collective: message bytes}), by WIRE_FACTORS
    (a collective not listed counts its message once) (notebook 05)."""
    return sum(WIRE_FACTORS.get(op, lambda n: 1.0 if n > 1 else 0.0)(world) * b for op, b in sent.items())


def comm_table(rows: Sequence[dict[str, Any]]) -> str:
    """MB each rank handed to DeepSpeed's collectives per optimizer step, per (stage, N): the `comm_bytes_per_step`
    that notebooks/programs/scale_out_train.py reads off deepspeed.comm's comms logger (message bytes per call); and
    the MB that moves over the rank's links for them (`wire_bytes`) (notebook 05)."""
    ops = sorted({op for r in rows for op in r.get("comm_bytes_per_step", {})})
    if not ops:
        return "no communication recorded (these rank reports predate the comms logger)"
    short = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    head = f"{'stage':>5}{'N':>3}" + "".join(f"{short.get(op, op):>16}" for op in ops) + f"{'on the wire':>13}"
    lines = ["MB per rank per optimizer step: messages per collective (deepspeed.comm's comms logger), then what a "
             "ring moves for them", head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["stage"], r["world"])):
        sent = r.get("comm_bytes_per_step", {})
        lines.append(f"{r['stage']:>5}{r['world']:>3}" + "".join(f"{sent.get(op, 0) / 1e6:>16.3f}" for op in ops)
                     + f"{wire_bytes(sent, r['world']) / 1e6:>13.3f}")
    return "\n".join(lines)


def zero_findings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """What the ZeRO runs showed, computed from their rows (rank 0, smallest and largest N): each stage's model states
    against 1/N, where N=1's extra bytes come from (ZeRO's own fp32 master copy), the gradient peak of stages 1 and 2,
    and that every stage trained the same model (losses within 1e-3 of ZeRO-0's) (notebook 05)."""
    by = {(r["stage"], r["world"]): r for r in rows}
    ns = sorted({r["world"] for r in rows})
    lo, hi = ns[0], ns[-1]
    mb = 1e6
    lines = []
    for s in range(4):
        a, b = by[(s, lo)]["model_states"], by[(s, hi)]["model_states"]
        lines.append(f"ZeRO-{s}: model states per rank {a / mb:.2f} MB at N={lo} -> {b / mb:.2f} MB at N={hi} "
                     f"(x{b / a:.2f}; 1/N would be x{lo / hi:.2f})")
    if lo == 1:
        z0, z1 = by[(0, 1)], by[(1, 1)]
        extra = z1["optimizer"] - z0["optimizer"]
        lines.append(f"At N=1 ZeRO-1 holds {z1['model_states'] / z0['model_states'] - 1:+.0%} of ZeRO-0's model states: "
                     f"its optimizer {z1['optimizer'] / mb:.2f} MB vs {z0['optimizer'] / mb:.2f} MB, {extra / mb:+.2f} MB "
                     f"= {extra / z0['params']:.2f} x the {z0['precision']} parameters' {z0['params'] / mb:.2f} MB: "
                     f"ZeRO's fp32 master copy of the weights (master copy measured {z1['optimizer_master'] / mb:.2f} MB; "
                     f"the estimate says {by[(1, 1)]['estimate'] / by[(0, 1)]['estimate'] - 1:+.0%})")
    g1, g2 = by[(1, hi)], by[(2, hi)]
    lines.append(f"Gradient peak at N={hi}: ZeRO-1 {g1['grads_peak'] / mb:.2f} MB (every gradient until backward ends), "
                 f"ZeRO-2 {g2['grads_peak'] / mb:.2f} MB (reduced bucket by bucket); both keep "
                 f"{g2['grads_held'] / mb:.2f} MB for the step")
    gaps = [abs(x - y) for n in ns for s in (1, 2, 3) for x, y in zip(by[(s, n)]["losses"], by[(0, n)]["losses"])]
    lines.append(f"Largest loss difference of ZeRO-1/2/3 to ZeRO-0 at the same N: {max(gaps):.1e} "
                 f"({'the same model trained' if max(gaps) < 1e-3 else 'NOT the same training: look at the runs'})")
    return lines


# ---------------------------------------------------------------- pipeline parallelism


def pipeline_layers(reference: Any) -> list[Any]:
    """The course GPT as a list of pipeline layers, with the weights of `reference` (a helpers.gpt.build_gpt model).

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
    """The forward/backward slots of DeepSpeed's `TrainSchedule` (what `engine.train_batch` runs) per stage and tick
    (notebook 05)."""
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
    """The `tensor_parallel` section for AutoTP training of the course GPT over `world` ranks (notebook 05).

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
    """Which (pipe, data, model) coordinates each global rank gets in DeepSpeed's 3D topology (notebook 05)."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    lines = [f"{'rank':>5}{'pipe stage':>12}{'data replica':>14}{'tensor slice':>14}"]
    for rank in range(topo.world_size()):
        c = topo.get_coord(rank)
        lines.append(f"{rank:>5}{c.pipe:>12}{c.data:>14}{c.model:>14}")
    return "\n".join(lines)
