"""How long one optimizer step takes, predicted from the bytes and FLOPs a config moves (notebook 02, the ladder).

    limits = helpers.measure_limits(nvme_path)                   # helpers.limits: this runtime's bandwidths
    est = helpers.estimate_step_time(ds_config, shape, limits, seq_len=512)
    print(est.table())                                           # per component, then tokens/s and the roofline

The memory model says whether a config fits; this one says how fast it runs once it does. Each component is
work divided by a rate measured on this runtime (`RuntimeLimits`), per optimizer step of `grad_accum`
micro-batches. What moves is read off DeepSpeed 0.19.8 (one GPU):

- GPU compute: (6 + 2 with activation checkpointing) x N FLOPs per token for the weights (forward 2N, backward 4N,
  recomputed forward 2N) plus (12 + 4) x layers x hidden x sequence for attention (nanoGPT's `estimate_mfu`),
  at the measured matmul rate.
- ZeRO-3 with the optimizer offloaded (`runtime/zero/stage3.py`, `partition_grads`): every micro-batch copies
  each 16-bit gradient partition into the CPU gradient buffer and back to the GPU (the first micro-batch of a step:
  `grad_buffer.copy_` then `.to(device)`; later ones: `.to(device)`, `add_`, `copy_` back): 2 x 2N bytes over PCIe.
  At the accumulation boundary the fp32 gradients (4N) go to the host (`_offload_grad_partition_at_boundary`),
  and with NVMe to disk (`swap_out_gradients`).
- The NVMe optimizer step (`runtime/swap_tensor/partitioned_optimizer_swapper.py`): per sub-group, read the fp32
  master weights, Adam's two moments (12N) and the fp32 gradients (4N); DeepSpeedCPUAdam; write the 12N back;
  then the new 16-bit weights go to the GPU (2N). Without `pipeline_read`/`pipeline_write` these run one after
  another, so the predicted time is their sum; the roofline is the slowest resource (GPU, PCIe, disk, CPU) alone,
  what perfect overlap would give.
- ZeRO-2 with the optimizer on the CPU (`runtime/zero/stage_1_and_2.py`): the fp32 gradients (4N) go to the host
  every micro-batch (and come back to be accumulated after the first), CPU Adam, 16-bit weights back (2N).
- Parameters offloaded (`offload_param`): each micro-batch fetches the 16-bit weights for the forward, the
  recomputed forward and the backward (3 x 2N with checkpointing, else 2 x 2N): over PCIe from CPU, and also
  read from disk with NVMe; the updated weights are written back to disk once per step.
Without offload (plain, ZeRO 0-3 on the GPU) only compute is counted: the optimizer runs on the GPU at memory speed.
On a CPU runtime (no GPU) compute runs on the CPU and nothing crosses PCIe (the copies "to the host" are RAM copies,
not counted).
- What the bandwidths above miss, measured on the code DeepSpeed runs when the limits have it
  (`helpers.limits`, benchmarks/offload_speed.py): ZeRO-3's hooks, Python on the host that fetches, releases and
  partitions every module's parameters and gradients each micro-batch (timed on a model of the same depth, 64
  wide); the fp16 overflow check over the 16-bit host gradient buffer each optimizer step (`has_overflow`:
  isinf/isnan on the CPU); the updated fp32 weights copied into the GPU's fp16 ones (`fp16_flat.copy_(fp32)`); the
  gradient round trip and the blocks' compute rate at this width and micro-batch.
Not counted: kernel launches outside ZeRO-3's hooks, the loss-scale bookkeeping; measured/predicted says how much
they weigh.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from helpers.checks import config_micro_batch
from helpers.limits import RuntimeLimits, block_key, flops_per_token

__all__ = ["estimate_step_time"]

GB = 1e9
# fp16 tensor-core peaks without sparsity, from NVIDIA's datasheets (TFLOP/s): how project_to_gpu moves GPU-busy time
# from the GPU a row was measured on to another one. A ratio of datasheet peaks, not a measurement of either GPU.
DATASHEET_FP16_TFLOPS = {"T4": 65.0, "L4": 121.0, "A100": 312.0, "H100": 989.0, "H200": 989.0}


def training_flops_per_token(shape: Any, seq_len: int, *, checkpointing: bool = True) -> float:
    """FLOPs to train on one token: forward + backward (+ the recomputed forward with activation checkpointing)."""
    n = shape.n_params - seq_len * shape.hidden  # position embeddings are looked up, not multiplied
    return flops_per_token(n, shape.n_layers, shape.hidden, seq_len, checkpointing=checkpointing)


@dataclass
class StepTimeEstimate:
    """Predicted seconds per optimizer step by component, the resource each uses, and tokens/s (notebook 02)."""

    config: str
    tokens_per_micro_batch: int
    grad_accum: int
    components: dict[str, float] = field(default_factory=dict)  # name -> seconds per optimizer step
    resources: dict[str, str] = field(default_factory=dict)  # name -> "GPU", "PCIe", "disk" or "CPU"
    missing: list[str] = field(default_factory=list)  # limits not measured: components left out

    @property
    def tokens_per_step(self) -> int:
        return self.tokens_per_micro_batch * self.grad_accum

    @property
    def seconds(self) -> float:
        """Predicted seconds per optimizer step: the components one after another (DeepSpeed runs them so)."""
        return sum(self.components.values())

    def resource_seconds(self) -> dict[str, float]:
        """Seconds each resource is busy per optimizer step."""
        out: dict[str, float] = {}
        for name, s in self.components.items():
            out[self.resources[name]] = out.get(self.resources[name], 0.0) + s
        return out

    @property
    def roofline_seconds(self) -> float:
        """The busiest resource alone: the step time if everything else overlapped with it."""
        return max(self.resource_seconds().values(), default=0.0)

    @property
    def bottleneck(self) -> str:
        busy = self.resource_seconds()
        return max(busy, key=busy.get) if busy else ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.seconds if self.seconds else 0.0

    @property
    def roofline_tokens_per_s(self) -> float:
        return self.tokens_per_step / self.roofline_seconds if self.roofline_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "tokens_per_micro_batch": self.tokens_per_micro_batch,
                "grad_accum": self.grad_accum, "components_s": {k: round(v, 4) for k, v in self.components.items()},
                "resources": dict(self.resources), "predicted_step_s": round(self.seconds, 4),
                "roofline_step_s": round(self.roofline_seconds, 4), "bottleneck": self.bottleneck,
                "predicted_tokens_per_s": round(self.tokens_per_s, 1),
                "roofline_tokens_per_s": round(self.roofline_tokens_per_s, 1), "missing": list(self.missing)}

    def table(self, measured_s: dict[str, float] | None = None) -> str:
        """Components (seconds per optimizer step, share), the total, tokens/s and the roofline, as text."""
        measured_s = measured_s or {}
        width = max([len(k) for k in self.components] + [24])
        lines = [f"{'component':<{width}}  {'resource':<8} {'predicted s':>11}  share"
                 + (f"  {'measured s':>10}" if measured_s else "")]
        for name, s in self.components.items():
            m = f"  {measured_s[name]:>10.2f}" if name in measured_s else ""
            lines.append(f"{name:<{width}}  {self.resources[name]:<8} {s:>11.2f}  {s / self.seconds:>5.0%}{m}")
        lines.append(f"{'one optimizer step':<{width}}  {'':<8} {self.seconds:>11.2f}  "
                     f"({self.tokens_per_step:,} tokens: {self.tokens_per_s:,.0f} tokens/s predicted)")
        lines.append(f"{'roofline (' + self.bottleneck + ' alone)':<{width}}  {'':<8} {self.roofline_seconds:>11.2f}  "
                     f"({self.roofline_tokens_per_s:,.0f} tokens/s if everything else overlapped)")
        lines += [f"(not counted, not measured here: {m})" for m in self.missing]
        return "\n".join(lines)


def _rate(limits: RuntimeLimits, attr: str) -> float | None:
    v = getattr(limits, attr)
    return v if v else None


def estimate_step_time(ds_config: dict[str, Any] | None, shape: Any, limits: RuntimeLimits, *, seq_len: int,
                       micro_batch: int | None = None, grad_accum: int | None = None, checkpointing: bool = True,
                       chunked_overflow_check: bool = False, name: str = "") -> StepTimeEstimate:
    """Predicted time of one optimizer step of `ds_config` (None: plain PyTorch) for model `shape` (notebook 02).

    The micro-batch is the config's (`micro_batch` only for `ds_config` None or a config without one; one that
    disagrees with the config is refused, as by `estimate_run`: `helpers.checks.config_micro_batch`); `grad_accum`
    defaults to the config's. `chunked_overflow_check`: the run patches ZeRO-3's fp16
    overflow check (helpers.chunk_zero3_overflow_check), timed at its own measured rate. Components whose rate was not measured on this
    runtime (no GPU, no NVMe folder given to `measure_limits`) are left out and listed in `missing`.
    """
    cfg = ds_config or {}
    mb = config_micro_batch(ds_config, micro_batch, caller="estimate_step_time")
    accum = int(grad_accum or cfg.get("gradient_accumulation_steps", 1))
    zero = cfg.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    opt_dev = zero.get("offload_optimizer", {}).get("device", "none")
    param_dev = zero.get("offload_param", {}).get("device", "none")
    half = 4 if not (cfg.get("fp16", {}).get("enabled") or cfg.get("bf16", {}).get("enabled")) else 2
    pinned = bool(zero.get("offload_optimizer", {}).get("pin_memory") or zero.get("offload_param", {}).get("pin_memory"))
    n = shape.n_params
    tokens = mb * seq_len
    est = StepTimeEstimate(config=name or _config_name(cfg), tokens_per_micro_batch=tokens, grad_accum=accum)

    def add(component: str, resource: str, seconds: float | None, what: str) -> None:
        if seconds is None:
            if what not in est.missing:
                est.missing.append(what)
            return
        if resource == "PCIe" and not limits.has_gpu:
            return  # nothing crosses a PCIe link on a CPU runtime
        est.components[component] = est.components.get(component, 0.0) + seconds
        est.resources[component] = resource

    def pcie(direction: str, nbytes: float) -> float | None:
        if not limits.has_gpu:
            return 0.0  # no GPU: the "copies to the host" stay in RAM
        rate = _rate(limits, f"{direction}_{'pinned' if pinned else 'pageable'}_gbps")
        return None if rate is None else nbytes / (rate * GB)

    def disk(kind: str, nbytes: float) -> float | None:
        rate = _rate(limits, f"disk_{kind}_gbps")
        return None if rate is None else nbytes / (rate * GB)

    # the rate GPT-2 blocks of this width reach at this micro-batch, when measured; else the square-matmul peak
    tflops = limits.block_tflops.get(block_key(shape.hidden, seq_len, mb)) or _rate(limits, "matmul_tflops")
    flops = training_flops_per_token(shape, seq_len, checkpointing=checkpointing) * tokens * accum
    device = "GPU" if limits.has_gpu else "CPU"
    add(f"{device} compute", device, None if tflops is None else flops / (tflops * 1e12), "matmul rate")

    if param_dev != "none":  # weights fetched for forward, recomputed forward and backward, every micro-batch
        fetches = (3 if checkpointing else 2) * half * n * accum
        add("weights to GPU (PCIe)", "PCIe", pcie("h2d", fetches), "host-to-GPU bandwidth")
        if param_dev == "nvme":
            add("weights from disk", "disk", disk("read", fetches), "disk read bandwidth")
            add("weights to disk", "disk", disk("write", half * n), "disk write bandwidth")
    if stage == 3:  # ZeRO-3's hooks: Python on the host fetches, releases and partitions per module and parameter
        hooks = limits.zero3_micro_batch_s.get(f"{shape.n_layers} layers")
        if hooks is not None or limits.zero3_micro_batch_s:  # measured at other depths only: listed as missing
            add("ZeRO-3 hooks (host)", "CPU", None if hooks is None else hooks * accum,
                f"ZeRO-3's cost per micro-batch at {shape.n_layers} layers")
    if opt_dev != "none":
        cpu_adam = _rate(limits, "cpu_adam_params_per_s")
        if stage == 3 and cfg.get("fp16", {}).get("enabled") and limits.overflow_check_per_s:
            # has_overflow: isinf/isnan over the whole 16-bit host gradient buffer, once per optimizer step (or the
            # course's min/max per slice)
            rate = limits.overflow_check_chunked_per_s if chunked_overflow_check else limits.overflow_check_per_s
            add("fp16 overflow check (host)", "CPU", None if not rate else n / rate,
                "chunked overflow check rate" if chunked_overflow_check else "overflow check rate")
        if stage == 3:
            # partition_grads: each micro-batch, the 16-bit gradient partition to the CPU buffer and back; at the
            # rate of that very pattern when measured (limits.measure_grad_round_trip), else the two copies' rates
            trip = _rate(limits, f"grad_round_trip_{'pinned' if pinned else 'pageable'}_gbps")
            add("gradients via host (PCIe)", "PCIe",
                half * n * accum / (trip * GB) if trip and limits.has_gpu else
                _sum(pcie("d2h", half * n * accum), pcie("h2d", half * n * accum)), "PCIe bandwidth")
        else:
            # stage 1/2 with a CPU optimizer: fp32 gradients to the host each micro-batch, back to accumulate after
            add("gradients via host (PCIe)", "PCIe", _sum(pcie("d2h", 4 * n * accum),
                                                          pcie("h2d", 4 * n * (accum - 1)) if accum > 1 else 0.0),
                "PCIe bandwidth")
        if stage == 3:
            add("fp32 gradients to host (PCIe)", "PCIe", pcie("d2h", 4 * n), "GPU-to-host bandwidth")
        if opt_dev == "nvme":
            add("fp32 gradients to disk", "disk", disk("write", 4 * n), "disk write bandwidth")
            add("optimizer states + gradients from disk", "disk", disk("read", 16 * n), "disk read bandwidth")
        add("CPU Adam", "CPU", None if cpu_adam is None else n / cpu_adam, "CPU Adam rate")
        if opt_dev == "nvme":
            add("optimizer states to disk", "disk", disk("write", 12 * n), "disk write bandwidth")
        if param_dev == "none":
            # stage 3: fp16_flat.copy_(fp32_flat) per sub-group, from the fp32 weights (pinned swap buffers with
            # NVMe) at the rate of that very copy when measured; else 16-bit bytes at the plain copy rate
            weights = _rate(limits, f"weights_to_gpu_{'pinned' if opt_dev == 'nvme' or pinned else 'pageable'}_gbps")
            add("new weights to GPU (PCIe)", "PCIe",
                4 * n / (weights * GB) if weights and stage == 3 and limits.has_gpu else pcie("h2d", half * n),
                "host-to-GPU bandwidth")
    return est


def _sum(*parts: float | None) -> float | None:
    return None if any(p is None for p in parts) else float(sum(parts))  # type: ignore[arg-type]


def _config_name(cfg: dict[str, Any]) -> str:
    if not cfg:
        return "plain PyTorch"
    zero = cfg.get("zero_optimization", {})
    parts = [f"ZeRO-{zero.get('stage', 0)}"]
    for key, label in (("offload_param", "params"), ("offload_optimizer", "optimizer")):
        dev = zero.get(key, {}).get("device", "none")
        if dev != "none":
            parts.append(f"{label} on {dev.upper()}")
    return ", ".join(parts)


# The measured side: DeepSpeed 0.19.8's ZeRO-3 optimizer methods that do one component each (runtime/zero/stage3.py),
# timed in place. Name -> method; each call waits for the GPU before and after, so the seconds are the component's own.
ZERO3_PHASES = {
    "reduce + host gradient copies": "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
    "host gradient copies": "partition_grads",  # inside the one above: each micro-batch's gradient via the host
    "overflow check": "_overflow_check_and_loss_scale_update",
    "gradient norm": "_get_norm_groups",
    "optimizer states + gradients from disk": "_optimizer_states_and_gradient_swap_in",
    "CPU Adam": "_optimizer_step",
    "new weights to GPU": "_reassign_or_swap_out_partitioned_parameters",
    "optimizer states to disk": "_optimizer_states_and_gradient_swap_out",
}


class PhaseClock:
    """Seconds spent in named methods of one object, summed until `take()` (benchmarks/offload_speed.py).

        clock = PhaseClock(engine.optimizer, ZERO3_PHASES)    # wraps the bound methods in place
        ...; seconds = clock.take()                            # {"CPU Adam": 1.3, ...} since the last take
        clock.remove()

    The wrappers live on the instance (not the class) and `remove()` takes them off; a method the object does not
    have is skipped (listed in `missing`). Every call waits for the GPU before and after (torch.cuda.synchronize),
    which costs the overlap DeepSpeed might get between streams: the timed run is a measurement, not the fastest run.
    """

    def __init__(self, obj: Any, phases: dict[str, str]) -> None:
        import time

        import torch

        self.obj, self.seconds, self.missing = obj, {name: 0.0 for name in phases}, []
        self._wrapped: list[str] = []
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        for name, attr in phases.items():
            original = getattr(obj, attr, None)
            if original is None or attr in self._wrapped:
                self.missing.append(name)
                continue

            def timed(*args: Any, _original_fn: Any = original, _phase: str = name, **kwargs: Any) -> Any:
                sync()
                started = time.perf_counter()
                try:
                    return _original_fn(*args, **kwargs)
                finally:
                    sync()
                    self.seconds[_phase] += time.perf_counter() - started

            setattr(obj, attr, timed)
            self._wrapped.append(attr)

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last take (rounded to 0.1 ms), then zero."""
        out = {k: round(v, 4) for k, v in self.seconds.items() if k not in self.missing}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out

    def remove(self) -> None:
        for attr in self._wrapped:
            try:
                delattr(self.obj, attr)
            except AttributeError:
                pass
        self._wrapped.clear()


