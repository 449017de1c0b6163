"""What fills memory, estimated before a run and measured during it (notebooks 00-05).

Model states per parameter (the ZeRO paper's 2Ψ + 2Ψ + 12Ψ for mixed-precision Adam):
16-bit params 2 bytes, 16-bit grads 2 bytes, fp32 master weights + Adam momentum + variance
12 bytes. ZeRO stage 1 partitions the optimizer states over N GPUs, stage 2 also the
gradients, stage 3 also the parameters. Offload moves the optimizer states (and at stage 3
the parameters) to CPU RAM or an NVMe folder. DeepSpeed's own estimators
(`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`) are shown
next to this breakdown by `deepspeed_estimate`.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from helpers.hardware import Runtime

from helpers.config import (OFFLOAD_KINDS, ConfigError, check_number, check_nvme_buffers,  # noqa: E402
                            check_offload_device)

GiB = 1024**3
GB = 1000**3
COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers", "staging")
# ZeRO-3 with offload holds more host RAM than its tensors add up to: DeepSpeed's swap and copy staging
# (pinned blocks that torch's host allocator rounds up and caches) and per-layer tensors freed into glibc's
# heap during initialisation. Measured in fresh processes (reports/ladder.json, H200 capped to T4 budget,
# fp16, 355M-1.5B, four stage-3 offload configs): 2.9-3.9 bytes/param above the named components.
STAGE3_OFFLOAD_STAGING_BYTES_PER_PARAM = 3.5
# Pre-flight keeps this share of the RAM budget free: the RAM estimates of reports/ladder.json are within about 5 %
# of the measured peaks (both ways), and a Colab kernel that runs out of RAM is killed without a Python error.
RAM_ESTIMATE_MARGIN = 0.05


def pinned_bytes(nbytes: int) -> int:
    """What a pinned (page-locked) host buffer of `nbytes` really takes: torch's caching host allocator rounds each
    block up to the next power of two (1.55 GB of GPT-2 large's fp16 parameters take 2 GiB)."""
    nbytes = int(nbytes)
    return 1 << (nbytes - 1).bit_length() if nbytes > 1 else nbytes


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
        """A fixed-width table of the breakdown in GiB."""
        lines = [f"{self.label}  ({self.n_params / 1e6:.1f}M params, {self.n_gpus} GPU(s))",
                 f"{'component':<12}{'GPU GiB':>10}{'CPU GiB':>10}{'NVMe GiB':>10}"]
        for comp in COMPONENTS + ("model copy",):
            g, c, n = self.gpu.get(comp, 0), self.cpu.get(comp, 0), self.nvme.get(comp, 0)
            if g or c or n:
                lines.append(f"{comp:<12}{g / GiB:>10.3f}{c / GiB:>10.3f}{n / GiB:>10.3f}")
        lines.append(f"{'total':<12}{self.gpu_total / GiB:>10.3f}{self.cpu_total / GiB:>10.3f}"
                     f"{self.nvme_total / GiB:>10.3f}")
        return "\n".join(lines)


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
    overlap_comm: bool = False,
    nvme_buffer_count: int = 8,
    nvme_buffer_size: int = 100_000_000,
    sub_group_size: int = 1_000_000_000,
    zero_init: bool = False,
) -> ModelStateEstimate:
    """Model-state bytes per GPU and per node CPU for a ZeRO `stage` (None: plain PyTorch AMP + AdamW).

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
    gradients then live on NVMe beside the optimizer states: 16 Ψ on disk). ZeRO-3 with offload adds
    `STAGE3_OFFLOAD_STAGING_BYTES_PER_PARAM` of host RAM ('staging', measured, see there).
    """
    _check_model_inputs(n_params, largest_layer_params)
    if stage is not None and (isinstance(stage, bool) or not isinstance(stage, int)):
        fix = f"stage={int(stage)}" if isinstance(stage, float) and stage in (0, 1, 2, 3) else "stage=0..3"
        raise ConfigError(f"stage must be None (plain PyTorch) or an int 0..3 (got {stage!r}). Fix: {fix}.")
    check_offload_device("offload_optimizer", offload_optimizer)
    check_offload_device("offload_param", offload_param)
    check_number("n_gpus", n_gpus, positive=True, integer=True, example=1)
    psi = int(n_params)
    n = int(n_gpus)
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
        target = cpu if offload_optimizer == "cpu" else nvme
        target["optimizer"] = opt_share * n  # all ranks of the node share the host
        sub_group = min(int(sub_group_size), psi)
        if stage == 3:
            # 16-bit gradient partitions, then the fp32 gradients the optimizer steps on; with NVMe those are
            # swapped out with their sub-group (DeepSpeed's swap_out_gradients) and one sub-group is in RAM
            cpu["grads"] = e * psi + (4 * psi if offload_optimizer == "cpu" else 4 * sub_group)
            if offload_optimizer == "nvme":
                nvme["grads"] = 4 * psi
        else:
            cpu["grads"] = 4 * psi // n * n  # fp32 gradient partition per rank, on the host
    # parameters
    if offload_param == "none":
        gpu["params"] = param_share
    else:
        parts.append(f"params->{offload_param}")
        live = max(largest_layer_params, 1)
        gpu["params"] = 2 * e * live  # the layer being computed and the one being fetched
        if offload_param == "cpu":
            # one flat 16-bit buffer per parameter group, always pinned (stage3.py
            # _create_param_groups_fp16_flat_cpu_memory); torch's CUDA host allocator rounds it up to a power of two
            cpu["params"] = pinned_bytes(param_share * n)
        else:
            nvme["params"] = param_share * n
            cpu["buffers"] = nvme_buffer_count * nvme_buffer_size * e
    if offload_optimizer == "nvme":
        # optimizer swap buffers: 4 of one sub-group each, fp32
        cpu["buffers"] = cpu.get("buffers", 0) + 4 * min(int(sub_group_size), psi) * 4
    if stage in (1, 2) and reduce_bucket_elements:
        # contiguous gradients: torch.empty(reduce_bucket_size) in the model dtype, x2 with overlap_comm
        gpu["buffers"] = reduce_bucket_elements * e * (2 if overlap_comm else 1)
    if stage == 3 and (offload_optimizer != "none" or offload_param != "none"):
        cpu["staging"] = int(STAGE3_OFFLOAD_STAGING_BYTES_PER_PARAM * psi)
    cpu["model copy"] = 0 if (zero_init and stage == 3) else 4 * psi
    if precision:
        parts.append(precision)
    return ModelStateEstimate(" + ".join(parts), psi, n, gpu=gpu, cpu=cpu, nvme=nvme)


