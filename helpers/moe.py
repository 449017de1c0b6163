"""Mixture of Experts with DeepSpeed MoE, measured (notebook 03).

A small GPT-style causal LM whose MLP is ``deepspeed.moe.layer.MoE`` in every other block, and its
*dense twin*: the same model with an ordinary MLP everywhere. Each expert is ``ffn // k`` wide, so a
token routed to its top-k experts goes through exactly as many MLP weights as in the dense twin (equal
active compute); the MoE model only *holds* more parameters. Also here: total / active parameter
counts, the optimizer parameter groups DeepSpeed needs for MoE, expert load and dropped tokens read
from the gate (forward hooks on ``TopKGate``), a measured training run and the ZeRO-3 refusal.

DeepSpeed's gate returns, per forward, the expert each token's routes go to (-1 where the expert was
already full: a *dropped* route, the token then skips the MLP and keeps only its residual) and
``exp_counts``, the tokens each expert was asked for before the capacity limit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from helpers.memory import GiB, measure_peak
from helpers.runtime import reset_peak_stats, setup_single_process, teardown

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from helpers.hardware import Runtime

ZERO3_REFUSAL = "Native DeepSpeed MoE is not supported with ZeRO Stage 3"


@dataclass(frozen=True)
class MoEConfig:
    """Shape of the course's GPT-style model; num_experts=0 is the dense model (notebook 03)."""

    vocab_size: int = 8192
    seq_len: int = 256
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024  # dense MLP width; each expert is ffn // k wide (equal active compute)
    num_experts: int = 0  # 0: dense, no MoE layer
    k: int = 1  # experts per token (top-1 or top-2 gating)
    capacity_factor: float = 1.25  # expert capacity = ceil(k * tokens / experts * capacity_factor)
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    moe_every: int = 2  # blocks 1, 3, 5 ... get experts ("every other block", as in GShard / Switch)
    aux_loss_coef: float = 0.01  # loss = LM loss + aux_loss_coef * sum of the gates' load-balancing losses
    ep_size: int = 1  # expert-parallel ranks: each holds num_experts // ep_size experts
    drop_tokens: bool = True
    dropout: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_ffn(self) -> int:
        return self.ffn // self.k if self.is_moe else self.ffn

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the blocks whose MLP is a MoE layer."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.layers) if i % self.moe_every == self.moe_every - 1)

    @property
    def label(self) -> str:
        if not self.is_moe:
            return "dense"
        return f"MoE top-{self.k}, {self.num_experts} experts"

    def dense_twin(self) -> "MoEConfig":
        """The same model with a dense MLP in every block: equal active compute per token."""
        return dataclasses.replace(self, num_experts=0, k=1, ep_size=1)

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def check(self) -> "MoEConfig":
        """Raise ValueError with the fix when this shape cannot be built."""
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads}). "
                             "Fix: pick heads that divide hidden, e.g. hidden 256 with 4 heads.")
        if not self.is_moe:
            return self
        if self.k < 1 or self.k > self.num_experts:
            raise ValueError(f"k={self.k} experts per token with {self.num_experts} experts. "
                             "Fix: k=1 (Switch-style) or k=2 (GShard-style), at most num_experts.")
        if self.ffn % self.k:
            raise ValueError(f"ffn ({self.ffn}) must be divisible by k ({self.k}): each expert is ffn // k wide "
                             "so that active compute matches the dense model. Fix: an even ffn for k=2.")
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by ep_size ({self.ep_size}): "
                             "each expert-parallel rank holds the same number of experts. Fix: e.g. 8 experts "
                             "on ep_size 2 (4 per rank).")
        if not self.moe_layers:
            raise ValueError(f"no MoE block with layers={self.layers} and moe_every={self.moe_every}. "
                             "Fix: layers >= moe_every.")
        return self


class GPTOutput(NamedTuple):
    """What the model returns: the loss to train on and its two parts."""

    loss: Any  # lm_loss + aux_loss_coef * aux_loss (None without labels): what to call backward on
    lm_loss: Any  # next-token cross-entropy
    aux_loss: Any  # sum of the gates' load-balancing losses (0 for the dense model)
    logits: Any


