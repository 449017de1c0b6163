"""What fills memory, estimated before a run and measured during it (notebooks 00-05).

Model states per parameter (the ZeRO paper's 2Ψ + 2Ψ + 12Ψ for mixed-precision Adam):
16-bit params 2 bytes, 16-bit grads 2 bytes, fp32 master weights + Adam momentum + variance
12 bytes. ZeRO stage 1 partitions the optimizer states over N GPUs, stage 2 also the
gradients, stage 3 also the parameters. Offload moves the optimizer states (and at stage 3
the parameters) to CPU RAM or an NVMe folder. DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) are shown
next to this breakdown by `deepspeed_estimate`. Comparing an estimate with a runtime's budget (pre-flight) is
helpers.planner's.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from helpers.checks import ConfigError, check_model_size, check_number, check_offload_device, config_micro_batch
from helpers.overflow_check import chunked_overflow_check_active

__all__ = ["count_params", "deepspeed_estimate", "estimate_for_config", "estimate_model_states", "estimate_run",
           "measure_peak", "model_states_per_gpu"]

GiB = 1024**3
GB = 1000**3
COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers", "step on host", "runtime", "staging",
              "pinned copy")
# fp16 ZeRO-3 with the optimizer offloaded: at every step DeepSpeed 0.19.8's has_overflow runs torch.isinf over the
# whole host gradient buffer, `x.abs() == inf` inside the operator: a 16-bit |x| copy and a bool mask of every
# parameter at once (reports/host_memory.md, GPU: the RSS rose 4.67 GB at GPT-2 XL, 3 x 1.558 G params).
# helpers.chunk_zero3_overflow_check() takes the min/max of slices instead: no temporary.
OVERFLOW_CHECK_BYTES_PER_PARAM = 3
# What a GPU training process's RSS grows by once the model exists and has taken a step (CUDA kernels and library
# state loaded on first use, autograd and DeepSpeed's Python objects): measured on the GPU machine, GPT-2 XL, fp16
# ZeRO-3 with the optimizer on NVMe (reports/host_memory.json): +0.39 GB building the model, +0.56 GB in the first
# training step; 2.7B built to the same +0.39 GB.
RUNTIME_GROWTH_BYTES = 950_000_000
# Without a GPU (bf16/fp32 runs on CPU) ZeRO-3's zero.Init builds each layer's partitions in host RAM, copies them
# into DeepSpeed's flat buffer and frees them into glibc's heap, which keeps them: measured on CPU (GPT-2 large,
# reports/host_memory_cpu.md) 2.4-3.2 GB above the traced storages, 3.1-4.1 bytes/param ('staging'). On a GPU the
# partitions are built in GPU memory, so a GPU runtime counts no staging in any precision; bf16 and fp32 on a GPU
# count what fp16 does less the overflow check, which DeepSpeed 0.19.8 runs for fp16 only (stage3.py:2815,
# `if self.dtype == torch.float16: self.check_overflow()`). Issue 41 item 6: GPT-2 2.7B, bf16 ZeRO-3 with the
# optimizer on NVMe on a whole H200 peaked at 10.95 GB RSS where the CPU account (staging) predicted 18.5 GB.
STAGE3_OFFLOAD_STAGING_BYTES_PER_PARAM = 3.5


def pinned_bytes(nbytes: int) -> int:
    """What a pinned (page-locked) host buffer of `nbytes` really takes: torch's caching host allocator rounds each
    block up to the next power of two (1.55 GB of GPT-2 large's fp16 parameters take 2 GiB)."""
    nbytes = int(nbytes)
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


def round_to_total(values: list[float], decimals: int) -> list[float]:
    """`values` rounded to `decimals` so that the rounded values add up to their rounded sum (largest remainder):
    a printed table's rows then sum to its printed total (notebooks 00-02, the planner)."""
    scale = 10**decimals
    target = round(sum(values) * scale)
    floors = [int(v * scale // 1) for v in values]
    order = sorted(range(len(values)), key=lambda i: values[i] * scale - floors[i], reverse=True)
    for i in order[:max(target - sum(floors), 0)]:
        floors[i] += 1
    return [f / scale for f in floors]


def bytes_per_element(precision: str) -> int:
    """2 for fp16/bf16, 4 for fp32."""
    if precision in ("fp16", "bf16"):
        return 2
    if precision == "fp32":
        return 4
    raise ValueError(f"precision must be fp16, bf16 or fp32 (got {precision!r})")


@dataclass
class ModelStateEstimate:
    """Bytes per component on one GPU, in CPU RAM (per node) and on disk (notebooks 00-02)."""

    label: str
    n_params: int
    n_gpus: int
    gpu: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, int] = field(default_factory=dict)
    nvme: dict[str, int] = field(default_factory=dict)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def cpu_total(self) -> int:
        return sum(self.cpu.values())

    @property
    def nvme_total(self) -> int:
        return sum(self.nvme.values())

    def with_activations(self, activation_bytes: int, on: str = "gpu") -> "ModelStateEstimate":
        """A copy with an activation estimate added on `on` ('gpu' or 'cpu')."""
        new = ModelStateEstimate(self.label, self.n_params, self.n_gpus, dict(self.gpu), dict(self.cpu),
                                 dict(self.nvme))
        getattr(new, on)["activations"] = int(activation_bytes)
        return new

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gpu_total=self.gpu_total, cpu_total=self.cpu_total, nvme_total=self.nvme_total)
        return d

    def table(self) -> str:
        """A fixed-width table of the breakdown: GPU memory in GiB (as torch counts it), RAM and NVMe in GB (as the
        course's budgets count them). The GPU column is per GPU; RAM and NVMe are per machine."""
        gpus = f"on each of {self.n_gpus} GPUs" if self.n_gpus > 1 else "on one GPU"
        lines = [f"{self.label}  ({self.n_params / 1e6:.1f}M params, {gpus})",
                 f"{'component':<12}{'GPU GiB':>10}{'RAM GB':>10}{'NVMe GB':>10}"]
        comps = [c for c in COMPONENTS + ("model copy",) if self.gpu.get(c) or self.cpu.get(c) or self.nvme.get(c)]
        columns = [round_to_total([getattr(self, where).get(c, 0) / unit for c in comps], 3)  # rows add up
                   for where, unit in (("gpu", GiB), ("cpu", GB), ("nvme", GB))]
        for i, comp in enumerate(comps):
            lines.append(f"{comp:<12}" + "".join(f"{col[i]:>10.3f}" for col in columns))
        lines.append(f"{'total':<12}{self.gpu_total / GiB:>10.3f}{self.cpu_total / GB:>10.3f}"
                     f"{self.nvme_total / GB:>10.3f}")
        return "\n".join(lines)


def _check_estimate_arguments(n_params: Any, stage: Any, offload_optimizer: Any, offload_param: Any, n_gpus: Any,
                              largest_layer_params: Any) -> None:
    """`estimate_model_states`' arguments, refused with a fix before anything is counted."""
    check_model_size(n_params, largest_layer_params)
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int)):
        fix = f"stage={int(stage)}" if isinstance(stage, float) and stage in (0, 1, 2, 3) else "stage=0..3"
        raise ConfigError(f"stage must be None (plain PyTorch) or an int 0..3 (got {stage!r}). Fix: {fix}.")
    check_offload_device("offload_optimizer", offload_optimizer)
    check_offload_device("offload_param", offload_param)
    check_number("n_gpus", n_gpus, positive=True, integer=True, example=1)