def _check_model_inputs(n_params: Any, largest_layer_params: Any) -> None:
    """A parameter count must be a positive number, the largest layer's a non-negative one."""
    check_number("n_params", n_params, positive=True, integer=False, example=124_439_808,
                 hint=" (GPT-2 124M; helpers.model_shape(name).n_params gives a model's count)")
    check_number("largest_layer_params", largest_layer_params, positive=False, integer=False, example=0,
                 hint=" (unknown), or helpers.model_shape(name).largest_layer_params")


def model_states_per_gpu(n_params: int, precision: str = "fp16",
                         gpu_counts: tuple[int, ...] = (1, 2, 4, 8)) -> dict[int, dict[int, int]]:
    """{stage: {n_gpus: model-state bytes per GPU}} for ZeRO 0-3, without buffers (notebook 01, benchmarks)."""
    return {s: {n: estimate_model_states(n_params, s, precision=precision, n_gpus=n,
                                         reduce_bucket_elements=0).gpu_total for n in gpu_counts}
            for s in range(4)}


def estimate_for_config(config: dict[str, Any], n_params: int, *, n_gpus: int = 1,
                        largest_layer_params: int = 0, zero_init: bool = False) -> ModelStateEstimate:
    """`estimate_model_states` read off a DeepSpeed config dict (stage, offload, precision)."""
    zero = config.get("zero_optimization", {})
    precision = ("fp16" if config.get("fp16", {}).get("enabled") else
                 "bf16" if config.get("bf16", {}).get("enabled") else "fp32")
    off_opt = zero.get("offload_optimizer", {}).get("device", "none")
    off_par = zero.get("offload_param", {}).get("device", "none")
    kwargs: dict[str, Any] = {"sub_group_size": int(zero.get("sub_group_size", 1_000_000_000))}
    if off_par == "nvme":
        kwargs.update(nvme_buffer_count=zero["offload_param"].get("buffer_count", 5),
                      nvme_buffer_size=int(zero["offload_param"].get("buffer_size", 100_000_000)))
    return estimate_model_states(
        n_params, int(zero.get("stage", 0)), precision=precision, offload_optimizer=off_opt,
        offload_param=off_par, n_gpus=n_gpus, largest_layer_params=largest_layer_params,
        reduce_bucket_elements=int(zero.get("reduce_bucket_size", 500_000_000))
        if zero.get("contiguous_gradients", True) else 0,
        overlap_comm=bool(zero.get("overlap_comm", False)), zero_init=zero_init, **kwargs)