@functools.cache
def _classes() -> dict[str, type]:
    """The torch modules, defined on first use so that importing helpers stays light."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, hidden: int, width: int) -> None:
            super().__init__()
            # no biases: k experts of width ffn/k then hold exactly the weights of one dense MLP of width ffn
            self.up = nn.Linear(hidden, width, bias=False)
            self.down = nn.Linear(width, hidden, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(F.gelu(self.up(x)))

    class Attention(nn.Module):
        def __init__(self, cfg: MoEConfig) -> None:
            super().__init__()
            self.head_dim = cfg.hidden // cfg.heads
            self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
            self.out = nn.Linear(cfg.hidden, cfg.hidden)
            self.dropout = cfg.dropout

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            # heads counted from qkv's output: under tensor parallelism (notebook 05) each rank holds some of them
            q, k, v = self.qkv(x).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
            return self.out(y.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self, cfg: MoEConfig, moe: bool) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(cfg.hidden)
            self.attn = Attention(cfg)
            self.ln2 = nn.LayerNorm(cfg.hidden)
            self.is_moe = moe
            if moe:
                from deepspeed.moe.layer import MoE

                self.mlp = MoE(hidden_size=cfg.hidden, expert=MLP(cfg.hidden, cfg.expert_ffn),
                               num_experts=cfg.num_experts, ep_size=cfg.ep_size, k=cfg.k,
                               capacity_factor=cfg.capacity_factor, eval_capacity_factor=cfg.eval_capacity_factor,
                               min_capacity=cfg.min_capacity, drop_tokens=cfg.drop_tokens)
            else:
                self.mlp = MLP(cfg.hidden, cfg.ffn)
            self.drop = nn.Dropout(cfg.dropout)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            x = x + self.drop(self.attn(self.ln1(x)))
            if self.is_moe:
                # DeepSpeed's MoE returns (output, l_aux, exp_counts)
                out, l_aux, _ = self.mlp(self.ln2(x))
            else:
                out, l_aux = self.mlp(self.ln2(x)), None
            return x + self.drop(out), l_aux

    class GPTMoE(nn.Module):
        def __init__(self, cfg: MoEConfig) -> None:
            super().__init__()
            self.cfg = cfg.check()
            self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
            self.blocks = nn.ModuleList(Block(cfg, i in cfg.moe_layers) for i in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.aux_loss_coef = cfg.aux_loss_coef

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> GPTOutput:
            s = input_ids.shape[1]
            if s > self.cfg.seq_len:
                raise ValueError(f"sequence of {s} tokens, the model has {self.cfg.seq_len} positions. "
                                 "Fix: pack blocks of at most seq_len tokens.")
            x = self.tok(input_ids) + self.pos(torch.arange(s, device=input_ids.device))
            aux = torch.zeros((), device=x.device, dtype=torch.float32)
            for block in self.blocks:
                x, l_aux = block(x)
                if l_aux is not None:
                    aux = aux + l_aux.float()
            logits = F.linear(self.ln_f(x), self.tok.weight)  # output layer tied to the embedding, as GPT-2
            if labels is None:
                return GPTOutput(None, None, aux, logits)
            lm_loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                      labels[:, 1:].reshape(-1))
            return GPTOutput(lm_loss + self.aux_loss_coef * aux, lm_loss, aux, logits)

    return {"MLP": MLP, "Attention": Attention, "Block": Block, "GPTMoE": GPTMoE}


def build_gpt_moe(cfg: MoEConfig, seed: int = 0) -> Any:
    """A fresh GPT-style model for `cfg` (dense if cfg.num_experts == 0), weights drawn from `seed`.

    Every expert gets weights of its own, drawn from (seed, block, global expert id): DeepSpeed copies one
    expert module num_experts times, so without this all experts would start equal. Global expert e holds
    the same weights whatever the ep_size, so an expert-parallel model is the same model, split.
    """
    import torch
    from torch import nn

    cfg.check()
    torch.manual_seed(seed)
    model = _classes()["GPTMoE"](cfg)
    n_resid = 2 * cfg.layers
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(n_resid) if name.endswith((".out", ".down")) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    rank = _ep_rank(cfg.ep_size)
    for layer in cfg.moe_layers:
        experts = model.blocks[layer].mlp.deepspeed_moe.experts.deepspeed_experts
        for local, expert in enumerate(experts):
            global_id = rank * len(experts) + local
            gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 1_009 + global_id)
            with torch.no_grad():
                expert.up.weight.copy_(torch.randn(expert.up.weight.shape, generator=gen) * 0.02)
                expert.down.weight.copy_(torch.randn(expert.down.weight.shape, generator=gen)
                                         * (0.02 / math.sqrt(n_resid)))
    return model


def _ep_rank(ep_size: int) -> int:
    """This process's position in its expert-parallel group (ranks are grouped consecutively)."""
    if ep_size <= 1:
        return 0
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 0
    if world < ep_size or world % ep_size:
        raise RuntimeError(f"ep_size={ep_size} needs torch.distributed initialised with a multiple of {ep_size} "
                           f"processes before the model is built (found {world or 'none'}). Fix: call "
                           "deepspeed.init_distributed() first, under a launcher (torchrun / deepspeed) "
                           f"with {ep_size} or a multiple of {ep_size} processes.")
    return dist.get_rank() % ep_size


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
    """Total, active-per-token and local parameter counts, read from the modules."""
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
    """Optimizer parameter groups with the experts split off, as DeepSpeed's ZeRO needs for MoE.

    Expert parameters are reduced over the expert-data-parallel group, not the whole data-parallel group,
    so ZeRO keeps them in groups of their own (marked 'moe': True), built here by DeepSpeed's
    split_params_into_different_moe_groups_for_optimizer. A dense model gets its one group back.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    group = {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters",
             "weight_decay": weight_decay}
    return split_params_into_different_moe_groups_for_optimizer(group)


def describe_param_groups(groups: Sequence[dict[str, Any]]) -> str:
    """One line per optimizer group: name, MoE or not, tensors and parameters."""
    lines = []
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        lines.append(f"{g.get('name', '?'):<16} moe={str(bool(g.get('moe', False))):<6} "
                     f"{len(g['params']):>4} tensors {n:>12,} parameters")
    return "\n".join(lines)


def measure_flops_per_token(model: Any, input_ids: Any) -> float:
    """Forward FLOPs per token as PyTorch's FlopCounterMode counts them (matrix multiplies).

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


