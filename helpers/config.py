"""Build DeepSpeed JSON configs, checked before anything expensive runs.

Notebook 00 writes its first config literally; from notebook 01 on, `build_ds_config` writes them.
Every bad input raises `ConfigError` with a message that says the fix; the result is then
validated by DeepSpeed's own config classes (`validate_ds_config`).
The files in ``configs/`` are `write_course_configs()` output (Colab T4 target: fp16);
a test regenerates them and checks they are equal.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helpers.hardware import Runtime

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
PRECISIONS = ("auto", "fp16", "bf16", "fp32")
OPTIMIZERS = ("AdamW", "Adam")
SCHEDULERS = (None, "WarmupLR", "WarmupDecayLR")


class ConfigError(ValueError):
    """A DeepSpeed config that cannot work here; the message says how to fix it."""


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer (got {value!r}). Fix: pass {name}=1 or more; "
                          "to fit less memory per step, lower micro_batch_size and raise grad_accum_steps.")


def check_nvme_path(path: str | os.PathLike[str] | None, bytes_needed: int = 0) -> Path:
    """The NVMe offload folder must exist, be writable and have `bytes_needed` free (notebook 02)."""
    if path is None or str(path) == "":
        raise ConfigError("NVMe offload needs a folder on a fast local disk. Fix: nvme_path='/content/nvme' "
                          "on Colab (create it first: os.makedirs(nvme_path, exist_ok=True)).")
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"NVMe offload folder {str(p)!r} does not exist. Fix: create it first "
                          f"(os.makedirs({str(p)!r}, exist_ok=True)) or pass another nvme_path.")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"NVMe offload folder {str(p)!r} is not writable by this user. "
                          "Fix: pick a folder you own, e.g. under /tmp or /content.")
    try:
        with tempfile.NamedTemporaryFile(dir=p):
            pass
    except OSError as exc:
        raise ConfigError(f"NVMe offload folder {str(p)!r} is not writable ({exc}). "
                          "Fix: pick a folder you own on a local disk.") from exc
    free = shutil.disk_usage(p).free
    if bytes_needed and free < bytes_needed:
        raise ConfigError(f"NVMe offload folder {str(p)!r} has {free / 1e9:.1f} GB free but this config needs "
                          f"about {bytes_needed / 1e9:.1f} GB. Fix: free disk space, point nvme_path at a "
                          "larger disk, offload only the optimizer, or train a smaller model.")
    return p


def _resolve_precision(precision: str, runtime: "Runtime | None") -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {PRECISIONS} (got {precision!r}). Fix: precision='auto' "
                          "picks fp16 on a T4, bf16 on Ampere or newer, fp32 on CPU.")
    if runtime is None:
        if precision == "auto":
            raise ConfigError("precision='auto' needs the runtime to choose from. "
                              "Fix: pass runtime=helpers.detect_runtime(), or an explicit precision.")
        return precision
    if precision == "auto":
        return runtime.precision
    if precision == "fp16" and not runtime.has_gpu:
        raise ConfigError("fp16 is not supported by DeepSpeed on CPU ('Type fp16 is not supported on your "
                          "device'). Fix: precision='fp32' (or 'auto'); bf16 also runs on CPU, ~10x slower.")
    if precision == "bf16" and runtime.has_gpu and not runtime.native_bf16:
        cc = ".".join(map(str, runtime.compute_capability or ()))
        raise ConfigError(f"bf16 asked for, but {runtime.gpu_name} (compute capability {cc}) has no native "
                          "bf16: it would be emulated, slowly. Fix: precision='fp16' (or 'auto').")
    if precision == "bf16" and runtime.t4_budget:
        raise ConfigError("bf16 asked for in T4 budget mode, but a T4 has no native bf16. "
                          "Fix: precision='fp16' (or 'auto'), or switch T4 budget mode off.")
    return precision


def _offload_section(device: str, nvme_path: str | None, what: str,
                     buffer_count: int, buffer_size: int, pin_memory: bool) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        section["nvme_path"] = str(nvme_path)
        if what == "param":
            section.update(buffer_count=buffer_count, buffer_size=buffer_size, max_in_cpu=0)
        else:
            section.update(buffer_count=4, fast_init=False)
    return section


def build_ds_config(
    stage: int = 2,
    *,
    precision: str = "auto",
    runtime: "Runtime | None" = None,
    micro_batch_size: int = 4,
    grad_accum_steps: int = 1,
    world_size: int = 1,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    nvme_path: str | None = None,
    nvme_bytes_needed: int = 0,
    check_paths: bool = True,
    nvme_buffer_count: int = 8,
    nvme_buffer_size: int = 100_000_000,
    pin_memory: bool = False,
    sub_group_size: int = 100_000_000,
    prefetch_bucket_size: int = 50_000_000,
    max_live_parameters: int = 100_000_000,
    initial_scale_power: int = 16,
    optimizer: str = "AdamW",
    lr: float = 1e-4,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    scheduler: str | None = "WarmupLR",
    warmup_steps: int = 10,
    total_steps: int | None = None,
    gradient_clipping: float | None = 1.0,
    activation_checkpointing: bool = False,
    steps_per_print: int = 10_000,
) -> dict[str, Any]:
    """A DeepSpeed config dict for ZeRO `stage` 0-3 with optional CPU/NVMe offload (notebooks 00-05).

    Offload buffers are not pinned by default (`pin_memory`): page-locked host memory is faster to copy but
    comes out of the same small RAM that offload already fills. `sub_group_size` (stage 3) is how many
    elements the optimizer steps at a time: with NVMe it sizes the swap buffers held in RAM.
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3 (got {stage!r}). Stage 1 partitions optimizer "
                          "states, 2 also gradients, 3 also parameters. Fix: pass stage=0..3.")
    for name, value in (("micro_batch_size", micro_batch_size), ("grad_accum_steps", grad_accum_steps),
                        ("world_size", world_size)):
        _check_int(name, value)
    for name, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device not in OFFLOAD_DEVICES:
            raise ConfigError(f"{name} must be one of {OFFLOAD_DEVICES} (got {device!r}).")
    if offload_param != "none" and stage != 3:
        raise ConfigError(f"Parameter offload needs ZeRO stage 3 (got stage {stage}): only stage 3 partitions "
                          "parameters. Fix: stage=3, or keep stage and use offload_optimizer='cpu' with "
                          "offload_param='none' (ZeRO-Offload works at stages 1 and 2).")
    if offload_optimizer != "none" and stage == 0:
        raise ConfigError("Optimizer offload needs ZeRO stage 1, 2 or 3 (got stage 0). Fix: stage=2 "
                          "(the usual ZeRO-Offload setting) or offload_optimizer='none'.")
    if offload_optimizer == "nvme" and stage != 3:
        raise ConfigError(f"NVMe optimizer offload (ZeRO-Infinity) needs ZeRO stage 3 (got stage {stage}). "
                          "Fix: stage=3, or offload_optimizer='cpu' at stage 1/2.")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {OPTIMIZERS} (got {optimizer!r}).")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler must be one of {SCHEDULERS} (got {scheduler!r}).")
    if scheduler == "WarmupDecayLR" and not total_steps:
        raise ConfigError("scheduler='WarmupDecayLR' needs total_steps. Fix: pass total_steps=N "
                          "or use scheduler='WarmupLR'.")
    if not lr > 0:
        raise ConfigError(f"lr must be > 0 (got {lr!r}).")
    resolved = _resolve_precision(precision, runtime)
    uses_nvme = "nvme" in (offload_optimizer, offload_param)
    if uses_nvme and check_paths:
        check_nvme_path(nvme_path, nvme_bytes_needed)
    elif uses_nvme and not nvme_path:
        raise ConfigError("NVMe offload needs nvme_path. Fix: nvme_path='/content/nvme' on Colab.")

    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": False,
    }
    optimizer_params: dict[str, Any] = {"lr": lr, "betas": list(betas), "eps": 1e-8,
                                        "weight_decay": weight_decay}
    if offload_optimizer == "none":
        # torch's own AdamW: no fused_adam JIT build (about a minute on first use)
        optimizer_params["torch_adam"] = True
    config["optimizer"] = {"type": optimizer, "params": optimizer_params}
    if scheduler == "WarmupLR":
        config["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup_steps,
            "warmup_type": "linear"}}
    elif scheduler == "WarmupDecayLR":
        config["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup_steps,
            "warmup_type": "linear", "total_num_steps": total_steps}}
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    if resolved == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": initial_scale_power,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    elif resolved == "bf16":
        config["bf16"] = {"enabled": True}

    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=False, contiguous_gradients=True,
                    reduce_bucket_size=50_000_000, allgather_bucket_size=50_000_000)
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True,
                    stage3_prefetch_bucket_size=prefetch_bucket_size,
                    stage3_param_persistence_threshold=100_000,
                    stage3_max_live_parameters=max_live_parameters,
                    stage3_max_reuse_distance=100_000_000)
        zero.pop("allgather_bucket_size")
    if stage == 3:
        _check_int("sub_group_size", sub_group_size)
        zero["sub_group_size"] = sub_group_size
    if offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_section(offload_optimizer, nvme_path, "optimizer",
                                                     nvme_buffer_count, nvme_buffer_size, pin_memory)
    if offload_param != "none":
        zero["offload_param"] = _offload_section(offload_param, nvme_path, "param",
                                                 nvme_buffer_count, nvme_buffer_size, pin_memory)
    config["zero_optimization"] = zero
    if uses_nvme:
        config["aio"] = {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1,
                         "single_submit": False, "overlap_events": True}
    if activation_checkpointing:
        # DeepSpeed's own section drives deepspeed.checkpointing; a Hugging Face model is switched with
        # model.gradient_checkpointing_enable() (see `activation_checkpointing_hint`).
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False,
                                              "synchronize_checkpoint_boundary": False}
    return config


