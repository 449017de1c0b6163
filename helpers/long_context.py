"""Activation memory against sequence length: what a decoder keeps for backward, by component, and what DeepSpeed's
single-GPU long-sequence tools remove (notebook 06, issue 26).

    shape = helpers.long_context_shape(config)                      # a Llama-shaped Hugging Face config
    est = helpers.long_context.estimate_saved_activations(shape, seq_len=4096, checkpointing=True)
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

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["estimate_long_context_run", "long_context_shape", "ladder_verdict", "measured_peak_bytes",
           "predict_longest_seq_len", "release_cpu_checkpoints", "require_fused_attention", "saved_activation_bytes",
           "use_expandable_segments"]

# The rungs of notebook 06, each adding one technique to the one before: name -> estimate_activation_peak's flags.
TECHNIQUES: dict[str, dict[str, bool]] = {
    "plain": {},
    "checkpointing": {"checkpointing": True},
    "+ tiled logits": {"checkpointing": True, "tiled_logits": True},
    "+ tiled MLP": {"checkpointing": True, "tiled_logits": True, "tiled_mlp": True},
    "+ checkpoints on CPU": {"checkpointing": True, "tiled_logits": True, "tiled_mlp": True,
                             "offload_checkpoints": True},
}

# Bytes per token of the backward's transients that the saved-tensor count does not see, from the GPU probe of
# 2026-12-03 (246M Llama, fp16; docs/decisions.md, "Memory estimates"): the untiled loss's backward holds the
# log-softmax's gradient and the logits' gradient, fp32, beside the saved log-softmax (8 V per token over what is
# saved, 4 + 4); one logits tile of TiledFusedLogitsLoss holds its fp16 and fp32 logits, log-softmax and gradients
# (12 V per tile token); a layer's backward holds the gradients being formed: about 5 hidden-sized tensors per token
# (the gradient flowing back, q, k, v and MLP-input gradients), 6 with TiledMLP (its input's gradient is accumulated
# tile by tile).
LOSS_BACKWARD_BYTES_PER_VOCAB = 8
LOGITS_TILE_BYTES_PER_VOCAB = 12
LAYER_GRADIENT_HIDDENS = 5
# DeepSpeed's offload engine for cpu_checkpointing (checkpointing.py: keep_last_count=1; offload_activations.py:
# max_fwd_stash_count=2): the newest layer input stays on the GPU and the two before it keep their GPU copies as
# the source of the (asynchronous) copy, which backward then uses instead of copying back
OFFLOAD_INPUTS_KEPT_ON_GPU = 3


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


def long_context_config(vocab: int, *, hidden: int = 1024, intermediate: int = 2816, layers: int = 16,
                        heads: int = 16, kv_heads: int | None = None, max_positions: int = 1 << 20) -> Any:
    """A Llama-shaped transformers config built here, offline (notebook 06): RoPE positions (no learned position
    table, so no 1024-token limit as GPT-2's), `kv_heads` key/value heads (default: `heads`; fewer is grouped-query
    attention), SwiGLU MLP, RMSNorm, untied head. The defaults give ~222M parameters with the course's 8192-token
    vocabulary: 3.6 GB of model states in fp16 with Adam, a quarter of a T4, so the rest is left to activations.

    Every query head has its own key/value head by default: on a T4, PyTorch (2.13 and Colab's 2.11 at least) runs
    grouped-query attention only in its math kernel, which keeps a sequence x sequence matrix (`attention_kernel`).
    The head size (hidden / heads) is a multiple of 8: RoPE rotates pairs, and the fused attention kernels read 8
    fp16 values at a time."""
    from transformers import LlamaConfig

    kv_heads = heads if kv_heads is None else kv_heads
    for name, value in (("vocab", vocab), ("hidden", hidden), ("intermediate", intermediate), ("layers", layers),
                        ("heads", heads), ("kv_heads", kv_heads), ("max_positions", max_positions)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if hidden % (8 * heads) or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of 8 x heads ({heads}: a head size that is a multiple "
                         f"of 8) and heads a multiple of kv_heads ({kv_heads}): e.g. "
                         f"hidden={8 * heads * max(1, hidden // (8 * heads))}, "
                         f"kv_heads={kv_heads if heads % kv_heads == 0 else heads}")
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                       tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)


def long_context_shape(config: Any) -> LongContextShape:
    """The shape of a Hugging Face Llama-style config (LlamaConfig, or any with the same field names) (notebook 06)."""
    return LongContextShape(hidden=int(config.hidden_size), intermediate=int(config.intermediate_size),
                            n_layers=int(config.num_hidden_layers), n_heads=int(config.num_attention_heads),
                            n_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
                            vocab=int(config.vocab_size))


def attention_kernel(config: Any, dtype: Any) -> str:
    """The kernel PyTorch's `scaled_dot_product_attention` picks on this GPU for the model's causal attention with no
    mask, asked the way transformers calls it (`enable_gqa=True`): "flash", "efficient" (memory-efficient: all a T4
    has), "cudnn", or "math" (no fused kernel: it keeps a sequence x sequence score matrix per head); "cpu" without
    a GPU (notebook 06). Asked of PyTorch itself (`torch.backends.cuda.can_use_*_attention`) on 128-token tensors, so
    it follows this GPU, this torch and the kernels switched off (T4 budget mode switches off flash and cuDNN)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    shape = long_context_shape(config)
    q = torch.zeros(1, shape.n_heads, 128, shape.head_dim, device="cuda", dtype=dtype, requires_grad=True)
    kv = torch.zeros(1, shape.n_kv_heads, 128, shape.head_dim, device="cuda", dtype=dtype, requires_grad=True)
    params = torch.backends.cuda.SDPAParams(q, kv, kv, None, 0.0, True, True)
    b = torch.backends.cuda
    for name, usable in (("flash", b.flash_sdp_enabled() and b.can_use_flash_attention(params, False)),
                         ("efficient", b.mem_efficient_sdp_enabled() and b.can_use_efficient_attention(params, False)),
                         ("cudnn", hasattr(b, "can_use_cudnn_attention") and b.cudnn_sdp_enabled()
                          and b.can_use_cudnn_attention(params, False))):
        if usable:
            return name
    return "math"


def require_fused_attention(config: Any, dtype: Any) -> str:
    """`attention_kernel`, refusing "math" with the fix (notebook 06, before any model is built): without a fused
    kernel, attention keeps a sequence x sequence matrix per head and long sequences cannot fit."""
    kernel = attention_kernel(config, dtype)
    if kernel != "math":
        return kernel
    import torch

    shape = long_context_shape(config)
    e = torch.finfo(dtype).bits // 8
    scores = shape.n_heads * 16384**2 * e / 2**30
    why = (f"PyTorch {torch.__version__} on this GPU has no fused attention kernel for {shape.n_heads} query heads "
           f"sharing {shape.n_kv_heads} key/value heads of size {shape.head_dim}")
    fixes = [(dict(kv_heads=shape.n_heads), "every query head its own key/value head (FlashAttention, which runs "
              "grouped-query attention, needs compute capability 8.0+; a T4 is 7.5)"),
             (dict(kv_heads=shape.n_heads, hidden=shape.n_heads * 64), "head size 64")]
    for change, what in fixes:
        candidate = long_context_config(config.vocab_size, hidden=change.get("hidden", shape.hidden),
                                        intermediate=shape.intermediate, layers=shape.n_layers, heads=shape.n_heads,
                                        kv_heads=change["kv_heads"])
        if attention_kernel(candidate, dtype) != "math":
            fix = ", ".join(f"{k}={v}" for k, v in change.items())
            raise ValueError(f"{why}: scaled_dot_product_attention would run its math kernel, which keeps a sequence x "
                             f"sequence score matrix per head (at least {scores:.0f} GiB at 16,384 tokens). Fix: {fix} "
                             f"({what}; in notebook 06's parameters cell: {fix.upper().replace('=', ' = ')})")
    raise ValueError(f"{why}, nor for any head shape tried: scaled_dot_product_attention would run its math kernel "
                     f"(at least {scores:.0f} GiB of scores at 16,384 tokens). Fix: a GPU whose PyTorch build has "
                     "FlashAttention or the memory-efficient kernel (python -c 'import torch; "
                     "print(torch.backends.cuda.mem_efficient_sdp_enabled())')")


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


def _shards(seq_len: int, tile: int) -> int:
    return max(1, -(-seq_len // tile))


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


@dataclass
class ActivationPeak:
    """The activation part of a training step's peak GPU memory: what is kept for backward (`saved`) plus the larger
    of backward's transients; CPU RAM the offloaded checkpoints take (page-locked)."""

    saved: ActivationEstimate
    transients: dict[str, int] = field(default_factory=dict)
    cpu_pinned_bytes: int = 0

    @property
    def gpu_peak(self) -> int:
        return self.saved.gpu_total + max(self.transients.values(), default=0)

    @property
    def peak_transient(self) -> str:
        return max(self.transients, key=self.transients.__getitem__) if self.transients else ""


def estimate_activation_peak(shape: LongContextShape, seq_len: int, batch: int = 1, *, precision_bytes: int = 2,
                             checkpointing: bool = False, tiled_mlp: bool = False, tiled_logits: bool = False,
                             offload_checkpoints: bool = False, logits_tile_tokens: int = 1024) -> ActivationPeak:
    """Peak activation bytes on the GPU during one forward + backward (notebook 06): `estimate_saved_activations`
    plus the largest transient of backward: the loss's gradient over the vocabulary (or one logits tile), or one
    layer's backward (with checkpointing: that layer recomputed, its saved parts back for the time of its backward).
    With `offload_checkpoints` (DeepSpeed's cpu_checkpointing, `checkpoints_on_cpu`) the GPU keeps the last three layer
    inputs (OFFLOAD_INPUTS_KEPT_ON_GPU: the newest is not offloaded, the two before it stay as the source of their
    copies and are reused by backward), the others come back one at a time for their layer's backward, and every input
    but the newest has a page-locked RAM buffer (`cpu_pinned_bytes`, each rounded up to a power of two by torch's
    host allocator)."""
    from helpers.memory import pinned_bytes

    saved = estimate_saved_activations(shape, seq_len, batch, precision_bytes=precision_bytes,
                                       checkpointing=checkpointing, tiled_mlp=tiled_mlp, tiled_logits=tiled_logits,
                                       offload_checkpoints=offload_checkpoints)
    e, h, v, tokens = precision_bytes, shape.hidden, shape.vocab, seq_len * batch
    peak = ActivationPeak(saved)
    if tiled_logits:
        tile = -(-tokens // _shards(tokens, logits_tile_tokens))
        peak.transients["one logits tile"] = LOGITS_TILE_BYTES_PER_VOCAB * v * tile
    else:
        peak.transients["loss backward (fp32 gradients)"] = LOSS_BACKWARD_BYTES_PER_VOCAB * v * tokens
    layer = (LAYER_GRADIENT_HIDDENS + (1 if tiled_mlp else 0)) * e * h * tokens
    if checkpointing:
        parts = _layer_parts(shape, e)
        if tiled_mlp:
            parts["mlp"] = e * h
        layer += (sum(parts.values()) + 2 * e * shape.head_dim) * tokens  # + RoPE's cos/sin for the recompute
    if offload_checkpoints:
        checkpoint, kept = e * h * tokens, min(OFFLOAD_INPUTS_KEPT_ON_GPU, shape.n_layers)
        saved.gpu[f"last {kept} layer inputs (kept on GPU)"] = kept * checkpoint
        saved.cpu["layer inputs (checkpoints)"] = (shape.n_layers - 1) * checkpoint
        peak.cpu_pinned_bytes = (shape.n_layers - 1) * pinned_bytes(checkpoint)
        # a layer below them gets its input back from RAM (one checkpoint) when the kept ones are freed: no new peak
    peak.transients["one layer's backward"] = layer
    return peak


def longest_fitting_seq_len(fits: Callable[[int], bool], upper: int = 1 << 22, multiple: int = 256) -> int:
    """The longest multiple of `multiple` tokens (up to `upper`) for which `fits(seq_len)` holds, by bisection: the
    estimated memory grows with the sequence (notebook 06, benchmarks/long_context.py). 0 if not even `multiple`."""
    lo, hi = 0, upper // multiple
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * multiple):
            lo = mid
        else:
            hi = mid - 1
    return lo * multiple


def saved_activation_bytes(forward: Callable[[], Any], exclude: Any = ()) -> tuple[int, Any]:
    """(bytes, forward's result): the distinct storages autograd holds for backward when `forward()` returns, the
    tensors of `exclude` (e.g. `model.parameters()`) left out - the measured side of `estimate_saved_activations`
    (notebook 06). A tensor saved and released again inside the forward (TiledFusedLogitsLoss runs each shard's backward
    there) does not count."""
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


@contextmanager
def checkpoints_on_cpu(model: Any) -> Iterator[None]:
    """Inside the block, the checkpointed layers of `model` run through DeepSpeed's own activation checkpointing with
    `cpu_checkpointing` on (notebook 06): each layer's input goes to page-locked CPU RAM on a side stream as the
    forward passes it (the last one stays on the GPU) and comes back once for its layer's backward. Run forward AND
    backward inside the block. `model` must have checkpointing enabled (``model.gradient_checkpointing_enable()``).
    On a CPU runtime nothing changes (there is no GPU memory to save). On leaving, the layers get their own checkpoint
    function back and DeepSpeed's checkpointing its defaults, also after an error.

    This is DeepSpeed's `checkpointing.checkpoint` (`activation_checkpointing.cpu_checkpointing`), not the
    `CheckpointHiddenStatesOffload` hooks of the same file: those keep every restored input on the GPU until the block
    ends (their `_restored` cache), so by the end of backward all the checkpoints are back on the GPU.

    On leaving, DeepSpeed's offload engine (one per process, a module global) is dropped with its pool of page-locked
    buffers: DeepSpeed 0.19.8 keeps that pool across steps, keyed by the exact shape, and `reset()` does not empty it,
    so after a step at another length the old buffers stayed locked beside the new ones (1.9 GB after section 4 of
    notebook 06 on Colab; twice the estimate's RAM in the benchmark's search, killed at the RAM limit). Dropped, they
    go back to torch's host allocator, which hands a freed block to the next request of its rounded size and releases
    them all on `release_host_memory`."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
    from transformers.modeling_layers import GradientCheckpointingLayer

    from helpers.runtime import quiet_deepspeed

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError("checkpoints_on_cpu moves the checkpoints of activation checkpointing, which is off for "
                         "this model. Fix: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                         "{'use_reentrant': False}) first")
    import torch

    if not torch.cuda.is_available():  # nothing to move: and DeepSpeed's blocking-copy path (CPU accelerator) empties
        yield                          # the checkpoint it "copies" to the same device (its .to() is a no-op alias)
        return
    if not deepspeed.comm.is_initialized():  # configure() asks for the rank: a world of one, as the engine makes
        from helpers.runtime import setup_single_process

        setup_single_process()
        deepspeed.init_distributed(verbose=False)
    own = [(m, m._gradient_checkpointing_func) for m in layers]
    try:
        with quiet_deepspeed():  # configure() logs its settings at INFO each time
            ds_checkpointing.configure(None, checkpoint_in_cpu=True)
        for m in layers:
            m._gradient_checkpointing_func = ds_checkpointing.checkpoint
        yield
    finally:
        for m, func in own:
            m._gradient_checkpointing_func = func
        release_cpu_checkpoints()


def release_cpu_checkpoints() -> bool:
    """After training with DeepSpeed's `cpu_checkpointing` (notebook 06): drop DeepSpeed's offload engine with its pool
    of page-locked buffers, and set DeepSpeed's activation checkpointing back to its defaults (no CPU checkpoints).
    DeepSpeed 0.19.8 keeps that pool across steps, keyed by the exact shape, and its `reset()` does not empty it, so
    after a step at another length the old buffers stay locked beside the new ones (`checkpoints_on_cpu`). Returns
    whether there was an engine to drop. Safe to call when nothing was configured."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    from helpers.runtime import quiet_deepspeed

    offload_engine = getattr(ds_checkpointing, "_cpu_offload_engine", None)
    if offload_engine is not None:
        offload_engine.reset()  # waits for its copies in flight and drops the tensors it tracks ...
        ds_checkpointing._cpu_offload_engine = None  # ... but not its buffer pool: the engine goes with it
    if deepspeed.comm.is_initialized():  # configure() asks for the rank
        with quiet_deepspeed():
            ds_checkpointing.configure(None, checkpoint_in_cpu=False)
    return offload_engine is not None


def tiled_causal_lm_loss(model: Any, input_ids: Any, tile_tokens: int = 1024, loss_scale: float = 1.0) -> Any:
    """The next-token loss of a transformers causal LM without its whole logits (notebook 06): the decoder's hidden
    states, then DeepSpeed's `TiledFusedLogitsLoss` over slices of `tile_tokens` positions (lm_head, fp32
    cross-entropy, the slice's backward at once; mean over the slices, as the model's own loss for equal slices).

    `loss_scale`: what backward will multiply the loss by (fp16 loss scaling: DeepSpeed's
    `engine.optimizer.loss_scale`; 1 in bf16/fp32). TiledFusedLogitsLoss runs each slice's backward inside forward,
    before that scaling reaches it, and scales only the hidden states' gradient afterwards: unscaled, the head's weight
    gradient would come out divided by the loss scale (1/256 of the right one at scale 256, tests/test_long_context.py).
    So the slices' losses are computed times `loss_scale` and the result divided by it: the same loss, every gradient
    scaled alike."""
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens must be a positive whole number of tokens, got {tile_tokens!r}")
    if not loss_scale > 0:
        raise ValueError(f"loss_scale must be positive (fp16: engine.optimizer.loss_scale; else 1.0), got {loss_scale!r}")
    hidden = model.model(input_ids=input_ids).last_hidden_state
    x, y = hidden[:, :-1], input_ids[:, 1:]

    def loss(lm: Any, x_slice: Any, y_slice: Any) -> Any:
        logits = lm.lm_head(x_slice).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_slice.reshape(-1)) * loss_scale

    shards = _shards(x.shape[0] * x.shape[1], tile_tokens)
    out = TiledFusedLogitsLoss.apply(loss, model, x, y, None, shards, [model.lm_head.weight], "mean")
    return out / loss_scale if loss_scale != 1 else out


def technique_flags(technique: str) -> dict[str, bool]:
    """The estimate's flags of a rung of `TECHNIQUES` (notebook 06); a clear error names the rungs."""
    if technique not in TECHNIQUES:
        raise ValueError(f"technique must be one of {list(TECHNIQUES)}, got {technique!r}")
    return dict(TECHNIQUES[technique])


@dataclass(frozen=True)
class LongContextEstimate:
    """One training step of batch 1 x `seq_len` (notebook 06): peak GPU bytes = model states + max(activation peak,
    the optimizer step's temporaries); RAM it adds: page-locked checkpoints + model states kept on the CPU."""

    seq_len: int
    gpu_peak: int
    activation_peak: int
    states_gpu: int
    cpu_pinned: int
    states_cpu: int
    activations: ActivationPeak
    states: Any = None  # the model states' breakdown (helpers.memory.ModelStateEstimate)
    step_transient: int = 0  # the optimizer step's temporaries (bytes on the GPU)

    @property
    def ram_added(self) -> int:
        return self.cpu_pinned + self.states_cpu

    def run_estimate(self) -> Any:
        """The same peak as `helpers.memory.RunEstimate` (notebook 01's): model states by component, then the larger of
        the activation peak and the optimizer step's temporaries; its `rows()` add up to `gpu_peak`."""
        from helpers.memory import RunEstimate

        return RunEstimate(self.gpu_peak, self.activation_peak, self.states, self.step_transient)

    def table(self) -> str:
        """The predicted peak as rows that add up to it (GiB), `RunEstimate.table`."""
        return self.run_estimate().table()

    def gpu_parts(self) -> dict[str, int]:
        """The peak by part, for a stacked bar (helpers.plots.plot_long_context_memory): model states, the layers' and the
        head's bytes kept for backward, the largest transient (or the optimizer step's temporaries, when larger)."""
        kept = self.activations.saved.gpu
        layers = sum(b for k, b in kept.items() if k.startswith(("layer", "RoPE", "last ")))  # "last 3 layer inputs"
        parts = {"model states": self.states_gpu, "kept for backward: layers": layers,
                 "kept for backward: head, loss, labels": sum(kept.values()) - layers}
        rest = self.gpu_peak - self.states_gpu - sum(kept.values())
        transient = self.activations.peak_transient if rest <= max(self.activations.transients.values(), default=0) \
            else "optimizer step temporaries"
        parts[f"transient: {transient}"] = rest
        return parts


def estimate_long_context_run(shape: LongContextShape, n_params: int, ds_config: dict[str, Any], seq_len: int,
                              technique: str, *, logits_tile_tokens: int = 1024) -> LongContextEstimate:
    """The estimate of one step at `seq_len` with `technique` under `ds_config` (its precision and ZeRO stage decide
    the model states, `helpers.memory.estimate_peak`) (notebook 06)."""
    from helpers.memory import _states_and_transient

    fp16, bf16 = (ds_config.get(k, {}).get("enabled") for k in ("fp16", "bf16"))
    precision = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    act = estimate_activation_peak(shape, seq_len, precision_bytes=2 if (fp16 or bf16) else 4,
                                   logits_tile_tokens=logits_tile_tokens, **technique_flags(technique))
    # helpers.memory.estimate_peak's sum, its parts kept: model states + max(activation peak, optimizer-step
    # temporaries)
    states, transient = _states_and_transient(ds_config, n_params, precision=precision, n_gpus=1,
                                              largest_layer_params=0)
    peak = states.gpu_total + max(act.gpu_peak, transient)
    states_cpu = states.cpu_total - states.cpu.get("model copy", 0)  # built on the GPU (build_long_context_engine)
    return LongContextEstimate(seq_len, int(peak), int(act.gpu_peak), int(states.gpu_total), int(act.cpu_pinned_bytes),
                               int(states_cpu), act, states, int(transient))


def params_label(n_params: int) -> str:
    """A parameter count as a title reads it: "222M", "1.3B", "137K" (a smoke-sized model is not "0M") (notebook 06)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n_params >= scale:
            value = n_params / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(int(n_params))


def ladder_verdict(longest: dict[str, int], tried: Any) -> str:
    """One line on notebook 06's ladder from what it trained: `longest` maps each technique (the first is plain) to
    the longest length it trained (0: none), `tried` the lengths tried. When several techniques reached the longest
    length tried, none is named the winner: they all reached the cap. The gain over plain is a lower bound: plain's
    own longest lies below the next length tried, which did not fit (with TRY_LENGTHS 4,096 / 16,384 / 65,536,
    plain at 4,096 and the best at 65,536 make "at least 4x", not 16x)."""
    if not longest:
        raise ValueError("longest is empty: no technique was tried")
    cap = max(tried)
    (first, plain), best = next(iter(longest.items())), max(longest.values())
    at_best = [t for t, n in longest.items() if n == best]
    if best == 0:
        return "no technique trained even the shortest length tried"
    if len(at_best) == len(longest) and best == cap:
        return (f"every technique trained every length tried, up to {best:,} tokens: nothing ran out of memory here, "
                f"so this run does not rank them (only the lengths in TRY_LENGTHS were tried)")
    failed = min((n for n in tried if n > plain), default=0)  # plain's first length that did not fit
    if not plain:
        reach = f"{best:,} tokens ({first}: none, {failed:,} did not fit)"
    elif failed and best > plain:
        gain = f"at least {best / failed:.0f}x {first}'s longest, " if best >= 2 * failed else f"{first}'s longest "
        reach = f"{best:,} tokens ({gain}between {plain:,} and {failed:,})"
    else:  # plain itself among the longest
        reach = f"{best:,} tokens"
    if len(at_best) > 1:
        why = (f"they all reached the cap (TRY_LENGTHS stops at {cap:,}): no winner" if best == cap else
               "a tie at the lengths tried: no winner")
        return f"{len(at_best)} techniques trained up to {reach}: {', '.join(at_best)}; {why}"
    return f"longest trained: {at_best[0]} at {reach}" + ("; the longest length tried" if best == cap else "")


def predict_longest_seq_len(shape: LongContextShape, n_params: int, ds_config: dict[str, Any], technique: str, *,
                            vram_bytes: int, ram_bytes: int = 0, logits_tile_tokens: int = 1024,
                            upper: int = 1 << 22) -> int:
    """The longest sequence (a multiple of 256 tokens) whose estimated peak fits `vram_bytes` of GPU memory and whose
    added RAM fits `ram_bytes` (0: RAM not checked), notebook 06 and benchmarks/long_context.py."""
    def fits(seq_len: int) -> bool:
        est = estimate_long_context_run(shape, n_params, ds_config, seq_len, technique,
                                        logits_tile_tokens=logits_tile_tokens)
        return est.gpu_peak <= vram_bytes and (not ram_bytes or est.ram_added <= ram_bytes)

    return longest_fitting_seq_len(fits, upper=upper)


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null inside the block: torch's profiler (kineto) writes a line to it at each start
    and stop, below Python, where a notebook shows it as output."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def measured_peak_bytes(step: Callable[[], Any]) -> int:
    """Peak bytes allocated above what was allocated before `step()` (a forward + backward): the measured side of
    `estimate_activation_peak` (notebook 06). On a GPU torch's max_memory_allocated; on CPU torch's profiler memory
    timeline (every host allocation and free; slower, for small models)."""
    import json
    import os
    import tempfile

    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - start)
    from torch.profiler import ProfilerActivity, profile

    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                                     with_stack=True) as prof:
        step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        import warnings

        with warnings.catch_warnings():  # deprecated in favour of CUDA memory snapshots, which do not see the host
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device="cpu")
        _, sizes = json.loads(open(path).read())
    finally:
        os.unlink(path)
    totals = [sum(row) for row in sizes]
    return int(max(totals) - totals[0]) if totals else 0


def build_long_context_engine(config: Any, ds_config: dict[str, Any], technique: str, *, seed: int = 0) -> Any:
    """A DeepSpeed engine over a model built from `config` (no download), on the GPU where there is one, with
    transformers' non-reentrant activation checkpointing when `technique` uses it (notebook 06)."""
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.runtime import quiet_deepspeed

    flags = technique_flags(technique)
    dtype = (torch.float16 if ds_config.get("fp16", {}).get("enabled") else
             torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32)
    require_fused_attention(config, dtype)  # before anything is built: no T x T attention on this GPU
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config)
    if flags.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with quiet_deepspeed():  # DeepSpeed's INFO lines about its config: warnings only
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine


@dataclass
class LengthResult:
    """What `train_at_length` measured at one length (notebook 06, benchmarks/long_context.py)."""

    seq_len: int
    technique: str
    ok: bool
    error: str | None = None
    losses: list[float] = field(default_factory=list)
    skipped_at_steps: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_gpu_allocated: int = 0
    baseline_gpu_allocated: int = 0
    peak_rss: int = 0
    baseline_rss: int = 0
    engine_usable: bool = True  # False after an out-of-memory error: build a new engine
    peak_gpu_reserved: int = 0  # what the caching allocator held (the cap applies to this, not to allocated)
    oom_at_step: int | None = None  # after an out-of-memory error: the step it happened in (0 = the first)
    oom_allocated: int = 0  # ... and the bytes allocated / reserved at that moment, and the request that failed
    oom_reserved: int = 0
    oom_tried: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.seq_len / self.step_s[-1] if self.step_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 1)}