def expert_capacity(cfg: MoEConfig, tokens: int) -> int:
    """Slots per expert for `tokens` tokens at training time, as DeepSpeed's gate computes them.

    ceil(tokens / num_experts x capacity_factor x k), at least min_capacity (float32, like the gate).
    """
    import torch

    if not cfg.is_moe:
        return 0
    c = torch.ceil((tokens / cfg.num_experts) * torch.tensor(cfg.capacity_factor * cfg.k)).to(torch.int64)
    return int(torch.maximum(c, torch.tensor(cfg.min_capacity)))


def analytic_flops_per_token(cfg: MoEConfig, tokens: int | None = None) -> float:
    """Forward matmul FLOPs per token, counted from the shapes: 2 x multiply-adds of every linear layer.

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

            if len(output) != 7:
                raise RuntimeError("RoutingRecorder expects DeepSpeed's sparse-route gate output (7 values: "
                                   "l_aux, capacity, experts, indices, locations, gates, exp_counts); this "
                                   f"DeepSpeed version returned {len(output)}. Fix: deepspeed==0.19.8.")
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


def set_capacity_factor(model: Any, factor: float) -> None:
    """Set every MoE gate's training and evaluation capacity factor (for a sweep)."""
    from deepspeed.moe.sharded_moe import TopKGate

    for m in getattr(model, "module", model).modules():
        if isinstance(m, TopKGate):
            m.capacity_factor = factor
            m.eval_capacity_factor = factor


# ---------------------------------------------------------------- training