def deepspeed_estimate(n_params: int, stage: int, *, offload_optimizer: str = "none",
                       offload_param: str = "none", n_gpus: int = 1, largest_layer_params: int = 0,
                       zero_init: bool = True) -> dict[str, int] | None:
    """DeepSpeed's own estimate {'gpu': bytes, 'cpu': bytes} for stage 2 or 3 (None for 0/1)."""
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
    """(total parameters counted once, largest parameter count of one module) - DeepSpeed's counting."""
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

def _rss_bytes() -> int:
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
    peak_nvme_bytes: int = 0
    seconds: float = 0.0
    samples: list[dict[str, float]] = field(default_factory=list)
    started: float = 0.0  # time.perf_counter() when measuring began; samples' "t" counts from here

    def peak_between(self, key: str, t0: float, t1: float) -> float:
        """Largest sample of `key` ('rss', 'gpu_allocated', ...) with t0 <= t <= t1 (seconds from the start)."""
        return max((s[key] for s in self.samples if key in s and t0 <= s["t"] <= t1), default=0.0)

    @property
    def peak_gpu_gib(self) -> float:
        return self.peak_gpu_allocated / GiB

    @property
    def peak_rss_gb(self) -> float:
        return self.peak_rss / GB

    def summary(self) -> str:
        return (f"peak GPU allocated {self.peak_gpu_allocated / GiB:.3f} GiB (reserved "
                f"{self.peak_gpu_reserved / GiB:.3f} GiB), peak RSS {self.peak_rss / GB:.2f} GB, "
                f"NVMe {self.peak_nvme_bytes / GB:.2f} GB, {self.seconds:.1f} s")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def measure_peak(nvme_path: str | os.PathLike[str] | None = None, interval_s: float = 0.05,
                 nvme_interval_s: float = 1.0) -> Iterator[Measurement]:
    """Record peak GPU allocated/reserved, peak process RSS, NVMe folder bytes and a time series.

    Peak GPU statistics are reset on entry, so each block measures only itself.
    """
    import torch

    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    m = Measurement(baseline_gpu_allocated=int(torch.cuda.memory_allocated()) if cuda else 0,
                    baseline_rss=_rss_bytes())
    m.peak_rss = m.baseline_rss
    stop = threading.Event()
    start = time.perf_counter()
    m.started = start
    last_nvme = [-1e9]

    def sample() -> None:
        now = time.perf_counter()
        row = {"t": now - start, "rss": float(_rss_bytes())}
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


# ---------------------------------------------------------------- pre-flight

class BudgetError(RuntimeError):
    """A config predicted not to fit this runtime; the message names a config that would."""


