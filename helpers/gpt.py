"""The course GPT: a small GPT-style causal LM, dense or with DeepSpeed MoE layers (notebooks 03 and 05).

In the manner of nanoGPT's model.py: torch at the top, the modules as top-level classes. `GPTConfig` is the
shape; `num_experts=0` is the dense model, and with experts every other block's MLP is
``deepspeed.moe.layer.MoE``. Each expert is ``ffn // k`` wide, so a token routed to its top-k experts goes
through exactly as many MLP weights as in the dense twin (equal active compute); the MoE model only *holds*
more parameters. `build_gpt(cfg, seed)` returns a model with the course's initialisation.

Notebook 03 trains it (dense vs MoE), notebook 05's lesson programs split it (data, pipeline, tensor and
expert parallelism). Not imported by ``import helpers`` (it imports torch); helpers.moe reads it lazily.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPTOutput", "MLP", "Attention", "Block", "GPT", "build_gpt", "ep_rank"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the course GPT; num_experts=0 is the dense model, num_experts > 0 puts DeepSpeed MoE layers in."""

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

    def dense_twin(self) -> "GPTConfig":
        """The same model with a dense MLP in every block: equal active compute per token."""
        return dataclasses.replace(self, num_experts=0, k=1, ep_size=1)

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    def check(self) -> "GPTConfig":
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

    loss: torch.Tensor | None  # lm_loss + aux_loss_coef * aux_loss (None without labels): what to call backward on
    lm_loss: torch.Tensor | None  # next-token cross-entropy
    aux_loss: torch.Tensor  # sum of the gates' load-balancing losses (0 for the dense model)
    logits: torch.Tensor


class MLP(nn.Module):
    """up, GELU, down; bias-free. A dense block's MLP, or one expert (width ffn // k)."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        # no biases: k experts of width ffn/k then hold exactly the weights of one dense MLP of width ffn
        self.up = nn.Linear(hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    """Causal self-attention with one fused qkv projection (scaled_dot_product_attention)."""

    def __init__(self, cfg: GPTConfig) -> None:
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
    """Pre-norm transformer block; its MLP is DeepSpeed's MoE layer when `moe`. Returns (x, aux loss or None)."""

    def __init__(self, cfg: GPTConfig, moe: bool) -> None:
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


class GPT(nn.Module):
    """The course GPT: token + position embeddings, `cfg.layers` blocks, an output layer tied to the embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
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


def build_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    """A fresh GPT-style model for `cfg` (dense if cfg.num_experts == 0), weights drawn from `seed`.

    Every expert gets weights of its own, drawn from (seed, block, global expert id): DeepSpeed copies one
    expert module num_experts times, so without this all experts would start equal. Global expert e holds
    the same weights whatever the ep_size, so an expert-parallel model is the same model, split.
    """
    cfg.check()
    torch.manual_seed(seed)
    model = GPT(cfg)
    n_resid = 2 * cfg.layers
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(n_resid) if name.endswith((".out", ".down")) else 0.02
            nn.init.normal_(module.weight, 0.0, std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    rank = ep_rank(cfg.ep_size)
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


def ep_rank(ep_size: int) -> int:
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