OFFLOAD_KINDS: dict[str, dict[str, Any]] = {
    "zero2_offload_cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "zero3_offload_cpu": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    # the fp16 params stay on the GPU (a T4 has more VRAM than Colab has RAM), only the optimizer goes to NVMe
    "zero3_nvme_optimizer_gpu_params": {"stage": 3, "offload_optimizer": "nvme"},
    "zero3_nvme_optimizer": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu"},
    "zero3_nvme_all": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"},
}


def offload_config(kind: str, runtime: "Runtime", *, largest_param: int = 0, nvme_path: str | None = None,
                   **overrides: Any) -> dict[str, Any]:
    """The offload config `kind` (OFFLOAD_KINDS) sized for a model whose largest tensor has `largest_param` elements.

    With parameters on NVMe every parameter in flight holds one swap buffer: buffers hold the largest tensor
    (the embedding), and a short prefetch keeps the number in flight below the 8 buffers. On CPU, NVMe
    parameter offload runs in bf16 (DeepSpeed 0.19.8 fails in fp32 there: a dtype bug). Notebook 02, ladder.
    """
    if kind not in OFFLOAD_KINDS:
        raise ConfigError(f"unknown offload config {kind!r}. Fix: one of {sorted(OFFLOAD_KINDS)}.")
    kwargs: dict[str, Any] = {**OFFLOAD_KINDS[kind], "runtime": runtime}
    if "nvme" in OFFLOAD_KINDS[kind].values():
        kwargs["nvme_path"] = nvme_path
    if OFFLOAD_KINDS[kind].get("offload_param") == "nvme":
        if largest_param <= 0:
            raise ConfigError("NVMe parameter offload needs the model's largest tensor (largest_param=...) to size "
                              "its swap buffers. Fix: largest_param=helpers.model_shape(model).largest_layer_params.")
        kwargs.update(nvme_buffer_count=8, nvme_buffer_size=max(10_000_000, int(largest_param * 1.05)),
                      prefetch_bucket_size=10_000_000, max_live_parameters=30_000_000)
        if not runtime.has_gpu:
            kwargs["precision"] = "bf16"
    kwargs.update(overrides)
    return build_ds_config(**kwargs)


