"""Mixture of Experts with DeepSpeed MoE, measured (notebook 03).

The model is the course GPT (`helpers.gpt`, MoE layers when `GPTConfig.num_experts` > 0) and its *dense
twin*. Here: total / active parameter counts, the optimizer parameter groups DeepSpeed needs for MoE, FLOPs
per token, expert capacity, expert load and dropped tokens read from the gate (forward hooks on
``TopKGate``), `MoEHooks` (what a MoE run adds to `helpers.train_run`), the comparison table and the ZeRO-3
refusal. Light to import: torch, deepspeed and helpers.gpt are imported inside the functions.

DeepSpeed's gate returns, per forward, the expert each token's routes go to (-1 where the expert was
already full: a *dropped* route, the token then skips the MLP and keeps only its residual) and
``exp_counts``, the tokens each expert was asked for before the capacity limit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from helpers.runtime import setup_single_process, teardown
from helpers.train import RunResult, SpeedComparison, TrainHooks, compare_speed

if TYPE_CHECKING:
    from helpers.gpt import GPTConfig
    from helpers.hardware import Runtime

__all__ = []

ZERO3_REFUSAL = "Native DeepSpeed MoE is not supported with ZeRO Stage 3"


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a (MoE) model: held in total, used per token, and held by this rank (notebook 03)."""

    total: int  # every parameter of the model, all experts on all ranks
    active: int  # what one token goes through: shared weights + k experts per MoE layer
    shared: int  # not in an expert (embeddings, attention, dense MLPs, norms, gates)
    gate: int  # the routers' weights (part of shared)
    per_expert: int  # one expert of one MoE layer
    experts: int  # all expert parameters of the model
    local: int  # what this process holds: shared + its own experts (= total when ep_size is 1)
    local_experts: int  # expert parameters this process holds
    moe_layers: int
    num_experts: int
    k: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def count_moe_params(model: Any) -> ParamCounts:
    """Total, active-per-token and local parameter counts, read from the modules (notebook 03)."""
    from deepspeed.moe.layer import MoE

    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    expert_ids: set[int] = set()
    gate = per_expert = experts_total = active_experts = local_experts = 0
    k = num_experts = 0
    for m in moes:
        local = list(m.deepspeed_moe.experts.deepspeed_experts)
        one = sum(p.numel() for p in local[0].parameters())
        per_expert = one
        expert_ids.update(id(p) for e in local for p in e.parameters())
        gate += sum(p.numel() for p in m.deepspeed_moe.gate.parameters())
        k, num_experts = m.deepspeed_moe.gate.k, m.num_experts
        experts_total += one * m.num_experts
        active_experts += one * k
        local_experts += one * len(local)
    shared = sum({id(p): p.numel() for p in model.parameters() if id(p) not in expert_ids}.values())
    return ParamCounts(total=shared + experts_total, active=shared + active_experts, shared=shared, gate=gate,
                       per_expert=per_expert, experts=experts_total, local=shared + local_experts,
                       local_experts=local_experts, moe_layers=len(moes), num_experts=num_experts, k=k)


def moe_param_groups(model: Any, weight_decay: float = 0.01) -> list[dict[str, Any]]:
    """Optimizer parameter groups with the experts split off, as DeepSpeed's ZeRO needs for MoE (notebook 03).

    Expert parameters are reduced over the expert-data-parallel group, not the whole data-parallel group,
    so ZeRO keeps them in groups of their own (marked 'moe': True), built here by DeepSpeed's
    split_params_into_different_moe_groups_for_optimizer. A dense model gets its one group back.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    group = {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters",
             "weight_decay": weight_decay}
    return split_params_into_different_moe_groups_for_optimizer(group)


def describe_param_groups(groups: Sequence[dict[str, Any]]) -> str:
    """One line per optimizer group: name, MoE or not, tensors and parameters (notebook 03)."""
    lines = []
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        lines.append(f"{g.get('name', '?'):<16} moe={str(bool(g.get('moe', False))):<6} "
                     f"{len(g['params']):>4} tensors {n:>12,} parameters")
    return "\n".join(lines)


def measure_flops_per_token(model: Any, input_ids: Any) -> float:
    """Forward FLOPs per token as PyTorch's FlopCounterMode counts them (matrix multiplies) (notebook 03).

    Run in training mode, so MoE experts compute on their full capacity buffers: slots the capacity
    factor reserves but no token fills are multiplied too (zeros), and counted.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.train()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids)
    model.train(was_training)
    return counter.get_total_flops() / input_ids.numel()