@dataclass
class PreflightReport:
    """Estimated need against this runtime's budget (notebooks 00-02).

    `gpu_needed` is the predicted peak: model states + the larger of the activations and the optimizer step's
    temporaries (`estimate_step_transient`). `ram_needed` includes `ram_in_use` (the process, or the kernel plus a
    fresh child process). When it does not fit, `suggestion_kind` names the first course config that does
    (helpers.config.OFFLOAD_KINDS, or "zero2"), checked by the same rules, and `suggestion_report` is its check.
    """

    estimate: ModelStateEstimate
    gpu_needed: int
    gpu_budget: int
    ram_needed: int
    ram_budget: int
    disk_needed: int
    disk_budget: int
    suggestion: dict[str, Any] | None = None
    suggestion_zero_init: bool = False
    suggestion_kind: str | None = None
    suggestion_report: "PreflightReport | None" = None
    smaller_model: str | None = None  # when no course config fits: the largest ladder model that does
    smaller_model_kind: str | None = None
    ram_margin: float = RAM_ESTIMATE_MARGIN  # share of the RAM budget kept free for the estimate's error

    @property
    def problems(self) -> list[str]:
        out = []
        if self.gpu_budget and self.gpu_needed > self.gpu_budget:
            out.append(f"GPU: needs ~{self.gpu_needed / GiB:.2f} GiB, budget {self.gpu_budget / GiB:.2f} GiB")
        if self.ram_needed > self.ram_budget * (1 - self.ram_margin):
            margin = f" ({self.ram_margin:.0%} of it kept free for the estimate's error)" if self.ram_margin else ""
            out.append(f"CPU RAM: needs ~{self.ram_needed / GB:.2f} GB, budget {self.ram_budget / GB:.2f} GB{margin}")
        if self.disk_needed > self.disk_budget:
            out.append(f"disk: needs ~{self.disk_needed / GB:.2f} GB, {self.disk_budget / GB:.2f} GB free")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems

    def needs(self) -> str:
        """'GPU 3.9 GiB, RAM 11.7 GB, disk 24.9 GB' (what this check predicts)."""
        gpu = f"GPU {self.gpu_needed / GiB:.2f} GiB, " if self.gpu_budget else ""
        return f"{gpu}RAM {self.ram_needed / GB:.2f} GB" + (f", disk {self.disk_needed / GB:.1f} GB"
                                                            if self.disk_needed else "")

    def fix(self) -> str:
        """The fix to print with a refusal: a course config that passes this check, or what would."""
        if self.suggestion_kind is not None:
            call = ("helpers.build_ds_config(2, runtime=runtime)" if self.suggestion_kind == "zero2" else
                    f"helpers.offload_config({self.suggestion_kind!r}, runtime"
                    + (", nvme_path=..." if "nvme" in self.suggestion_kind else "")
                    + (", largest_param=..." if self.suggestion_kind == "zero3_nvme_all" else "") + ")")
            built = (" with the model built under deepspeed.zero.Init (HfDeepSpeedConfig, helpers.build_zero3_model)"
                     if self.suggestion_zero_init else "")
            need = f" (predicted: {self.suggestion_report.needs()})" if self.suggestion_report else ""
            return f"Fix: the course's {self.suggestion_kind!r} config, {call}{built}{need}"
        if self.smaller_model:
            return (f"Fix: none of the course's configs fits this model here; a smaller one does: {self.smaller_model} "
                    f"with {self.smaller_model_kind!r}. Or a machine with more memory")
        return ("Fix: none of the course's configs fits this model here, nor a smaller GPT-2: train a smaller model, "
                "shorten sequences or micro-batch, or move to a machine with more memory")

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit: " + "; ".join(self.problems)
        gpu = (f"GPU {self.gpu_needed / GiB:.2f} / {self.gpu_budget / GiB:.2f} GiB" if self.gpu_budget
               else "no GPU (all of it in RAM)")
        return (f"{self.estimate.label}: {gpu}, "
                f"RAM {self.ram_needed / GB:.2f} / {self.ram_budget / GB:.2f} GB, "
                f"disk {self.disk_needed / GB:.2f} / {self.disk_budget / GB:.2f} GB -> {verdict}")