def _offloaded_optimizer(cpu: dict[str, int], nvme: dict[str, int], device: str, *, stage: int, psi: int, n: int,
                         e: int, opt_share: int, sub_group: int, on_gpu: bool) -> None:
    """The optimizer states and the gradients they step on, on the host or NVMe (`estimate_model_states`)."""
    target = cpu if device == "cpu" else nvme
    target["optimizer"] = opt_share * n  # all ranks of the node share the host
    if stage == 3:
        # 16-bit gradient partitions, then the fp32 gradients the optimizer steps on; with NVMe those are
        # swapped out with their sub-group (DeepSpeed's swap_out_gradients) and one sub-group is in RAM (in fp16 on
        # a GPU only while the optimizer states are initialised: counted with the step's moments, 'step on host')
        nvme_fp32_grads = 0 if on_gpu else 4 * sub_group
        cpu["grads"] = e * psi + (4 * psi if device == "cpu" else nvme_fp32_grads)
        if device == "nvme":
            nvme["grads"] = 4 * psi
    else:
        cpu["grads"] = 4 * psi // n * n  # fp32 gradient partition per rank, on the host


def _stage3_offload_host_extras(precision: str, offload_optimizer: str, *, psi: int, largest_sub_group: int,
                                chunked_overflow_check: bool, on_gpu: bool) -> dict[str, int]:
    """What ZeRO-3 with offload adds in RAM beyond the states (`estimate_model_states`): on a GPU the step's
    largest host moment (fp16's overflow check among them) and the runtime's growth; on CPU the measured staging."""
    if not on_gpu:
        return {"staging": int(STAGE3_OFFLOAD_STAGING_BYTES_PER_PARAM * psi)}
    extras: dict[str, int] = {}
    if offload_optimizer != "none":
        # DeepSpeed checks for overflow in fp16 only (stage3.py:2815): bf16 and fp32 have no loss scale
        checked = precision == "fp16" and not chunked_overflow_check
        overflow = OVERFLOW_CHECK_BYTES_PER_PARAM * psi if checked else 0
        # with NVMe: the first step's Adam moments of one sub-group (8 B), or at initialisation its fp32
        # gradient buffer (4 B): at other moments than the overflow check, so the largest of the three counts
        extras["step on host"] = max(overflow, 8 * largest_sub_group if offload_optimizer == "nvme" else 0)
    extras["runtime"] = RUNTIME_GROWTH_BYTES
    return extras