def expert_capacity(cfg: "GPTConfig", tokens: int) -> int:
    """Slots per expert for `tokens` tokens at training time, as DeepSpeed's gate computes them (notebook 03).

    ceil(tokens / num_experts x capacity_factor x k), at least min_capacity (float32, like the gate).
    """
    import torch

    if not cfg.is_moe:
        return 0
    c = torch.ceil((tokens / cfg.num_experts) * torch.tensor(cfg.capacity_factor * cfg.k)).to(torch.int64)
    return int(torch.maximum(c, torch.tensor(cfg.min_capacity)))


def analytic_flops_per_token(cfg: "GPTConfig", tokens: int | None = None) -> float:
    """Forward matmul FLOPs per token, counted from the shapes: 2 x multiply-adds of every linear layer (notebook 03).

    Without `tokens`: each token through its k experts only (the "active compute"). With `tokens` (tokens
    per forward): the experts compute every slot of their capacity buffers, filled or not, as DeepSpeed's
    MoE layer does. Attention scores are left out (the same for dense and MoE; PyTorch's CPU attention
    kernel is not counted by FlopCounterMode either).
    """
    h, f = cfg.hidden, cfg.ffn
    attn = 2 * (3 * h * h + h * h)
    mlp = 2 * (2 * h * f)  # a dense MLP, or k experts of width f / k
    n_moe = len(cfg.moe_layers)
    total = cfg.layers * (attn + mlp) + 2 * h * cfg.num_experts * n_moe + 2 * h * cfg.vocab_size
    if tokens is not None and cfg.is_moe:
        slots_per_token = cfg.num_experts * expert_capacity(cfg, tokens) / tokens
        total += n_moe * (slots_per_token - cfg.k) * 2 * (2 * h * cfg.expert_ffn)
    return float(total)


# ---------------------------------------------------------------- routing


class RoutingRecorder:
    """Reads every MoE gate's routing during training: tokens per expert, dropped routes (notebook 03).

    A forward hook on each ``TopKGate`` takes the gate's output: the expert of each route (-1 where the
    expert was full and the route was dropped) and ``exp_counts`` (routes each expert was asked for).
    Counts stay on the device until read, so recording adds no synchronisation to a step.
    """

    def __init__(self, model: Any, training_only: bool = True) -> None:
        from deepspeed.moe.sharded_moe import TopKGate

        model = getattr(model, "module", model)
        self.gates = [m for m in model.modules() if isinstance(m, TopKGate)]
        self.names = [n for n, m in model.named_modules() if isinstance(m, TopKGate)]
        self.training_only = training_only
        self.num_experts = self.gates[0].wg.out_features if self.gates else 0
        self.k = self.gates[0].k if self.gates else 0
        self._pending: list[list[Any]] = [[] for _ in self.gates]
        self._steps: list[Any] = []  # per step: tensor (layers, 2 * E + 3)
        self._handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self.training_only and not module.training:
                return
            import torch

            from helpers.overflow_check import CHECKED_DEEPSPEED

            if len(output) != 7:
                raise RuntimeError("RoutingRecorder expects DeepSpeed's sparse-route gate output (7 values: "
                                   "l_aux, capacity, experts, indices, locations, gates, exp_counts); this "
                                   f"DeepSpeed version returned {len(output)}. Fix: deepspeed=={CHECKED_DEEPSPEED}.")
            indices, demand = output[3], output[6]  # indices: (k, tokens), -1 where the route was dropped
            flat = indices.reshape(-1).long() + 1  # 0: dropped route, 1..E: kept by that expert
            counts = torch.bincount(flat, minlength=self.num_experts + 1)
            kept, dropped = counts[1:], counts[0]
            tokens_lost = (indices < 0).all(0).sum()  # tokens none of whose routes was kept
            tokens = torch.tensor(indices.shape[-1], device=indices.device)
            row = torch.cat([kept.float(), demand.float(), torch.stack([dropped.float(), tokens_lost.float(),
                                                                          tokens.float()])])
            self._pending[layer].append(row)

        return hook

    def end_step(self) -> None:
        """Close one optimizer step: sum what the gates saw since the last call."""
        import torch

        if not self.gates or not self._pending[0]:
            return
        self._steps.append(torch.stack([torch.stack(rows).sum(0) for rows in self._pending]).detach())
        self._pending = [[] for _ in self.gates]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "RoutingRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.end_step()
        self.remove()

    def history(self) -> dict[str, Any]:
        """Per step and MoE layer: kept routes per expert, asked-for routes per expert, dropped, tokens."""
        import torch

        self.end_step()
        if not self._steps:
            return {"kept": [], "demand": [], "dropped_routes": [], "tokens_lost": [], "tokens": []}
        data = torch.stack(self._steps).cpu().double()  # (steps, layers, 2E + 3)
        e = self.num_experts
        as_int = lambda t: t.round().long().tolist()  # noqa: E731
        return {"kept": as_int(data[..., :e]), "demand": as_int(data[..., e:2 * e]),
                "dropped_routes": as_int(data[..., 2 * e]), "tokens_lost": as_int(data[..., 2 * e + 1]),
                "tokens": as_int(data[..., 2 * e + 2])}

    def summary(self) -> "RoutingSummary":
        """Totals over every recorded step."""
        return RoutingSummary.from_history(self.history(), self.k, self.names)