@dataclass
class GpuProjection:
    """A measured optimizer step moved to another GPU (`project_to_gpu`): seconds and tokens/s, and what it assumes."""

    target: str
    measured_on: str
    measured_step_s: float
    gpu_busy_s: float  # the step-time model's GPU compute on the measured GPU (its blocks' measured TFLOP/s)
    target_gpu_s: float  # the same FLOPs on the target, scaled by the two datasheet peaks
    step_s: float
    tokens_per_step: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def text(self) -> str:
        return (f"{self.target} estimate: {self.tokens_per_s:,.0f} tokens/s ({self.step_s:.1f} s per optimizer step = "
                f"{self.measured_step_s:.1f} s measured on the {self.measured_on} - {self.gpu_busy_s:.1f} s of its GPU "
                f"compute + {self.target_gpu_s:.1f} s for the same FLOPs at the {self.target}'s share of the datasheet "
                f"fp16 peaks, {DATASHEET_FP16_TFLOPS[self.target]:g} / {DATASHEET_FP16_TFLOPS[self.measured_on]:g} "
                "TFLOP/s); disk, host CPU and copies as measured in the emulation (not a measurement on a "
                f"{self.target}: its disk and PCIe link differ)")


def project_to_gpu(components_s: dict[str, float], measured_step_s: float, tokens_per_step: int, *,
                   measured_on: str = "H200", target: str = "T4") -> GpuProjection:
    """A step measured on GPU `measured_on`, estimated for GPU `target` (notebook 02: the best NVMe row on a T4).

    Takes the row's measured seconds per optimizer step, removes the step-time model's GPU compute (`components_s`
    of its estimate: FLOPs at the blocks' TFLOP/s measured with the row) and adds the same FLOPs at that rate times
    the ratio of the two datasheet fp16 peaks (`DATASHEET_FP16_TFLOPS`). Everything else - disk, ZeRO-3's hooks and
    CPU Adam on the host, the copies - stays as measured: with the Colab emulation's 2 CPUs and RAM limit it is the
    host side of a Colab VM, but the disk and the PCIe link are the measuring machine's."""
    for gpu in (measured_on, target):
        if gpu not in DATASHEET_FP16_TFLOPS:
            raise ValueError(f"no datasheet fp16 peak for {gpu!r}; known: {', '.join(DATASHEET_FP16_TFLOPS)}")
    if measured_step_s <= 0 or tokens_per_step <= 0:
        raise ValueError(f"a measured step needs positive seconds and tokens, got {measured_step_s} s, "
                         f"{tokens_per_step} tokens")
    busy = float(components_s.get("GPU compute", 0.0))
    target_busy = busy * DATASHEET_FP16_TFLOPS[measured_on] / DATASHEET_FP16_TFLOPS[target]
    return GpuProjection(target, measured_on, measured_step_s, busy, target_busy,
                         measured_step_s - busy + target_busy, tokens_per_step)