def _gpu_runtime(precision: str) -> bool:
    """Whether a run in `precision` runs on a GPU here: fp16 always does (DeepSpeed refuses it on CPU), bf16 and fp32
    when this process sees a CUDA GPU."""
    if precision == "fp16":
        return True
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class EstimateSettings:
    """What `estimate_model_states` reads beyond the model and the ZeRO setup (notebook 00): DeepSpeed's buffer settings
    as a config sets them (`overlap_comm`, `sub_group_size`, offload_param's NVMe `buffer_count` x `buffer_size`),
    whether the course's chunked fp16 overflow check is on (helpers.chunk_zero3_overflow_check), and whether the run is
    on a GPU (None: fp16 is, bf16/fp32 when this process sees a CUDA GPU). `estimate_for_config` fills it from a config."""

    overlap_comm: bool = False
    nvme_buffer_count: int = 8
    nvme_buffer_size: int = 100_000_000
    sub_group_size: int = 1_000_000_000
    chunked_overflow_check: bool = False
    on_gpu: bool | None = None
    pin_optimizer: bool = False  # offload_optimizer.pin_memory: page-locked gradient partition (stage 3)


def _pinned_gradient_partition(cpu: dict[str, int], nbytes: int) -> None:
    """What `offload_optimizer.pin_memory` adds at stage 3 on a GPU (`estimate_model_states`): DeepSpeed pins the
    16-bit gradient partition (stage3.py `grad_partitions_flat_buffer`), which torch's host allocator rounds up to a
    power of two (training: 'grads'), and `pin_memory()` copies it while the pageable buffer still lives (inside
    `deepspeed.initialize`, before the step's moments and the runtime's growth: 'pinned copy', the part of that
    moment above training's). GPT-2 XL at 16 x 8 (reports/offload_speed.json, RSS by phase, pinned vs not): training
    +1.17 GB, initialize +4.28 GB; this account: +1.18 GB and a peak of 10.71 GB against the 10.83 measured."""
    cpu["grads"] = cpu.get("grads", 0) + pinned_bytes(nbytes) - nbytes
    cpu["pinned copy"] = max(0, nbytes - cpu.get("step on host", 0) - cpu.get("runtime", 0))


def _offloaded_params(gpu: dict[str, int], cpu: dict[str, int], nvme: dict[str, int], offload_param: str, *, e: int,
                      param_share: int, n: int, largest_layer_params: int, nvme_buffer_bytes: int) -> None:
    """estimate_model_states' rows for ZeRO-3 parameters offloaded to `offload_param` ("cpu" or "nvme")."""
    gpu["params"] = 2 * e * max(largest_layer_params, 1)  # the layer being computed and the one being fetched
    if offload_param == "cpu":
        # one flat 16-bit buffer per parameter group, always pinned (stage3.py
        # _create_param_groups_fp16_flat_cpu_memory); torch's CUDA host allocator rounds it up to a power of two
        cpu["params"] = pinned_bytes(param_share * n)
    else:
        nvme["params"] = param_share * n
        cpu["buffers"] = nvme_buffer_bytes