@dataclass
class RoutingSummary:
    """Expert load and dropped tokens, summed over steps, per MoE layer (notebook 03)."""

    layers: list[str]
    k: int
    load: list[list[int]]  # routes each expert processed (kept), per layer
    demand: list[list[int]]  # routes each expert was asked for, per layer
    dropped_routes: list[int]
    tokens_lost: list[int]  # tokens with every route dropped (only the residual carries them on)
    tokens: list[int]  # tokens that went through each layer
    step_imbalance: list[float]  # per layer: busiest expert's routes / the mean, in each step, averaged

    @classmethod
    def from_history(cls, h: dict[str, Any], k: int, names: Sequence[str]) -> "RoutingSummary":
        if not h["kept"]:
            return cls(list(names), k, [], [], [], [], [], [])
        n_layers = len(h["kept"][0])
        col = lambda key: [sum(step[i] for step in h[key]) for i in range(n_layers)]  # noqa: E731
        vec = lambda key: [[sum(step[i][e] for step in h[key]) for e in range(len(h[key][0][i]))]  # noqa: E731
                           for i in range(n_layers)]
        ratios = [[max(step[i]) * len(step[i]) / sum(step[i]) for step in h["demand"] if sum(step[i])]
                  for i in range(n_layers)]
        return cls(list(names), k, vec("kept"), vec("demand"), col("dropped_routes"), col("tokens_lost"),
                   col("tokens"), [sum(r) / len(r) if r else math.nan for r in ratios])

    @property
    def dropped_fraction(self) -> float:
        """Dropped routes / routes, over all MoE layers."""
        routes = self.k * sum(self.tokens)
        return sum(self.dropped_routes) / routes if routes else math.nan

    @property
    def imbalance(self) -> float:
        """Busiest expert's routes / the mean within a step (1.0 = even), averaged over steps; worst layer.

        Measured per step because that is what the capacity limit sees: routing that swings from one
        expert to another between steps looks even when summed over training, yet drops tokens every step.
        """
        return max(self.step_imbalance) if self.step_imbalance else math.nan

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(dropped_fraction=round(self.dropped_fraction, 5), imbalance=round(self.imbalance, 4))
        d["step_imbalance"] = [round(x, 4) for x in self.step_imbalance]
        return d

    def table(self) -> str:
        """Per layer: share of all routes per expert (asked for), per-step busiest/mean, dropped share."""
        lines = [f"{'MoE layer':<12}{'% of routes asked of each expert (whole run)':<50}{'busiest/mean':>13}"
                 f"{'dropped':>9}"]
        for name, row, ratio, dropped, tokens in zip(self.layers, self.demand, self.step_imbalance,
                                                     self.dropped_routes, self.tokens):
            total = sum(row) or 1
            shares = " ".join(f"{100 * c / total:4.1f}" for c in row)
            short = name.removesuffix(".mlp.deepspeed_moe.gate")
            lines.append(f"{short:<12}{shares:<50}{ratio:>13.2f}{100 * dropped / max(self.k * tokens, 1):>8.1f}%")
        return "\n".join(lines)