# Tried in order when a config does not fit: cheapest in speed first.
# ZeRO-2 without offload, then the course's offload configs (helpers.config.OFFLOAD_KINDS) in their order.
FALLBACK_LADDER: tuple[tuple[str | None, dict[str, Any]], ...] = (
    (None, {"stage": 2}), *OFFLOAD_KINDS.items())


def _report(est: ModelStateEstimate, runtime: "Runtime", activation_bytes: int, nvme_path: Any,
            ram_in_use: int, transient: int = 0) -> PreflightReport:
    if runtime.has_gpu:
        gpu_needed, ram_needed = est.gpu_total + max(activation_bytes, transient), est.cpu_total + ram_in_use
    else:  # on CPU what would sit on the GPU sits in RAM, and the model built on CPU is not copied
        cpu_total = est.cpu_total - est.cpu.get("model copy", 0)
        gpu_needed, ram_needed = 0, est.gpu_total + cpu_total + max(activation_bytes, transient) + ram_in_use
    disk_budget = int(shutil.disk_usage(nvme_path).free) if (nvme_path and os.path.isdir(nvme_path)) \
        else runtime.disk_free_bytes
    return PreflightReport(est, gpu_needed, runtime.vram_budget_bytes, ram_needed, runtime.ram_budget_bytes,
                           est.nvme_total, disk_budget)