def estimate_model_states(
    n_params: int,
    stage: int | None,
    *,
    precision: str = "fp16",
    offload_optimizer: str = "none",
    offload_param: str = "none",
    n_gpus: int = 1,
    largest_layer_params: int = 0,
    reduce_bucket_elements: int = 500_000_000,
    zero_init: bool = False,
    settings: EstimateSettings | None = None,
) -> ModelStateEstimate:
    """Model-state bytes per GPU and per node CPU for a ZeRO `stage` (None: plain PyTorch AMP + AdamW) (notebook 00).

    Mixed precision (fp16/bf16): params 2Ψ, grads 2Ψ, optimizer 12Ψ (fp32 master 4 + Adam m 4 + v 4).
    fp32: params 4Ψ, grads 4Ψ, Adam 8Ψ, plus a 4Ψ fp32 master copy that DeepSpeed's ZeRO optimizers
    keep even in fp32 (stage >= 1). Plain PyTorch AMP keeps fp32 weights: 4Ψ + 4Ψ + 8Ψ = 16Ψ.
    Unless `zero_init`, the model is first built on CPU in fp32 (4Ψ of CPU RAM, 'model copy').
    Stages 1 and 2 also allocate a gradient reduction bucket of `reduce_bucket_elements` on the GPU
    (DeepSpeed's default 5e8 elements: about 1 GB in 16-bit, whatever the model size; twice that with
    overlap_comm). Pass reduce_bucket_elements=0 for model states alone.
    With optimizer offload the gradients land in RAM: fp32 at stages 1-2; at stage 3 a 16-bit
    partition plus the fp32 copy the optimizer steps on (all of it with a CPU optimizer, one
    `sub_group_size` slice with NVMe, whose 4 swap buffers of that slice are held in RAM too; the fp32
    gradients then live on NVMe beside the optimizer states: 16 Ψ on disk). ZeRO-3 with offload in fp16 (a GPU
    runtime) adds the largest moment of the step in RAM ('step on host': DeepSpeed's overflow check, 3 Ψ, or with
    `chunked_overflow_check` (helpers.chunk_zero3_overflow_check) nothing, or the first step's Adam moments
    of one NVMe sub-group, 8 B each, whichever is larger) and what the runtime grows by ('runtime'); bf16 and fp32
    on a GPU the same without the overflow check. Without a GPU (bf16/fp32; DeepSpeed refuses fp16 on CPU) it adds
    `STAGE3_OFFLOAD_STAGING_BYTES_PER_PARAM` ('staging', measured, see there) instead. `on_gpu` None: fp16 is a GPU
    runtime, bf16/fp32 one when this process sees a CUDA GPU. `overlap_comm`, `sub_group_size`, the NVMe buffers,
    `chunked_overflow_check` and `on_gpu` are `settings` (EstimateSettings; `estimate_for_config` reads them off a
    config).
    """
    opts = settings or EstimateSettings()
    overlap_comm, sub_group_size, on_gpu = opts.overlap_comm, opts.sub_group_size, opts.on_gpu
    nvme_buffer_count, nvme_buffer_size = opts.nvme_buffer_count, opts.nvme_buffer_size
    chunked_overflow_check = opts.chunked_overflow_check
    _check_estimate_arguments(n_params, stage, offload_optimizer, offload_param, n_gpus, largest_layer_params)
    on_gpu = _gpu_runtime(precision) if on_gpu is None else bool(on_gpu)
    psi, n = int(n_params), int(n_gpus)
    if stage is None:
        label = "plain PyTorch AMP + AdamW" if precision != "fp32" else "plain PyTorch + AdamW"
        est = ModelStateEstimate(label, psi, n, gpu={"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi})
        est.cpu["model copy"] = 0  # moved to the GPU with .to("cuda")
        return est
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be None (plain PyTorch) or 0..3 (got {stage!r})")
    if offload_param != "none" and stage != 3:
        raise ValueError("parameter offload needs ZeRO stage 3")
    e = bytes_per_element(precision)
    master = 4 if (e == 2 or stage >= 1) else 0
    opt_bytes = (master + 8) * psi
    grad_bytes = e * psi
    param_bytes = e * psi

    opt_share = opt_bytes // n if stage >= 1 else opt_bytes
    grad_share = grad_bytes // n if stage >= 2 else grad_bytes
    param_share = param_bytes // n if stage == 3 else param_bytes

    parts = [f"ZeRO-{stage}"]
    gpu: dict[str, int] = {}
    cpu: dict[str, int] = {}
    nvme: dict[str, int] = {}

    # optimizer states (and, with optimizer offload, the fp32 gradient partition they step on)
    if offload_optimizer == "none":
        gpu["optimizer"] = opt_share
        gpu["grads"] = grad_share
    else:
        parts.append(f"optimizer->{offload_optimizer}")
        _offloaded_optimizer(cpu, nvme, offload_optimizer, stage=stage, psi=psi, n=n, e=e, opt_share=opt_share,
                             sub_group=min(int(sub_group_size), psi), on_gpu=on_gpu)
    if offload_param == "none":
        gpu["params"] = param_share
    else:
        parts.append(f"params->{offload_param}")
        _offloaded_params(gpu, cpu, nvme, offload_param, e=e, param_share=param_share, n=n,
                          largest_layer_params=largest_layer_params,
                          nvme_buffer_bytes=nvme_buffer_count * nvme_buffer_size * e)
    # DeepSpeed closes an optimizer sub-group once it reaches sub_group_size, so the largest is never smaller than the
    # largest tensor (GPT-2 2.7B: the 128.7M embedding)
    largest_sub_group = max(min(int(sub_group_size), psi), largest_layer_params)
    if offload_optimizer == "nvme":
        # optimizer swap buffers: 4 of one sub-group each, fp32
        cpu["buffers"] = cpu.get("buffers", 0) + 4 * largest_sub_group * 4
    if stage in (1, 2) and reduce_bucket_elements:
        # contiguous gradients: torch.empty(reduce_bucket_size) in the model dtype, x2 with overlap_comm
        gpu["buffers"] = reduce_bucket_elements * e * (2 if overlap_comm else 1)
    if stage == 3 and (offload_optimizer != "none" or offload_param != "none"):
        cpu.update(_stage3_offload_host_extras(precision, offload_optimizer, psi=psi,
                                               largest_sub_group=largest_sub_group,
                                               chunked_overflow_check=chunked_overflow_check, on_gpu=on_gpu))
        if offload_optimizer != "none" and opts.pin_optimizer and on_gpu:
            _pinned_gradient_partition(cpu, e * psi)
    cpu["model copy"] = 0 if (zero_init and stage == 3) else 4 * psi
    if precision:
        parts.append(precision)
    return ModelStateEstimate(" + ".join(parts), psi, n, gpu=gpu, cpu=cpu, nvme=nvme)


def model_states_per_gpu(n_params: int, precision: str = "fp16",
                         gpu_counts: tuple[int, ...] = (1, 2, 4, 8)) -> dict[int, dict[int, int]]:
    """{stage: {n_gpus: model-state bytes per GPU}} for ZeRO 0-3, without buffers (notebook 01, benchmarks)."""
    return {s: {n: estimate_model_states(n_params, s, precision=precision, n_gpus=n,
                                         reduce_bucket_elements=0).gpu_total for n in gpu_counts}
            for s in range(4)}


def estimate_for_config(config: dict[str, Any], n_params: int, *, n_gpus: int = 1,
                        largest_layer_params: int = 0, zero_init: bool = False,
                        chunked_overflow_check: bool | None = None, on_gpu: bool | None = None) -> ModelStateEstimate:
    """`estimate_model_states` read off a DeepSpeed config dict (stage, offload, precision) (notebook 00).
    `chunked_overflow_check` None: whether this process has called helpers.chunk_zero3_overflow_check(); `on_gpu`
    None: as `estimate_model_states` decides it."""
    if chunked_overflow_check is None:
        chunked_overflow_check = chunked_overflow_check_active()
    zero = config.get("zero_optimization", {})
    precision = ("fp16" if config.get("fp16", {}).get("enabled") else
                 "bf16" if config.get("bf16", {}).get("enabled") else "fp32")
    off_opt = zero.get("offload_optimizer", {}).get("device", "none")
    off_par = zero.get("offload_param", {}).get("device", "none")
    kwargs: dict[str, Any] = {"sub_group_size": int(zero.get("sub_group_size", 1_000_000_000))}
    if off_par == "nvme":
        kwargs.update(nvme_buffer_count=zero["offload_param"].get("buffer_count", 5),
                      nvme_buffer_size=int(zero["offload_param"].get("buffer_size", 100_000_000)))
    settings = EstimateSettings(overlap_comm=bool(zero.get("overlap_comm", False)),
                                chunked_overflow_check=chunked_overflow_check, on_gpu=on_gpu,
                                pin_optimizer=bool(zero.get("offload_optimizer", {}).get("pin_memory")), **kwargs)
    return estimate_model_states(
        n_params, int(zero.get("stage", 0)), precision=precision, offload_optimizer=off_opt,
        offload_param=off_par, n_gpus=n_gpus, largest_layer_params=largest_layer_params,
        reduce_bucket_elements=int(zero.get("reduce_bucket_size", 500_000_000))
        if zero.get("contiguous_gradients", True) else 0, zero_init=zero_init, settings=settings)


def deepspeed_estimate(n_params: int, stage: int, *, offload_optimizer: str = "none",
                       offload_param: str = "none", n_gpus: int = 1, largest_layer_params: int = 0,
                       zero_init: bool = True) -> dict[str, int] | None:
    """DeepSpeed's own estimate {'gpu': bytes, 'cpu': bytes} for stage 2 or 3 (None for 0/1) (notebook 00)."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            n_params, num_gpus_per_node=n_gpus, cpu_offload=offload_optimizer != "none")
        return {"gpu": gpu, "cpu": cpu}
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest_layer_params, num_gpus_per_node=n_gpus,
            cpu_offload=offload_optimizer != "none", cpu_offload_params=offload_param != "none",
            zero_init=zero_init)
        return {"gpu": gpu, "cpu": cpu}
    return None


def estimate_activations(batch: int, seq_len: int, hidden: int, n_layers: int, vocab: int, *,
                         n_heads: int = 12, precision: str = "fp16", checkpointing: bool = False,
                         fused_attention: bool = True) -> int:
    """Activation bytes kept for backward by a GPT-style decoder (Korthikanti et al. 2022).

    Per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit; the 5·a·s/h attention-score term is gone with
    fused attention (SDPA / flash). With checkpointing only each layer's input (2·s·b·h) is kept,
    plus one layer recomputed in full. The logits add b·s·V·(e + 4 + 4): 16-bit logits, their fp32
    copy for the loss and its gradient.
    """
    for name, value, example in (("batch", batch, 4), ("seq_len", seq_len, 512), ("hidden", hidden, 768),
                                 ("n_layers", n_layers, 12), ("vocab", vocab, 50257), ("n_heads", n_heads, 12)):
        check_number(name, value, positive=True, integer=True, example=example)
    e = bytes_per_element(precision)
    sbh = seq_len * batch * hidden
    per_layer = sbh * 34 + (0 if fused_attention else 5 * n_heads * seq_len * seq_len * batch)
    per_layer = per_layer * e // 2
    layers = (n_layers * 2 * sbh * e // 2 + per_layer) if checkpointing else n_layers * per_layer
    logits = batch * seq_len * vocab * (e + 4 + 4)
    return int(layers + logits)


def count_params(model: Any) -> tuple[int, int]:
    """(total parameters counted once, largest parameter count of one module) - DeepSpeed's counting (notebook 00)."""
    params = list(model.parameters())
    if params and params[0].device.type != "meta":
        from deepspeed.runtime.zero.stage3 import model_to_params

        total, largest = model_to_params(model)
        return int(total), int(largest)
    # meta tensors all have data_ptr 0, which DeepSpeed's counter would fold into one
    total = sum({id(p): p.numel() for p in params}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return int(total), int(largest)


# ---------------------------------------------------------------- measurement

def rss_bytes() -> int:
    """This process's resident set size (RSS) in bytes (notebook 06)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def folder_bytes(path: str | os.PathLike[str] | None) -> int:
    """Bytes of the files under `path` (the NVMe offload folder); 0 if it does not exist."""
    if not path or not os.path.isdir(path):
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total


@dataclass
class Measurement:
    """Peaks and a time series recorded by `measure_peak` (notebooks 00-05)."""

    baseline_gpu_allocated: int = 0
    peak_gpu_allocated: int = 0
    peak_gpu_reserved: int = 0
    baseline_rss: int = 0
    peak_rss: int = 0
    peak_nvme_bytes: int = 0  # the NVMe folder's largest size seen (everything in it, earlier runs' files included)
    baseline_nvme_bytes: int = 0  # its size when measuring began
    seconds: float = 0.0
    samples: list[dict[str, float]] = field(default_factory=list)
    started: float = 0.0  # time.perf_counter() when measuring began; samples' "t" counts from here

    def peak_between(self, key: str, t0: float, t1: float) -> float:
        """Largest sample of `key` ('rss', 'gpu_allocated', ...) with t0 <= t <= t1 (seconds from the start)."""
        return max((s[key] for s in self.samples if key in s and t0 <= s["t"] <= t1), default=0.0)

    @property
    def nvme_bytes_added(self) -> int:
        """The NVMe folder's peak above its size at the start: what this block wrote (a run's own disk use)."""
        return max(self.peak_nvme_bytes - self.baseline_nvme_bytes, 0)

    @property
    def peak_gpu_gib(self) -> float:
        return self.peak_gpu_allocated / GiB

    @property
    def peak_rss_gb(self) -> float:
        return self.peak_rss / GB

    def summary(self) -> str:
        """One line of what was measured; no GPU figures when no GPU memory was seen (a CPU run)."""
        gpu = (f"peak GPU allocated {self.peak_gpu_allocated / GiB:.3f} GiB (reserved "
               f"{self.peak_gpu_reserved / GiB:.3f} GiB), " if self.peak_gpu_reserved else "")
        nvme = f", NVMe {self.nvme_bytes_added / GB:.2f} GB written" if self.peak_nvme_bytes else ""
        return (f"{gpu}peak RSS {self.peak_rss / GB:.2f} GB (from {self.baseline_rss / GB:.2f} GB)"
                f"{nvme}, {self.seconds:.1f} s")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def measure_peak(nvme_path: str | os.PathLike[str] | None = None, interval_s: float = 0.05,
                 nvme_interval_s: float = 1.0) -> Iterator[Measurement]:
    """Record peak GPU allocated/reserved, peak process RSS, NVMe folder bytes and a time series (notebook 00).

    Peak GPU statistics are reset on entry, so each block measures only itself; so is the NVMe folder:
    `baseline_nvme_bytes` is its size on entry, `nvme_bytes_added` the peak above it.
    """
    import torch

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    m = Measurement(baseline_gpu_allocated=int(torch.cuda.memory_allocated()) if cuda else 0,
                    baseline_rss=rss_bytes())
    m.peak_rss = m.baseline_rss
    stop = threading.Event()
    start = time.perf_counter()
    m.started = start
    last_nvme = [-1e9]

    def sample() -> None:
        now = time.perf_counter()
        row = {"t": now - start, "rss": float(rss_bytes())}
        if cuda:
            row["gpu_allocated"] = float(torch.cuda.memory_allocated())
            row["gpu_reserved"] = float(torch.cuda.memory_reserved())
        if nvme_path is not None and now - last_nvme[0] >= nvme_interval_s:
            last_nvme[0] = now
            row["nvme"] = float(folder_bytes(nvme_path))
            m.peak_nvme_bytes = max(m.peak_nvme_bytes, int(row["nvme"]))
        m.peak_rss = max(m.peak_rss, int(row["rss"]))
        m.samples.append(row)

    def loop() -> None:
        while not stop.wait(interval_s):
            sample()

    sample()
    m.baseline_nvme_bytes = m.peak_nvme_bytes
    thread = threading.Thread(target=loop, name="measure_peak", daemon=True)
    thread.start()
    try:
        yield m
    finally:
        stop.set()
        thread.join()
        if cuda:
            torch.cuda.synchronize()
        last_nvme[0] = -1e9
        sample()
        m.seconds = time.perf_counter() - start
        if cuda:
            m.peak_gpu_allocated = int(torch.cuda.max_memory_allocated())
            m.peak_gpu_reserved = int(torch.cuda.max_memory_reserved())


def estimate_step_transient(n_params: int, stage: int | None, *, precision: str = "fp16", n_gpus: int = 1,
                            offload_optimizer: str = "none", multi_tensor: bool = True) -> int:
    """Bytes that exist only while the optimizer steps (activations are gone by then), where the states are: the
    GPU, or RAM on a runtime without one.

    Multi-tensor AdamW (PyTorch's default on GPU) makes one fp32 temporary the size of the
    parameters it updates (sqrt of the variance). DeepSpeed's mixed-precision optimizers also
    build an fp32 copy of the gradient partition to step on. Nothing of this sits on the GPU when
    the optimizer is offloaded. `multi_tensor=False`: on CPU tensors PyTorch's AdamW steps tensor by tensor
    (torch 2.x uses foreach kernels only on cuda/xpu devices), so only the gradient copy is counted.
    """
    if offload_optimizer != "none":
        return 0
    psi = int(n_params)
    adam_temporary = 4 * psi if multi_tensor else 0
    if stage is None:
        return adam_temporary
    share = psi if stage == 0 else psi // n_gpus
    fp32_grads = 4 * share if (precision != "fp32" or stage >= 1) else 0
    return fp32_grads + (4 * share if multi_tensor else 0)


def estimate_peak(config: dict[str, Any] | None, n_params: int, *, precision: str, activation_bytes: int,
                  n_gpus: int = 1, largest_layer_params: int = 0) -> tuple[int, ModelStateEstimate]:
    """Predicted peak GPU bytes of one training run: model states + max(activations, optimizer-step temporaries).

    `config` None means plain PyTorch (AMP) + AdamW. Returns (peak bytes, the model-state breakdown).
    """
    states, transient = _states_and_transient(config, n_params, precision=precision, n_gpus=n_gpus,
                                              largest_layer_params=largest_layer_params)
    return states.gpu_total + max(activation_bytes, transient), states


def _states_and_transient(config: dict[str, Any] | None, n_params: int, *, precision: str, n_gpus: int,
                          largest_layer_params: int) -> tuple[ModelStateEstimate, int]:
    """The model-state breakdown of `config` (None: plain PyTorch) and its optimizer step's temporaries (bytes)."""
    if config is None:
        states = estimate_model_states(n_params, None, precision=precision, n_gpus=n_gpus)
        stage, offload = None, "none"
    else:
        states = estimate_for_config(config, n_params, n_gpus=n_gpus, largest_layer_params=largest_layer_params)
        zero = config.get("zero_optimization", {})
        stage, offload = int(zero.get("stage", 0)), zero.get("offload_optimizer", {}).get("device", "none")
    transient = estimate_step_transient(n_params, stage, precision=precision, n_gpus=n_gpus, offload_optimizer=offload)
    return states, transient


@dataclass(frozen=True)
class RunEstimate:
    """What `estimate_run` predicts for one training run, on one GPU of `n_gpus`."""

    peak_bytes: int  # GPU: model states + max(activations, optimizer-step temporaries)
    activation_bytes: int
    states: ModelStateEstimate
    step_transient_bytes: int = 0  # the optimizer step's temporaries (`estimate_step_transient`)

    def rows(self) -> list[tuple[str, int]]:
        """(component, GPU bytes) that add up to `peak_bytes`: the model states' components, then the larger of the
        activations and the optimizer step's temporaries (they are never alive at once: backward has freed the
        activations before the optimizer steps)."""
        rows = [(c, b) for c in COMPONENTS if (b := self.states.gpu.get(c, 0))]
        if self.step_transient_bytes > self.activation_bytes:
            rows.append(("step temporaries", self.step_transient_bytes))
        elif self.activation_bytes:
            rows.append(("activations", self.activation_bytes))
        return rows

    def table(self) -> str:
        """The predicted peak on one GPU as rows that add up to it (GiB, as torch counts GPU memory), with the bytes
        per parameter of the model states and the smaller of activations / step temporaries named (not added)."""
        rows = self.rows()
        gpus = f"on each of {self.states.n_gpus} GPUs" if self.states.n_gpus > 1 else "on one GPU"
        per_param = sum(self.states.gpu.get(c, 0) for c in ("params", "grads", "optimizer")) / max(self.states.n_params, 1)
        lines = [f"{self.states.label}  ({self.states.n_params / 1e6:.1f}M params, {gpus}): predicted peak",
                 f"{'component':<18}{'GPU GiB':>9}"]
        shown = round_to_total([b / GiB for _, b in rows], 3)  # the printed rows add up to the printed peak
        notes = {"params": f"  model states: {per_param:.0f} bytes per parameter",
                 "buffers": "  DeepSpeed's gradient bucket"}
        larger = rows[-1][0] if rows and rows[-1][0] in ("activations", "step temporaries") else ""
        if larger:
            other = ("the optimizer step's temporaries", self.step_transient_bytes) if larger == "activations" else \
                ("activations", self.activation_bytes)
            notes[larger] = (f"  the larger of {'activations' if larger == 'activations' else 'the step temporaries'}"
                             f" and {other[0]} ({other[1] / GiB:.3f}): never alive at once")
        for (name, _), value in zip(rows, shown):
            lines.append(f"{name:<18}{value:>9.3f}{notes.get(name, '')}")
        lines.append(f"{'peak':<18}{self.peak_bytes / GiB:>9.3f}")
        return "\n".join(lines)


def estimate_run(config: dict[str, Any] | None, shape: Any, *, seq_len: int, precision: str,
                 checkpointing: bool, micro_batch: int | None = None, n_gpus: int = 1) -> RunEstimate:
    """Activations and peak GPU bytes of training `shape` (a `helpers.model_shape`) with `config` (notebooks 01-04),
    activations by the GPT formula (the Llama-shaped models of notebook 06: `helpers.estimate_long_context_run`).

    The micro-batch is the config's `train_micro_batch_size_per_gpu` (the config is the single source of truth);
    `micro_batch` is only for `config` None, plain PyTorch (`helpers.checks.config_micro_batch`: one that disagrees
    with the config is refused).
    """
    micro_batch = config_micro_batch(config, micro_batch, caller="estimate_run")
    act = estimate_activations(micro_batch, seq_len, shape.hidden, shape.n_layers, shape.vocab,
                               n_heads=shape.n_heads, precision=precision, checkpointing=checkpointing)
    states, transient = _states_and_transient(config, shape.n_params, precision=precision, n_gpus=n_gpus,
                                              largest_layer_params=shape.largest_layer_params)
    return RunEstimate(peak_bytes=states.gpu_total + max(act, transient), activation_bytes=act, states=states,
                       step_transient_bytes=transient)