@dataclass
class MoERun:
    """One measured training run of a dense or MoE model (a row of reports/moe.json)."""

    name: str
    kind: str  # "dense", "top-1", "top-2"
    num_experts: int
    k: int
    capacity_factor: float
    aux_loss_coef: float
    params_total: int
    params_active: int
    flops_per_token: float  # measured forward FLOPs per token (FlopCounterMode)
    precision: str
    micro_batch: int
    seq_len: int
    steps: int
    runtime: str
    losses: list[float] = field(default_factory=list)  # training loss (LM + coef x aux)
    lm_losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_vram_gib: float = 0.0
    peak_rss_gib: float = 0.0
    seconds: float = 0.0
    routing: dict[str, Any] = field(default_factory=dict)  # RoutingSummary.as_dict()
    probe: Any = None  # what train_moe's `probe(model)` returned after training
    load_history: list[list[int]] = field(default_factory=list)  # first MoE layer: kept routes per expert per step

    @property
    def val_loss(self) -> float:
        return self.val_losses[-1][1] if self.val_losses else math.nan

    def as_dict(self, with_curves: bool = True) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["val_loss"] = self.val_loss
        d["expert_load"] = self.routing.get("load", [])
        d.pop("probe")
        if not with_curves:
            for key in ("losses", "lm_losses", "aux_losses", "load_history"):
                d.pop(key)
        return d


def moe_table(runs: Sequence[MoERun]) -> str:
    """Fixed-width comparison: parameters, FLOPs, tokens/s, peak VRAM, losses, dropped share."""
    head = (f"{'run':<24}{'total M':>9}{'active M':>9}{'MFLOP/tok':>10}{'tokens/s':>10}{'peak GiB':>9}"
            f"{'loss0':>7}{'lossN':>7}{'val':>7}{'dropped':>8}")
    lines = [head, "-" * len(head)]
    for r in runs:
        dropped = r.routing.get("dropped_fraction")
        lines.append(f"{r.name:<24}{r.params_total / 1e6:>9.3f}{r.params_active / 1e6:>9.3f}"
                     f"{r.flops_per_token / 1e6:>10.2f}{r.tokens_per_s:>10,.0f}{r.peak_vram_gib:>9.3f}"
                     f"{r.lm_losses[0]:>7.3f}{sum(r.lm_losses[-5:]) / len(r.lm_losses[-5:]):>7.3f}"
                     f"{r.val_loss:>7.3f}" + (f"{100 * dropped:>7.1f}%" if dropped is not None else f"{'-':>8}"))
    return "\n".join(lines)