def _long_context_step(engine: Any, ids: Any, flags: dict[str, bool], logits_tile_tokens: int) -> float:
    import contextlib

    mlp = tiled_mlp() if flags.get("tiled_mlp") else contextlib.nullcontext()
    offload = checkpoints_on_cpu(engine.module) if flags.get("offload_checkpoints") else contextlib.nullcontext()
    with mlp, offload:  # forward and backward inside: the offloaded checkpoints come back in backward
        if flags.get("tiled_logits"):  # the fp16 loss scale backward will apply (1 in bf16/fp32)
            scale = float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)
            loss = tiled_causal_lm_loss(engine.module, ids, logits_tile_tokens, loss_scale=scale)
        else:
            loss = engine(input_ids=ids, labels=ids).loss  # the logits are dropped once the loss is taken
        engine.backward(loss)
    engine.step()
    return float(loss.detach().float().item())


def _tried_bytes(message: str) -> int:
    """The request in PyTorch's out-of-memory message ("Tried to allocate 2.50 GiB"), in bytes; 0 if absent."""
    import re

    found = re.search(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB)", message)
    if not found:
        return 0
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[found.group(2)]
    return int(float(found.group(1)) * unit)


def use_expandable_segments(enabled: bool = True) -> bool:
    """Switch PyTorch's CUDA caching allocator to expandable segments for this process (notebook 06); returns whether
    it was set (False without a GPU).

    A long-sequence step allocates and frees tensors of hundreds of MiB to GiB. The default allocator keeps each
    freed block at its size and cuts later requests out of it, so after a step the free memory can lie in pieces that
    are each too small for the next step's large tensors although together they would do; under a cap (the
    14.34 GiB a T4 leaves PyTorch, helpers.T4_VRAM_GIB) the step then fails with memory reserved but not allocated. With expandable segments the allocator maps
    physical pages into one growing address range and remaps freed pages where they are needed. The per-process cap
    (`set_per_process_memory_fraction`) still holds: the allocator checks it before it maps more. Same setting as
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which only takes effect before CUDA's first use; this call takes
    effect for the memory mapped after it."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{bool(enabled)}")
    return True


def train_at_length(engine: Any, tokens: Any, seq_len: int, technique: str, *, logits_tile_tokens: int = 1024,
                    max_steps: int = 4) -> LengthResult:
    """Train `engine` on the first `seq_len` ids of `tokens` (batch 1) until two optimizer steps were not skipped by
    the fp16 loss scaler (at most `max_steps`), measuring peak GPU memory and RSS (notebook 06). It trains if the loss
    of the second falls below the first (the same sequence both times). An out-of-memory error is caught and
    reported (`ok` False, `engine_usable` False: its half-done backward is left in the engine, build a new one)."""
    import math
    import sys

    import torch

    from helpers.memory import measure_peak

    flags = technique_flags(technique)
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be a whole number of tokens >= 2, got {seq_len!r}")
    if len(tokens) < seq_len:
        raise ValueError(f"{len(tokens):,} tokens given, {seq_len:,} asked: pass a longer token stream "
                         f"or seq_len <= {len(tokens)}")
    result = LengthResult(seq_len, technique, ok=False)
    ids = tokens[:seq_len].unsqueeze(0).to(engine.device)
    try:
        with measure_peak() as m:
            for i in range(max_steps):
                before = engine.skipped_steps
                t0 = time.perf_counter()
                result.losses.append(round(_long_context_step(engine, ids, flags, logits_tile_tokens), 4))
                result.step_s.append(round(time.perf_counter() - t0, 3))
                if engine.skipped_steps > before:
                    result.skipped_at_steps.append(i)
                if len(result.losses) - len(result.skipped_at_steps) >= 2:
                    break
    except torch.OutOfMemoryError as err:
        result.error = "out of GPU memory: " + str(err).split(". ")[0][:160]
        result.engine_usable = False
        result.oom_at_step, result.oom_tried = len(result.losses), _tried_bytes(str(err))
        if torch.cuda.is_available():  # the failed step's tensors are still alive here (the traceback holds them)
            result.oom_allocated, result.oom_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    finally:
        del ids
    if result.error:
        sys.last_traceback = None  # a traceback would keep the failed step's tensors alive
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return result
    result.peak_gpu_allocated, result.baseline_gpu_allocated = m.peak_gpu_allocated, m.baseline_gpu_allocated
    result.peak_gpu_reserved = m.peak_gpu_reserved
    result.peak_rss, result.baseline_rss = m.peak_rss, m.baseline_rss
    done = [x for i, x in enumerate(result.losses) if i not in result.skipped_at_steps]
    result.ok = len(done) >= 2 and all(math.isfinite(x) for x in result.losses) and done[-1] < done[0]
    result.error = None if result.ok else "the loss did not fall"
    return result