def drop_shares(history: dict[str, Any], k: int, part: float = 0.1) -> dict[str, float]:
    """Share of routes dropped (all MoE layers) over the whole run of a `RoutingRecorder.history()`, over its first
    `part` of the steps and over its last `part`: the router of the first steps is not the trained one (notebook 03).
    {'all': ..., 'first': ..., 'last': ..., 'steps': steps in each part}."""
    dropped = [sum(step) for step in history["dropped_routes"]]
    routes = [k * sum(step) for step in history["tokens"]]
    n = max(1, round(len(dropped) * part))
    share = lambda sl: sum(dropped[sl]) / max(sum(routes[sl]), 1)  # noqa: E731
    return {"all": share(slice(None)), "first": share(slice(None, n)), "last": share(slice(-n, None)), "steps": n}


def set_capacity_factor(model: Any, factor: float) -> None:
    """Set every MoE gate's training and evaluation capacity factor (for a sweep)."""
    from deepspeed.moe.sharded_moe import TopKGate

    for m in getattr(model, "module", model).modules():
        if isinstance(m, TopKGate):
            m.capacity_factor = factor
            m.eval_capacity_factor = factor


# ---------------------------------------------------------------- training


def moe_table(runs: Sequence[RunResult]) -> str:
    """Fixed-width comparison of MoE runs (`train_run` with `MoEHooks`): parameters, FLOPs, tokens/s of the median
    timed step and the middle half of the steps (`RunResult.speed_spread`), peak VRAM (when a GPU was measured), the
    RAM the run added over its start, LM losses, validation loss, dropped share (notebook 03)."""
    gpu = any(r.peak_vram_gib for r in runs)
    head = (f"{'run':<24}{'total M':>9}{'active M':>9}{'MFLOP/tok':>10}{'tokens/s':>10}{'steps, middle half':>21}"
            + (f"{'peak GiB':>9}" if gpu else "") + f"{'RAM +GB':>8}"
            f"{'loss0':>7}{'lossN':>7}{'val':>7}{'dropped':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        e = r.extras
        lm = e["lm_losses"]
        dropped = e["routing"].get("dropped_fraction")
        low, mid, high = r.speed_spread()
        spread = f"{low:,.0f}-{high:,.0f}" if len(r.step_seconds) >= 2 else "one step: none"
        lines.append(f"{r.name:<24}{e['params_total'] / 1e6:>9.3f}{e['params_active'] / 1e6:>9.3f}"
                     f"{e['flops_per_token'] / 1e6:>10.2f}{mid:>10,.0f}{spread:>21}"
                     + (f"{r.peak_vram_gib:>9.3f}" if gpu else "")
                     + f"{max(r.peak_rss_gb - r.baseline_rss_gb, 0.0):>8.2f}"
                     f"{lm[0]:>7.3f}{sum(lm[-5:]) / len(lm[-5:]):>7.3f}"
                     f"{r.val_loss:>7.3f}" + (f"{100 * dropped:>7.1f}%" if dropped is not None else f"{'-':>8}"))
    return "\n".join(lines)


def speed_verdicts(runs: Sequence[RunResult], baseline: str = "dense") -> list[SpeedComparison]:
    """Each run against the run named `baseline` by `helpers.train.compare_speed`: median step ratio and whether the middle
    halves of their per-step tokens/s are apart (only then is one called faster or slower) (notebook 03)."""
    base = next(r for r in runs if r.name == baseline)
    return [compare_speed(r, base) for r in runs if r is not base]


@dataclass(frozen=True)
class Evenness:
    """How even one run's routing was, by the two measures notebook 03 shows (1.0 = perfectly even)."""

    per_step: float  # busiest expert's routes / the mean within a step, averaged over steps, worst MoE layer
    whole_run: float  # busiest expert's share of the whole run's routes x num_experts, first MoE layer (the bars)


def evenness(routing: dict[str, Any]) -> Evenness:
    """Both evenness measures of a `RoutingSummary.as_dict()` (`RunResult.extras['routing']`) (notebook 03)."""
    row = routing["demand"][0]
    return Evenness(per_step=routing["imbalance"], whole_run=max(row) * len(row) / max(sum(row), 1))


def most_even(routings: dict[float, dict[str, Any]]) -> dict[str, list[float]]:
    """The aux-loss coefficients (keys) whose routing was the most even, by each measure of `Evenness`: several where
    they tie to the printed two decimals (notebook 03). {'per_step': [...], 'whole_run': [...]}."""
    measures = {c: evenness(r) for c, r in routings.items()}
    out = {}
    for field in ("per_step", "whole_run"):
        best = min(round(getattr(m, field), 2) for m in measures.values())
        out[field] = [c for c, m in measures.items() if round(getattr(m, field), 2) == best]
    return out


def run_from_report_row(row: dict[str, Any]) -> RunResult:
    """The speed part of a benchmarks/moe.py report row as a `RunResult` (rows before issue 22 lack the record's
    other fields, and `step_seconds`)."""
    return RunResult(name=row["name"], model="course GPT", params=row.get("params_total", 0), config=row["name"],
                     precision=row.get("precision", ""), micro_batch=row["micro_batch"],
                     grad_accum=row.get("grad_accum", 1), seq_len=row["seq_len"], steps=row["steps"],
                     checkpointing=False, runtime=row.get("runtime", ""), tokens_per_s=row["tokens_per_s"],
                     step_seconds=list(row.get("step_seconds", [])))


def committed_report_note(report: dict[str, Any], runs: Sequence[RunResult] | None = None,
                          runtime_label: str | None = None) -> str:
    """Where the committed benchmark's numbers come from, next to this run's (notebook 03, reports/moe.json).

    The report is a separate run of benchmarks/moe.py (its own machine, date, load and size): its tokens/s are never
    compared with this run's; each run's MoE / dense ratios are compared within that run only, with the spread of its
    steps where the report recorded them (`step_seconds`, reports written after issue 22)."""
    shape = report.get("shape", {})
    lines = [f"reports/moe.json: benchmarks/moe.py on '{report['runtime']}' ({report.get('gpu') or 'no GPU'}), "
             f"{report['date']}, torch {report.get('torch', '?')}, deepspeed {report.get('deepspeed', '?')}: "
             f"hidden {shape.get('hidden')}, {shape.get('layers')} layers, {report['steps']} steps of "
             f"{report['micro_batch']} x {report['seq_len']} tokens, {report.get('precision')}."]
    if runs:
        here = runs[0]
        lines.append(f"This notebook's runs: '{runtime_label or here.runtime}', {here.steps} steps of "
                     f"{here.micro_batch} x {here.seq_len} tokens, {here.precision}. Different runs (machine, load, "
                     "size): their tokens/s are not compared with each other, only the ratios within each run.")
    rows = {r["name"]: run_from_report_row(r) for r in report.get("rows", [])}
    if "dense" in rows:
        if all(len(r.step_seconds) >= 2 for r in rows.values()):
            lines.append("In the report (median step, middle half of the steps): "
                         + "; ".join(str(c) for c in speed_verdicts(list(rows.values()))))
        else:
            d = rows["dense"]
            lines.append("In the report, tokens/s is each run's average over its timed steps, validation passes "
                         f"included (every {max(1, d.steps // 5)} steps), with no per-step times recorded: no spread, "
                         "so its ratios are not called faster or slower ("
                         + ", ".join(f"{n} x{r.tokens_per_s / d.tokens_per_s:.2f} dense" for n, r in rows.items()
                                     if n != "dense") + ").")
    if runs:
        lines.append("This run's averages of the same kind (timed steps with validation): "
                     + ", ".join(f"{r.name} {r.tokens_per_s:,.0f}" for r in runs)
                     + " tokens/s; its median steps: " + ", ".join(f"{r.name} {r.speed_text()}" for r in runs) + ".")
    return "\n".join(lines)


def evaluate_moe(model: Any, blocks: Any, batches: int = 4, batch_size: int = 8, seed: int = 0) -> float:
    """Mean LM loss (aux loss left out) over the first `batches` batches of `blocks`, without gradients (notebook 03).

    The gate's random parts (top-2's sampled second expert, random token selection at capacity) draw from
    a forked RNG seeded with `seed`, so evaluations are comparable and training's RNG is untouched.
    """
    import torch

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = []
    with torch.no_grad(), torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for i in range(min(batches, len(blocks) // batch_size)):
            ids = blocks[i * batch_size:(i + 1) * batch_size]["input_ids"].to(device)
            losses.append(float(model(input_ids=ids, labels=ids).lm_loss))
    model.train(was_training)
    return sum(losses) / max(len(losses), 1)


def capacity_sweep(model: Any, blocks: Any, factors: Sequence[float], *, batches: int = 4, batch_size: int = 8,
                   seed: int = 0) -> list[dict[str, float]]:
    """For each capacity factor: dropped share of routes and LM loss on `blocks` (the model is restored)
    (notebook 03)."""
    from deepspeed.moe.sharded_moe import TopKGate

    net = getattr(model, "module", model)
    gates = [m for m in net.modules() if isinstance(m, TopKGate)]
    saved = [(g.capacity_factor, g.eval_capacity_factor) for g in gates]
    rows = []
    try:
        for f in factors:
            set_capacity_factor(net, f)
            with RoutingRecorder(net, training_only=False) as rec:
                loss = evaluate_moe(net, blocks, batches, batch_size, seed)
            s = rec.summary()
            rows.append({"capacity_factor": f, "dropped_fraction": s.dropped_fraction,
                         "tokens_lost_fraction": sum(s.tokens_lost) / max(sum(s.tokens), 1), "val_loss": loss})
    finally:
        for g, (cf, ecf) in zip(gates, saved):
            g.capacity_factor, g.eval_capacity_factor = cf, ecf
    return rows


def moe_ds_config(runtime: "Runtime", *, stage: int = 2, micro_batch: int = 8, lr: float = 1e-3,
                  steps: int = 100, world_size: int = 1) -> dict[str, Any]:
    """The course's ZeRO config for these runs: linear warm-up over a tenth of the steps; fp16 starts at 2^12
    (notebook 03).

    A 2^16 initial loss scale (DeepSpeed's default) overflows and skips the first steps of a short run.
    """
    from helpers.config import course_config

    return course_config(f"zero{stage}", runtime, micro_batch_size=micro_batch, lr=lr,
                         warmup_steps=max(1, steps // 10), world_size=world_size, initial_scale_power=12)


class MoEHooks(TrainHooks):
    """What a dense-or-MoE run of the course GPT adds to `helpers.train_run` (notebook 03, benchmarks/moe.py).

        r = helpers.train_run(name, lambda: build_gpt(cfg, seed), blocks, runtime=rt, ds_config=cfg_ds,
                              measure=helpers.train.MeasureSettings(hooks=MoEHooks(cfg), val_blocks=val,
                                                                    eval_every=10))

    The optimizer gets `moe_param_groups`; the model's loss (LM loss + cfg.aux_loss_coef x aux loss) is trained
    and its two parts kept per step; the gates' routing is recorded every step; validation is `evaluate_moe`
    (LM loss only). `probe(model)`, if given, runs on the trained model before the teardown (e.g. a
    `capacity_sweep`). The record is the `RunResult`; `RunResult.extras` holds kind, num_experts, k,
    capacity_factor, aux_loss_coef, params_total, params_active, flops_per_token (measured forward FLOPs per
    token), lm_losses, aux_losses, routing (`RoutingSummary.as_dict()`, {} for the dense model), load_history
    (first MoE layer: kept routes per expert per step) and probe (what `probe` returned, if given).
    """

    def __init__(self, cfg: "GPTConfig", *, seed: int = 0, probe: Callable[[Any], Any] | None = None) -> None:
        self.cfg, self.seed, self.probe = cfg, seed, probe
        self.recorder: RoutingRecorder | None = None
        self._parts: list[tuple[float, float]] = []

    def on_model(self, model: Any, result: RunResult, train_blocks: Any) -> None:
        cfg = self.cfg
        counts = count_moe_params(model)
        result.extras.update(
            kind=f"top-{cfg.k}" if cfg.is_moe else "dense", num_experts=cfg.num_experts, k=cfg.k if cfg.is_moe else 0,
            capacity_factor=cfg.capacity_factor if cfg.is_moe else 0.0,
            aux_loss_coef=cfg.aux_loss_coef if cfg.is_moe else 0.0, params_total=counts.total,
            params_active=counts.active,
            flops_per_token=round(measure_flops_per_token(model, train_blocks[:2]["input_ids"]), 1),
            lm_losses=[], aux_losses=[], routing={}, load_history=[])
        self.recorder = RoutingRecorder(model)

    def param_groups(self, model: Any) -> list[dict[str, Any]]:
        return moe_param_groups(model)

    def after_forward(self, output: Any) -> None:
        self._parts.append((output.lm_loss.item(), output.aux_loss.item()))

    def after_step(self, step: int, result: RunResult) -> dict[str, str]:
        assert self.recorder is not None
        self.recorder.end_step()
        n = len(self._parts)
        lm, aux = sum(p[0] for p in self._parts) / n, sum(p[1] for p in self._parts) / n
        self._parts = []
        result.extras["lm_losses"].append(lm)
        result.extras["aux_losses"].append(aux)
        # the bar shows the aux loss per MoE layer (1.0 = even routing), as the notebook prints it; extras keep the sum
        per_layer = aux / max(len(self.cfg.moe_layers), 1)
        return {"loss": f"{lm:.3f}", **({"aux_per_layer": f"{per_layer:.3f}"} if self.cfg.is_moe else {})}

    def evaluate(self, model: Any, blocks: Any, runtime: "Runtime", batches: int, batch_size: int,
                 autocast: bool) -> float:
        return evaluate_moe(getattr(model, "module", model), blocks, batches, batch_size, self.seed)

    def finish(self, model: Any, result: RunResult) -> None:
        if self.cfg.is_moe and self.recorder is not None:
            result.extras["routing"] = self.recorder.summary().as_dict()
            result.extras["load_history"] = [step[0] for step in self.recorder.history()["kept"]]
        if self.probe is not None:
            result.extras["probe"] = self.probe(model)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None



def zero3_refusal(cfg: "GPTConfig", runtime: "Runtime", micro_batch: int = 2) -> str:
    """Try deepspeed.initialize on a MoE model with ZeRO stage 3; return DeepSpeed's refusal message (notebook 03).

    Raises RuntimeError if DeepSpeed accepts it (a newer version may): the notebook then says so.
    """
    import deepspeed

    from helpers.config import course_config

    from helpers.gpt import build_gpt

    setup_single_process()
    ns: dict[str, Any] = {"model": build_gpt(cfg)}
    config = course_config("zero3", runtime, micro_batch_size=micro_batch)
    try:
        ns["engine"], ns["optimizer"], _, _ = deepspeed.initialize(model=ns["model"],
                                                                   model_parameters=moe_param_groups(ns["model"]),
                                                                   config=config)
    except (AssertionError, ValueError, NotImplementedError, RuntimeError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = ""
    finally:
        teardown(ns, "engine", "optimizer", "model")
    if not message:
        raise RuntimeError("DeepSpeed accepted a native MoE model under ZeRO-3: this DeepSpeed version "
                           "supports it; the lesson's refusal no longer applies.")
    return message


# ---------------------------------------------------------------- expert parallelism


def expert_parallel_summary(model: Any) -> dict[str, Any]:
    """What this rank holds: its global expert ids per MoE layer and its parameter counts."""
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE

    from helpers.gpt import ep_rank

    net = getattr(model, "module", model)
    counts = count_moe_params(net)
    layers = {}
    for name, m in net.named_modules():
        if isinstance(m, MoE):
            n_local = m.num_local_experts
            group = m.deepspeed_moe.ep_group  # set by deepspeed.initialize
            rank_in_group = ep_rank(m.ep_size) if group is None or m.ep_size == 1 else dist.get_rank(group=group)
            layers[name] = list(range(rank_in_group * n_local, (rank_in_group + 1) * n_local))
    return {"experts_held": layers, "params_local": counts.local, "expert_params_local": counts.local_experts,
            "shared_params": counts.shared, "params_total": counts.total, "expert_params_total": counts.experts}