def _autocast_dtype(precision: str) -> Any:
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def evaluate_moe(model: Any, blocks: Any, batches: int = 4, batch_size: int = 8, seed: int = 0) -> float:
    """Mean LM loss (aux loss left out) over the first `batches` batches of `blocks`, without gradients.

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
    """For each capacity factor: dropped share of routes and LM loss on `blocks` (the model is restored)."""
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
    """The course's ZeRO config for these runs: linear warm-up over a tenth of the steps; fp16 starts at 2^12.

    A 2^16 initial loss scale (DeepSpeed's default) overflows and skips the first steps of a short run.
    """
    from helpers.config import course_config

    cfg = course_config(f"zero{stage}", runtime, micro_batch_size=micro_batch, lr=lr,
                        warmup_steps=max(1, steps // 10), world_size=world_size)
    if "fp16" in cfg:
        cfg["fp16"]["initial_scale_power"] = 12
    return cfg


def train_moe(name: str, cfg: MoEConfig, train_blocks: Any, *, runtime: "Runtime", ds_config: dict[str, Any],
              val_blocks: Any = None, steps: int = 50, eval_every: int = 0, eval_batches: int = 4,
              warmup_steps: int = 2, seed: int = 0, progress: bool = True,
              probe: Callable[[Any], Any] | None = None) -> MoERun:
    """Train a fresh model of shape `cfg` with DeepSpeed for `steps` steps; measure it and tear it down.

    The optimizer gets `moe_param_groups`; the loss is LM loss + cfg.aux_loss_coef x aux loss; the gates'
    routing is recorded every step. Peak GPU memory is measured above the idle baseline, tokens/s after
    `warmup_steps`. `probe(model)`, if given, runs on the trained model before the teardown (e.g. a
    `capacity_sweep`); its result is kept in `MoERun.probe`.
    """
    import torch

    micro_batch = int(ds_config["train_micro_batch_size_per_gpu"])
    seq_len = int(train_blocks[0]["input_ids"].shape[-1])
    setup_single_process()
    reset_peak_stats()
    run = MoERun(name=name, kind=f"top-{cfg.k}" if cfg.is_moe else "dense", num_experts=cfg.num_experts,
                 k=cfg.k if cfg.is_moe else 0, capacity_factor=cfg.capacity_factor if cfg.is_moe else 0.0,
                 aux_loss_coef=cfg.aux_loss_coef if cfg.is_moe else 0.0, params_total=0, params_active=0,
                 flops_per_token=0.0, precision=runtime.precision, micro_batch=micro_batch, seq_len=seq_len,
                 steps=steps, runtime=runtime.label)
    ns: dict[str, Any] = {}
    try:
        with measure_peak() as mem:
            _train_moe(ns, run, cfg, train_blocks, runtime, ds_config, val_blocks, steps, eval_every, eval_batches,
                       warmup_steps, seed, progress)
        if probe is not None:
            run.probe = probe(ns["engine"].module)
    finally:  # an interrupted run is torn down too
        if ns.get("recorder") is not None:
            ns["recorder"].remove()
        teardown(ns, "recorder", "engine", "optimizer", "model")
    if torch.cuda.is_available():
        run.peak_vram_gib = round((mem.peak_gpu_allocated - mem.baseline_gpu_allocated) / GiB, 4)
    run.peak_rss_gib = round(mem.peak_rss / GiB, 3)
    return run


def _train_moe(ns: dict[str, Any], run: MoERun, cfg: MoEConfig, train_blocks: Any, runtime: "Runtime",
               ds_config: dict[str, Any], val_blocks: Any, steps: int, eval_every: int, eval_batches: int,
               warmup_steps: int, seed: int, progress: bool) -> None:
    """The loop of `train_moe`; every object it makes is kept in `ns`, for the teardown."""
    import deepspeed
    import torch
    from tqdm.auto import tqdm

    from helpers.data import block_loader

    device = "cuda" if runtime.has_gpu else "cpu"
    batches = block_loader(train_blocks, run.micro_batch, seed=seed)
    ns["model"] = model = build_gpt_moe(cfg, seed=seed)
    counts = count_moe_params(model)
    run.params_total, run.params_active = counts.total, counts.active
    run.flops_per_token = round(measure_flops_per_token(model, train_blocks[:2]["input_ids"]), 1)
    ns["recorder"] = recorder = RoutingRecorder(model)
    ns["engine"], ns["optimizer"], _, _ = deepspeed.initialize(model=model, model_parameters=moe_param_groups(model),
                                                               config=ds_config)
    del model
    engine = ns["engine"]
    engine.train()
    tokens_per_step = run.micro_batch * run.seq_len
    timed_from = None
    bar = tqdm(range(steps), desc=run.name, disable=not progress)
    start = time.perf_counter()
    for step in bar:
        if step == warmup_steps:
            if runtime.has_gpu:
                torch.cuda.synchronize()
            timed_from = time.perf_counter()
        ids = next(batches)["input_ids"].to(device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        recorder.end_step()
        run.losses.append(out.loss.item())
        run.lm_losses.append(out.lm_loss.item())
        run.aux_losses.append(out.aux_loss.item())
        postfix = {"loss": f"{run.lm_losses[-1]:.3f}"}
        if cfg.is_moe:
            postfix["aux"] = f"{run.aux_losses[-1]:.3f}"
        if timed_from is not None and step > warmup_steps:
            postfix["tok_s"] = f"{(step - warmup_steps) * tokens_per_step / (time.perf_counter() - timed_from):,.0f}"
        bar.set_postfix(postfix)
        del out, ids
        if val_blocks is not None and ((eval_every and (step + 1) % eval_every == 0) or step + 1 == steps):
            run.val_losses.append((step + 1, evaluate_moe(engine.module, val_blocks, eval_batches, run.micro_batch,
                                                          seed)))
            engine.train()
    if runtime.has_gpu:
        torch.cuda.synchronize()
    end = time.perf_counter()
    if timed_from is not None and steps > warmup_steps:
        run.tokens_per_s = round((steps - warmup_steps) * tokens_per_step / (end - timed_from), 1)
    run.seconds = round(end - start, 2)
    if cfg.is_moe:
        summary = recorder.summary()
        run.routing = summary.as_dict()
        run.load_history = [step[0] for step in recorder.history()["kept"]]


def zero3_refusal(cfg: MoEConfig, runtime: "Runtime", micro_batch: int = 2) -> str:
    """Try deepspeed.initialize on a MoE model with ZeRO stage 3; return DeepSpeed's refusal message.

    Raises RuntimeError if DeepSpeed accepts it (a newer version may): the notebook then says so.
    """
    import deepspeed

    from helpers.config import course_config

    setup_single_process()
    ns: dict[str, Any] = {"model": build_gpt_moe(cfg)}
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

    net = getattr(model, "module", model)
    counts = count_moe_params(net)
    layers = {}
    for name, m in net.named_modules():
        if isinstance(m, MoE):
            n_local = m.num_local_experts
            group = m.deepspeed_moe.ep_group  # set by deepspeed.initialize
            rank_in_group = _ep_rank(m.ep_size) if group is None or m.ep_size == 1 else dist.get_rank(group=group)
            layers[name] = list(range(rank_in_group * n_local, (rank_in_group + 1) * n_local))
    return {"experts_held": layers, "params_local": counts.local, "expert_params_local": counts.local_experts,
            "shared_params": counts.shared, "params_total": counts.total, "expert_params_total": counts.experts}


# ---------------------------------------------------------------- plots


def _figure(width: float = 7.0, height: float = 3.8) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def plot_expert_load(history: Sequence[Sequence[int]], title: str = "Tokens per expert over training",
                     capacity: float | None = None) -> "Figure":
    """Routes each expert processed per step (one line per expert), with the capacity as a dashed line."""
    fig = _figure()
    ax = fig.add_subplot()
    steps = range(1, len(history) + 1)
    for e in range(len(history[0]) if history else 0):
        ax.plot(steps, [row[e] for row in history], label=f"expert {e}", linewidth=1.2)
    if capacity:
        ax.axhline(capacity, color="#C44E52", linestyle="--", label="capacity per step")
    ax.set_xlabel("step")
    ax.set_ylabel("routes processed")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    return fig


def plot_capacity_sweep(rows: Sequence[dict[str, float]], title: str = "Capacity factor") -> "Figure":
    """Dropped share of routes (bars) and validation loss (line) against the capacity factor."""
    fig = _figure()
    ax = fig.add_subplot()
    x = [str(r["capacity_factor"]) for r in rows]
    ax.bar(x, [100 * r["dropped_fraction"] for r in rows], color="#DD8452", label="dropped routes %")
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("dropped routes (%)")
    ax2 = ax.twinx()
    ax2.plot(x, [r["val_loss"] for r in rows], color="#4C72B0", marker="o", label="validation loss")
    ax2.set_ylabel("validation loss")
    ax2.ticklabel_format(axis="y", useOffset=False)
    ax.set_title(title)
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8)
    return fig


def plot_balance(runs: Sequence[MoERun], title: str = "Share of routes per expert") -> "Figure":
    """For each run: the share of routes each expert was asked for (first MoE layer), as grouped bars."""
    fig = _figure()
    ax = fig.add_subplot()
    n = len(runs)
    width = 0.8 / max(n, 1)
    for i, r in enumerate(runs):
        row = r.routing["demand"][0]
        total = sum(row) or 1
        ax.bar([e + (i - (n - 1) / 2) * width for e in range(len(row))], [100 * c / total for c in row], width,
               label=r.name)
    if runs:
        ax.axhline(100 / runs[0].num_experts, color="#555555", linestyle="--", label="even")
    ax.set_xlabel("expert")
    ax.set_ylabel("% of routes")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_params(names: Sequence[str], total: Sequence[int], active: Sequence[int],
                title: str = "Parameters: held vs used per token") -> "Figure":
    """Total (held) and active (per token) parameters per model, side by side, in millions."""
    fig = _figure(6, 3.5)
    ax = fig.add_subplot()
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [t / 1e6 for t in total], 0.4, label="total (held)", color="#4C72B0")
    ax.bar([i + 0.2 for i in x], [a / 1e6 for a in active], 0.4, label="active (per token)", color="#55A868")
    ax.set_xticks(list(x), list(names))
    ax.set_ylabel("million parameters")
    ax.set_title(title)
    ax.legend()
    return fig


@contextlib.contextmanager
def quiet_deepspeed(level: int = 30) -> Any:
    """Lower DeepSpeed's logger to WARNING inside the block (MoE logs a line per layer)."""
    from deepspeed.utils import logger

    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)
