"""Activation memory against sequence length: what a decoder keeps for backward, by component, and what DeepSpeed's
single-GPU long-sequence tools remove (notebook 06, issue 26).

    shape = helpers.long_context_shape(config)                      # a Llama-shaped Hugging Face config
    est = helpers.estimate_saved_activations(shape, seq_len=4096, checkpointing=True)
    print(est.table())                                              # bytes kept for backward, GPU and CPU
    measured = helpers.saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss)

ZeRO shards the model states; activations grow with the sequence instead, so they are the next wall. What a Llama
decoder layer (transformers' LlamaDecoderLayer, SDPA attention, which keeps no seq x seq score matrix) saves for
backward, per token, with `e` bytes per element of the model's dtype, hidden size h, MLP width i, a attention heads
of head size d and kv key/value heads (RMSNorm computes in fp32 whatever the dtype):

- norms (two per layer): e*h input + 4*h normalised fp32 + 4 (the rsqrt), each;
- attention: e*h (the q/k/v projections' input) + 2*e*h (q after RoPE, the attention output) + 2*e*kv*d (k, v)
  + 4*a (the attention's logsumexp, fp32);
- MLP (SwiGLU): e*h (gate/up input) + 4*e*i (gate output, its SiLU, up output, their product);
- RoPE's cos and sin: 2*e*d, once for all layers;
- the head: the final norm, the lm_head's input e*h, and the loss's log-softmax over the vocabulary V in fp32, 4*V,
  plus the int64 labels: with a 32k vocabulary the loss alone is as large as several layers.

Checked against what autograd really saves (`saved_activation_bytes`, tests/test_long_context.py). The techniques
change the terms: activation checkpointing keeps only each layer's input (e*h) and recomputes one layer at a time in
backward; DeepSpeed's `TiledMLP` keeps only the MLP's input; `TiledFusedLogitsLoss` never holds the whole logits
(it keeps the gradient of the head's input, e*h); offloading the checkpoints moves the layer inputs to CPU RAM.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["ActivationEstimate", "LongContextShape", "estimate_saved_activations", "long_context_shape",
           "saved_activation_bytes", "tiled_causal_lm_loss", "tiled_mlp"]


@dataclass(frozen=True)
class LongContextShape:
    """What the activation estimate needs of a Llama-shaped decoder."""

    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


def long_context_shape(config: Any) -> LongContextShape:
    """The shape of a Hugging Face Llama-style config (LlamaConfig, or any with the same field names)."""
    return LongContextShape(hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
                            n_layers=int(config.num_hidden_layers), n_heads=int(config.num_attention_heads),
                            n_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
                            vocab=int(config.vocab_size))


@dataclass
class ActivationEstimate:
    """Bytes kept for backward at the end of the forward pass, by component, on the GPU and in CPU RAM."""

    seq_len: int
    batch: int
    techniques: tuple[str, ...]
    gpu: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())

    def table(self) -> str:
        """The components as aligned text lines, GPU then CPU (notebook 06)."""
        what = ", ".join(self.techniques) or "plain"
        lines = [f"kept for backward, {self.batch} x {self.seq_len:,} tokens ({what}):"]
        for where, parts in (("GPU", self.gpu), ("CPU", self.cpu)):
            for name, b in parts.items():
                lines.append(f"  {where} {name:<28} {b / 2**20:12,.1f} MiB")
        lines.append(f"  GPU total {self.gpu_total / 2**30:32,.3f} GiB" + (
            f"; CPU {self.cpu_total / 2**30:,.3f} GiB" if self.cpu else ""))
        return "\n".join(lines)


def _rms_norm_bytes(h: int, e: int) -> int:
    """Bytes per token one RMSNorm keeps: its e-byte input, the fp32 normalised values and the fp32 rsqrt."""
    return e * h + 4 * h + 4


def _layer_parts(shape: LongContextShape, e: int) -> dict[str, int]:
    """Bytes per token one decoder layer keeps for backward, by part (see the module docstring)."""
    h, i, a = shape.hidden, shape.intermediate, shape.n_heads
    kv_width = shape.n_kv_heads * shape.head_dim
    return {"norms": 2 * _rms_norm_bytes(h, e),
            "attention": e * h + 2 * e * h + 2 * e * kv_width + 4 * a,
            "mlp": e * h + 4 * e * i}


def estimate_saved_activations(shape: LongContextShape, seq_len: int, batch: int = 1, *, precision_bytes: int = 2,
                               checkpointing: bool = False, tiled_mlp: bool = False, tiled_logits: bool = False,
                               offload_checkpoints: bool = False) -> ActivationEstimate:
    """Bytes autograd keeps for backward after one forward of `batch` x `seq_len` tokens (notebook 06).

    `precision_bytes`: the model dtype's element size (2 for fp16/bf16, 4 for fp32). The techniques, each as
    DeepSpeed / transformers implement it: `checkpointing` (gradient_checkpointing_enable: each layer keeps its input
    only), `tiled_mlp` (DeepSpeed's TiledMLP: the MLP keeps its input only), `tiled_logits` (TiledFusedLogitsLoss:
    no logits kept, the gradient of the head's input instead), `offload_checkpoints` (with checkpointing: the layer
    inputs in CPU RAM). Not counted here: the transient peaks of backward (one layer recomputed, the logits' gradient).
    """
    for name, value in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number of tokens, got {value!r} (e.g. {name}=4096)")
    if precision_bytes not in (2, 4):
        raise ValueError(f"precision_bytes is 2 (fp16, bf16) or 4 (fp32), got {precision_bytes!r}")
    if offload_checkpoints and not checkpointing:
        raise ValueError("offload_checkpoints moves the checkpoints of activation checkpointing to CPU RAM: "
                         "pass checkpointing=True with it")
    e, h, tokens = precision_bytes, shape.hidden, seq_len * batch
    techniques = tuple(name for name, on in (("checkpointing", checkpointing), ("tiled MLP", tiled_mlp),
                                             ("tiled logits + loss", tiled_logits),
                                             ("checkpoints on CPU", offload_checkpoints)) if on)
    est = ActivationEstimate(seq_len, batch, techniques)
    if checkpointing:
        (est.cpu if offload_checkpoints else est.gpu)["layer inputs (checkpoints)"] = shape.n_layers * e * h * tokens
    else:
        parts = _layer_parts(shape, e)
        if tiled_mlp:
            parts["mlp"] = e * h
        for name, b in parts.items():
            est.gpu[f"layers: {name}"] = shape.n_layers * b * tokens
        est.gpu["RoPE cos/sin"] = 2 * e * shape.head_dim * tokens
    est.gpu["final norm"] = _rms_norm_bytes(h, e) * tokens
    if tiled_logits:
        est.gpu["head: gradient of its input"] = e * h * tokens
    else:
        est.gpu["head: lm_head input"] = e * h * tokens
        est.gpu["loss: log-softmax (fp32)"] = 4 * shape.vocab * tokens
    est.gpu["labels (int64)"] = 2 * 8 * tokens  # the labels and their shifted copy
    return est


def saved_activation_bytes(forward: Callable[[], Any], exclude: Any = ()) -> tuple[int, Any]:
    """(bytes, forward's result): the distinct storages autograd holds for backward when `forward()` returns, the
    tensors of `exclude` (e.g. `model.parameters()`) left out - the measured side of `estimate_saved_activations`.
    A tensor saved and released again inside the forward (TiledFusedLogitsLoss runs each shard's backward there)
    does not count."""
    import weakref

    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, tuple[int, list[Any]]] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1].append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    alive = sum(nbytes for nbytes, refs in saved.values() if any(r() is not None for r in refs))
    return alive, out


def _shards(seq_len: int, tile: int) -> int:
    return max(1, -(-seq_len // tile))


@contextmanager
def tiled_mlp(tile_tokens: int | None = None) -> Iterator[None]:
    """Inside the block, every transformers LlamaMLP runs through DeepSpeed's `TiledMLP` (notebook 06): the sequence
    in slices of `tile_tokens` (default: the hidden size, as DeepSpeed's example), only the MLP's input kept for
    backward, each slice recomputed there. Restores LlamaMLP.forward on leaving, also after an error."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    if tile_tokens is not None and (not isinstance(tile_tokens, int) or tile_tokens < 1):
        raise ValueError(f"tile_tokens must be a positive whole number of tokens or None, got {tile_tokens!r}")
    original = modeling_llama.LlamaMLP.forward

    def mlp(self: Any, x: Any) -> Any:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self: Any, x: Any) -> Any:
        shards = _shards(x.shape[-2], tile_tokens or x.shape[-1])
        params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        return TiledMLP.apply(mlp, self, x, shards, params)

    modeling_llama.LlamaMLP.forward = forward
    try:
        yield
    finally:
        modeling_llama.LlamaMLP.forward = original


def tiled_causal_lm_loss(model: Any, input_ids: Any, tile_tokens: int = 1024) -> Any:
    """The next-token loss of a transformers causal LM without its whole logits (notebook 06): the decoder's hidden
    states, then DeepSpeed's `TiledFusedLogitsLoss` over slices of `tile_tokens` positions (lm_head, fp32
    cross-entropy, the slice's backward at once; mean over the slices, as the model's own loss for equal slices)."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive whole number of tokens, got {tile_tokens!r}")
    hidden = model.model(input_ids=input_ids).last_hidden_state
    x, y = hidden[:, :-1], input_ids[:, 1:]

    def loss(lm: Any, x_slice: Any, y_slice: Any) -> Any:
        logits = lm.lm_head(x_slice).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_slice.reshape(-1))

    shards = _shards(x.shape[0] * x.shape[1], tile_tokens)
    return TiledFusedLogitsLoss.apply(loss, model, x, y, None, shards, [model.lm_head.weight], "mean")