def activation_checkpointing_hint(config: dict[str, Any]) -> str:
    """What to call on the model for the activation checkpointing a config asks for."""
    if "activation_checkpointing" not in config:
        return "activation checkpointing off: every layer keeps its activations for backward"
    return ("activation checkpointing on: call model.gradient_checkpointing_enable() on a Hugging Face model "
            "(or wrap blocks in deepspeed.checkpointing.checkpoint); activations are recomputed in backward, "
            "about 1/3 more compute for far less activation memory")


def validate_ds_config(config: dict[str, Any]) -> dict[str, Any]:
    """Run DeepSpeed's own pydantic config classes over `config`; raise ConfigError with the reason."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(copy.deepcopy(config))
    except Exception as exc:  # DeepSpeed raises ValidationError, AssertionError, ValueError ...
        raise ConfigError(f"DeepSpeed rejected this config: {exc}") from exc
    return config


# The configs the notebooks load, written for the Colab T4 target (fp16). Notebooks rebuild them
# for their own runtime with `course_config(name, runtime)`, which changes only the precision.
COURSE_CONFIGS: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload_cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "zero3_offload_cpu": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    "zero3_nvme": {"stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu",
                   "nvme_path": "/content/nvme"},
}
COURSE_CONFIG_PRECISION = "fp16"


def course_config(name: str, runtime: "Runtime | None" = None, **overrides: Any) -> dict[str, Any]:
    """The named course config; with `runtime`, precision follows it (fp32 on CPU, fp16 on T4)."""
    if name not in COURSE_CONFIGS:
        raise ConfigError(f"unknown course config {name!r}. Fix: one of {sorted(COURSE_CONFIGS)}.")
    kwargs: dict[str, Any] = {"precision": COURSE_CONFIG_PRECISION, "check_paths": False,
                              **COURSE_CONFIGS[name]}
    if runtime is not None:
        kwargs.update(precision="auto", runtime=runtime)
    kwargs.update(overrides)
    return build_ds_config(**kwargs)


def write_course_configs(directory: str | os.PathLike[str] = "configs") -> list[Path]:
    """Write every COURSE_CONFIGS entry as configs/<name>.json (run: python -m helpers.config)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in COURSE_CONFIGS:
        path = out / f"{name}.json"
        path.write_text(json.dumps(course_config(name), indent=2) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write_course_configs(Path(__file__).resolve().parent.parent / "configs"):
        print("wrote", p)