def _check(config: dict[str, Any], n_params: int, runtime: "Runtime", largest_layer_params: int,
           activation_bytes: int, nvme_path: Any, zero_init: bool, ram_in_use: int) -> PreflightReport:
    """Pre-flight of one config, without suggestions."""
    est = estimate_for_config(config, n_params, largest_layer_params=largest_layer_params, zero_init=zero_init)
    zero = config.get("zero_optimization", {})
    transient = estimate_step_transient(n_params, int(zero.get("stage", 0)), precision=est.label.rsplit(" + ", 1)[-1],
                                        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none"))
    return _report(est, runtime, activation_bytes, nvme_path, ram_in_use, transient)


def _candidates(runtime: "Runtime", precision: str, largest_layer_params: int, nvme_path: Any
                ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(kind name, build_ds_config arguments, config) for each course config, in FALLBACK_LADDER's order."""
    from helpers.config import build_ds_config, offload_config

    out = []
    common = dict(check_paths=False, nvme_path=nvme_path or "/nvme")
    for kind, candidate in FALLBACK_LADDER:
        if kind is None:
            cfg = build_ds_config(**candidate, precision=precision, **common)
        else:
            cfg = offload_config(kind, runtime, largest_param=max(largest_layer_params, 1), precision=precision,
                                 **common)
        out.append((kind or "zero2", dict(candidate), cfg))
    return out


def _check_preflight_inputs(config: Any, n_params: Any, runtime: Any, largest_layer_params: Any,
                            activation_bytes: Any) -> None:
    """preflight's arguments, and the NVMe parameter swap buffers of `config`, before anything is estimated."""
    if not isinstance(config, dict):
        raise ConfigError(f"preflight needs a DeepSpeed config dict (got {config!r}). Fix: "
                          "preflight(helpers.build_ds_config(2, runtime=runtime), n_params, runtime).")
    if not hasattr(runtime, "ram_budget_bytes"):
        raise ConfigError(f"preflight needs the runtime to compare with (got {runtime!r}). "
                          "Fix: runtime=helpers.detect_runtime().")
    _check_model_inputs(n_params, largest_layer_params)
    check_number("activation_bytes", activation_bytes, positive=False, integer=False, example=0,
                 hint=", or helpers.estimate_activations(...)")
    offload_param = (config.get("zero_optimization") or {}).get("offload_param") or {}
    if offload_param.get("device") == "nvme":
        fp32 = not (config.get("fp16", {}).get("enabled") or config.get("bf16", {}).get("enabled"))
        check_nvme_buffers(offload_param.get("buffer_count", 5), offload_param.get("buffer_size", 100_000_000),
                           element_bytes=4 if fp32 else 2, largest_param=int(largest_layer_params))


def preflight(config: dict[str, Any], n_params: int, runtime: "Runtime", *, largest_layer_params: int = 0,
              activation_bytes: int = 0, nvme_path: str | None = None, zero_init: bool = False,
              ram_in_use: int | None = None, raise_on_failure: bool = True) -> PreflightReport:
    """Compare the estimate for `config` with this runtime's VRAM/RAM/disk before allocating anything.

    `ram_in_use` is the RAM already taken beside the run (default: this process's RSS; notebook 02 passes the
    kernel's RSS plus a fresh child process's). Raises BudgetError (when `raise_on_failure`) naming each overflow
    and the first course config that passes this same check (`PreflightReport.fix`), or, when none does, the
    largest GPT-2 that one of them fits.
    A config with parameters on NVMe has its swap buffers checked first (`check_nvme_buffers`, against
    `largest_layer_params` when given).
    """
    _check_preflight_inputs(config, n_params, runtime, largest_layer_params, activation_bytes)
    if ram_in_use is None:
        ram_in_use = _rss_bytes()
    nvme_path = nvme_path or config.get("zero_optimization", {}).get("offload_optimizer", {}).get("nvme_path") \
        or config.get("zero_optimization", {}).get("offload_param", {}).get("nvme_path")
    report = _check(config, n_params, runtime, largest_layer_params, activation_bytes, nvme_path, zero_init,
                    ram_in_use)
    if report.fits:
        return report
    est = report.estimate
    precision = est.label.rsplit(" + ", 1)[-1]
    for kind, args, cand_cfg in _candidates(runtime, precision, largest_layer_params, nvme_path):
        cand_init = zero_init or args["stage"] == 3
        cand = _check(cand_cfg, n_params, runtime, largest_layer_params, activation_bytes, nvme_path, cand_init,
                      ram_in_use)
        if cand.fits:
            report.suggestion, report.suggestion_zero_init = args, cand_init
            report.suggestion_kind, report.suggestion_report = kind, cand
            break
    if report.suggestion is None:
        report.smaller_model, report.smaller_model_kind = _smaller_model_that_fits(
            n_params, runtime, precision, activation_bytes, nvme_path, ram_in_use)
    if raise_on_failure:
        ram_problem = any(p.startswith("CPU RAM") for p in report.problems)
        model_copy_counted = runtime.has_gpu and est.cpu.get("model copy", 0) > 0
        hint = "" if not (ram_problem and model_copy_counted) else (
            " (it counts the fp32 model built on CPU before deepspeed.initialize"
            + (": build it under deepspeed.zero.Init / HfDeepSpeedConfig to avoid that)"
               if int(config.get("zero_optimization", {}).get("stage", 0)) == 3 else ")"))
        raise BudgetError(f"{est.label} is predicted not to fit this runtime ({runtime.label}): "
                          + "; ".join(report.problems) + hint + ". " + report.fix() + ".")
    return report


def _smaller_model_that_fits(n_params: int, runtime: "Runtime", precision: str, activation_bytes: int,
                             nvme_path: Any, ram_in_use: int) -> tuple[str | None, str | None]:
    """The largest GPT-2 of the course's ladder, smaller than `n_params`, that a course config fits (and which)."""
    from helpers.models import GPT2_LADDER, model_shape

    for name in reversed(list(GPT2_LADDER)):
        shape = model_shape(name)
        if shape.n_params >= n_params:
            continue
        for kind, args, cfg in _candidates(runtime, precision, shape.largest_layer_params, nvme_path):
            if _check(cfg, shape.n_params, runtime, shape.largest_layer_params, activation_bytes, nvme_path,
                      args["stage"] == 3, ram_in_use).fits:
                return name, kind
    return None, None


def estimate_step_transient(n_params: int, stage: int | None, *, precision: str = "fp16", n_gpus: int = 1,
                            offload_optimizer: str = "none") -> int:
    """GPU bytes that exist only while the optimizer steps (activations are gone by then).

    Multi-tensor AdamW (PyTorch's default on GPU) makes one fp32 temporary the size of the
    parameters it updates (sqrt of the variance). DeepSpeed's mixed-precision optimizers also
    build an fp32 copy of the gradient partition to step on. Nothing of this sits on the GPU when
    the optimizer is offloaded.
    """
    if offload_optimizer != "none":
        return 0
    psi = int(n_params)
    if stage is None:
        return 4 * psi
    share = psi if stage == 0 else psi // n_gpus
    fp32_grads = 4 * share if (precision != "fp32" or stage >= 1) else 0
    return fp32_grads + 4 * share


def estimate_peak(config: dict[str, Any] | None, n_params: int, *, precision: str, activation_bytes: int,
                  n_gpus: int = 1, largest_layer_params: int = 0) -> tuple[int, ModelStateEstimate]:
    """Predicted peak GPU bytes of one training run: model states + max(activations, optimizer-step temporaries).

    `config` None means plain PyTorch (AMP) + AdamW. Returns (peak bytes, the model-state breakdown).
    """
    if config is None:
        states = estimate_model_states(n_params, None, precision=precision, n_gpus=n_gpus)
        stage, offload = None, "none"
    else:
        states = estimate_for_config(config, n_params, n_gpus=n_gpus, largest_layer_params=largest_layer_params)
        zero = config.get("zero_optimization", {})
        stage, offload = int(zero.get("stage", 0)), zero.get("offload_optimizer", {}).get("device", "none")
    transient = estimate_step_transient(n_params, stage, precision=precision, n_gpus=n_gpus, offload_optimizer=offload)
    return states.gpu_total + max(activation_bytes, transient), states


@dataclass(frozen=True)
class RunEstimate:
    """What `estimate_run` predicts for one training run, on one GPU of `n_gpus`."""

    peak_bytes: int  # GPU: model states + max(activations, optimizer-step temporaries)
    activation_bytes: int
    states: ModelStateEstimate


def estimate_run(config: dict[str, Any] | None, shape: Any, *, seq_len: int, precision: str,
                 checkpointing: bool, micro_batch: int | None = None, n_gpus: int = 1) -> RunEstimate:
    """Activations and peak GPU bytes of training `shape` (a `helpers.model_shape`) with `config` (notebooks 01-04).

    The micro-batch is the config's `train_micro_batch_size_per_gpu` (the config is the single source of truth);
    `micro_batch` is only for `config` None, plain PyTorch.
    """
    if config is not None:
        configured = config.get("train_micro_batch_size_per_gpu")
        if micro_batch is not None and configured is not None and int(configured) != int(micro_batch):
            raise ValueError(f"micro_batch={micro_batch} but the config says train_micro_batch_size_per_gpu="
                             f"{configured}. Fix: leave micro_batch out; the config's value is used.")
        micro_batch = int(configured if configured is not None else micro_batch or 1)
    if micro_batch is None:
        raise ValueError("estimate_run(None, ...) is plain PyTorch: pass micro_batch=.")
    act = estimate_activations(micro_batch, seq_len, shape.hidden, shape.n_layers, shape.vocab,
                               n_heads=shape.n_heads, precision=precision, checkpointing=checkpointing)
    peak, states = estimate_peak(config, shape.n_params, precision=precision, activation_bytes=act, n_gpus=n_gpus,
                                 largest_layer_params=shape.largest_layer_params)
    return RunEstimate(peak_bytes=peak, activation_bytes=act, states=states)
