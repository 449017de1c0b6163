"""Build DeepSpeed JSON configs, checked before anything expensive runs.

Notebook 00 writes its first config literally; from notebook 01 on, `build_ds_config` writes them.
Every bad input raises `ConfigError` with a message that says the fix; the result is then
validated by DeepSpeed's own config classes (`validate_ds_config`).
`NAMED_CONFIGS` is the one list of the course's named configs (plain PyTorch, ZeRO 0-3, the offload
configs of notebook 02 and the ladder), with the label each is shown under; `course_config(name, runtime)`
builds one. The JSON files in ``configs/`` (Colab T4 target: fp16) are the source of the entries that have one:
`_arguments_of` reads a file back into build_ds_config arguments (a test checks build_ds_config writes each file
exactly from them), and what else a learner sets in the file is carried into course_config's result. Only the
``*_trainer.json`` files are derived (`write_course_configs`, a test checks they are equal).
"""
from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from helpers.atomic import write_atomically
from helpers.checks import ConfigError, check_number, check_offload_device, check_runtime, spelled_fix
from helpers.memory import estimate_for_config

if TYPE_CHECKING:
    from helpers.hardware import Runtime

# ConfigSettings is public (helpers.ConfigSettings): notebooks/programs pass it to build_ds_config
__all__ = ["trainer_ds_config", "build_ds_config", "ConfigSettings", "course_config", "validate_ds_config",
           "explain_config"]

PRECISIONS = ("auto", "fp16", "bf16", "fp32")
OPTIMIZERS = ("AdamW", "Adam")
SCHEDULERS = (None, "WarmupLR", "WarmupDecayLR")
# how a fix names a build_ds_config setting that is passed in its `settings` (ConfigSettings), not as a keyword
IN_SETTINGS = "settings=ConfigSettings"


def _check_int(name: str, value: Any, within: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer (got {value!r}). Fix: pass "
                          f"{spelled_fix(f'{name}=1', within)} or more; to fit less memory per step, lower "
                          "micro_batch_size and raise grad_accum_steps.")


def _check_stage(stage: Any) -> None:
    if isinstance(stage, int) and not isinstance(stage, bool) and stage in (0, 1, 2, 3):
        return
    fix = "pass stage=0..3"
    if isinstance(stage, float) and stage in (0, 1, 2, 3):
        fix = f"stage={int(stage)} (an int)"
    raise ConfigError(f"ZeRO stage must be 0, 1, 2 or 3 (got {stage!r}). Stage 1 partitions optimizer "
                      f"states, 2 also gradients, 3 also parameters. Fix: {fix}.")


# NVMe offload writes optimizer states (16 bytes/param) and, with parameters, the 16-bit weights: GPT-2 124M
# writes ~2.2 GB. A folder with less free space than this is refused unless the need is known to be smaller.
NVME_MIN_FREE_BYTES = 1_000_000_000
# DeepSpeed swaps a parameter to NVMe only when its 16-bit partition has at least MIN_AIO_BYTES (1 MiB,
# deepspeed/runtime/swap_tensor/utils.py); smaller ones stay in RAM. A swap buffer smaller than that holds nothing.
NVME_MIN_SWAPPED_BYTES = 1024**2


def _folder_beside(p: Path) -> Path:
    """A folder name next to the file `p` that is not a file itself (nvme, nvme-2, ...)."""
    candidate, n = p.parent / "nvme", 1
    while candidate.exists() and not candidate.is_dir():
        n += 1
        candidate = p.parent / f"nvme-{n}"
    return candidate


def _nvme_path_arg(path: Any) -> str | None:
    """`path` as a str with a leading ~ expanded (os.makedirs('~/nvme') makes a folder named '~'), None for
    None or ''; anything but a str or a path is refused with the fix."""
    if path is None or (isinstance(path, str) and path.strip() == ""):
        return None
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        from helpers.hardware import default_nvme_path

        folder = default_nvme_path()
        raise ConfigError(f"nvme_path must be a folder's path, a str (got {path!r}, a {type(path).__name__}). "
                          f"Fix: nvme_path={folder!r} (the course's NVMe folder here; create it first: "
                          f"os.makedirs({folder!r}, exist_ok=True)).")
    return os.path.expanduser(os.fspath(path))


def _nvme_folder_to_make(path: Any, name: str = "nvme_path") -> Path:
    """An NVMe folder's path as a Path, `~` expanded (os.makedirs('~/nvme') would make a folder named '~'), before
    the folder is made: refused (ConfigError, with a fix that passes) when it is not a path or names a file (the
    raw FileExistsError / NotADirectoryError otherwise). `name`: the parameter the fix names (NVME_PATH, --nvme-path).
    """
    folder = _nvme_path_arg(path)
    if folder is None:
        raise ConfigError(f"{name} is empty: NVMe offload needs a folder on a fast local disk. Fix: {name}="
                          "'/content/nvme' on Colab (helpers.default_nvme_path() gives the course's folder here).")
    p = Path(folder)
    blocker = next((q for q in [p, *p.parents] if q.exists() and not q.is_dir()), None)
    if blocker is not None:
        other = _folder_beside(blocker)
        within = "" if blocker == p else f" (its parent {str(blocker)!r} is a file)"
        raise ConfigError(f"NVMe offload folder {str(p)!r} cannot be a folder{within}: {str(blocker)!r} is a file, "
                          f"not a folder, and DeepSpeed writes its swap files into a folder. Fix: pick a folder, "
                          f"e.g. {name}={str(other)!r} (create it first: os.makedirs({str(other)!r}, exist_ok=True)).")
    return p


def check_nvme_path(path: str | os.PathLike[str] | None, bytes_needed: int = 0) -> Path:
    """The NVMe offload folder must exist, be writable and have free space for what will be written (notebook 02).

    `bytes_needed`: the estimate (`estimate_for_config(config, n_params).nvme_total`); without it (0) the folder
    must have NVME_MIN_FREE_BYTES free: a full disk makes DeepSpeed write short swap files and later abort the
    process in C++ (a dead kernel) when it reads them back. A leading ~ is the home folder (expanded here). Nothing
    is remembered: a run checks its own config's folder again when it starts (`helpers.train_run`).
    """
    return _check_nvme_folder(path, bytes_needed, smaller=(
        "or pass the estimate for a smaller model (settings=ConfigSettings(n_params=...) to build_ds_config, or "
        "bytes_needed="
        "helpers.estimate_for_config(config, n_params).nvme_total)"))


def _check_nvme_folder(path: Any, bytes_needed: int, *, smaller: str) -> Path:
    """`check_nvme_path`; `smaller`: the fix's second way out of the NVME_MIN_FREE_BYTES floor, for the caller
    (a run checks its model's estimate itself once the model is built: `helpers.train._check_nvme_need`)."""
    path = _nvme_path_arg(path)
    if path is None:
        raise ConfigError("NVMe offload needs a folder on a fast local disk. Fix: nvme_path='/content/nvme' "
                          "on Colab (create it first: os.makedirs(nvme_path, exist_ok=True)).")
    p = _nvme_folder_to_make(path)
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
    if isinstance(bytes_needed, bool) or not isinstance(bytes_needed, int) or bytes_needed < 0:
        raise ConfigError(f"bytes_needed must be a byte count >= 0 (got {bytes_needed!r}). Fix: bytes_needed="
                          "helpers.estimate_for_config(config, n_params).nvme_total, or 0 when it is not known.")
    free = shutil.disk_usage(p).free
    if bytes_needed and free < bytes_needed:
        raise ConfigError(f"NVMe offload folder {str(p)!r} has {free / 1e9:.1f} GB free but this config needs "
                          f"about {bytes_needed / 1e9:.1f} GB.{_leftovers_note(p)} Fix: free disk space, point "
                          "nvme_path at a larger disk, offload only the optimizer, or train a smaller model.")
    if not bytes_needed and free < NVME_MIN_FREE_BYTES:
        raise ConfigError(f"NVMe offload folder {str(p)!r} has only {free / 1e6:.0f} MB free; NVMe offload writes "
                          f"the optimizer states there (16 bytes per parameter, ~2.2 GB for GPT-2 124M), and a full "
                          f"disk aborts the process in DeepSpeed's C++ reader.{_leftovers_note(p)} Fix: point "
                          f"nvme_path at a disk with at least {NVME_MIN_FREE_BYTES / 1e9:.0f} GB free"
                          + (f", {smaller}." if smaller else "."))
    return p


# where a DeepSpeed config swaps to NVMe, and the rows of the estimate (`estimate_for_config(...).nvme`) it puts there
_NVME_SWAPS = {"offload_param": ("params",), "offload_optimizer": ("optimizer", "grads")}


def _real_folder(path: str | os.PathLike[str]) -> str:
    """A folder as the course compares them: ~ expanded, links resolved."""
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _nvme_sections(config: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """[(section name, the section)] of a DeepSpeed config's offload sections that swap to an NVMe folder, in the
    order offload_param, offload_optimizer: where the NVMe path lives (zero_optimization.offload_param /
    offload_optimizer .nvme_path) and nowhere beside it."""
    zero = config.get("zero_optimization") or {}
    return [(name, part) for name in _NVME_SWAPS if isinstance(part := zero.get(name), dict)
            and part.get("device") == "nvme" and part.get("nvme_path")]


def _nvme_folders_of(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """{NVMe folder (`_real_folder`): the estimate's rows DeepSpeed swaps there} of a DeepSpeed config, in the order
    offload_param, offload_optimizer. The one reader of the NVMe path (`_nvme_sections`)."""
    folders: dict[str, tuple[str, ...]] = {}
    for name, part in _nvme_sections(config):
        folder = _real_folder(str(part["nvme_path"]))
        folders[folder] = folders.get(folder, ()) + _NVME_SWAPS[name]
    return folders


def _leftovers_note(p: Path) -> str:
    """' N MB of it are swap files earlier runs left ... Remove them: ...' when the folder holds any, else ''."""
    from helpers.runtime import SWAP_ROOT, swap_leftovers

    try:
        files = swap_leftovers(p)
        size = sum(os.stat(f).st_blocks * 512 for f in files)
    except OSError:
        return ""
    if not files:
        return ""
    return (f" {size / 1e6:.1f} MB of that folder are {len(files)} DeepSpeed swap files that earlier runs left in "
            f"{str(p / SWAP_ROOT)!r} (a kernel restarted or killed mid-run, or older course code); no engine of "
            f"this kernel uses them. Remove them first: helpers.runtime.remove_nvme_leftovers({str(p)!r}) (or, with no "
            f"run using the folder, shutil.rmtree({str(p / SWAP_ROOT)!r})).")


def nvme_buffer_size_for(largest_param: int) -> int:
    """An NVMe parameter swap buffer (elements) for a model whose largest tensor has `largest_param` elements."""
    return max(10_000_000, int(largest_param * 1.05))


def check_nvme_buffers(buffer_count: Any, buffer_size: Any, *, element_bytes: int, largest_param: int = 0,
                       within: str = "") -> None:
    """NVMe parameter swap buffers DeepSpeed 0.19.8 can work with (notebook 02; preflight; build_ds_config).

    Each parameter whose partition is on NVMe takes one whole buffer while it is in memory
    (partitioned_param_swapper.py): initialisation swaps every parameter out through a buffer ("No swap buffers
    to allocate" with none), and a buffer must hold the largest tensor ("More elements ... than buffer size").
    Measured on CPU (bf16, 10 swapped tensors): prefetch and max_live_parameters need no buffers of their own,
    the NVMe prefetch only takes free ones; 1 buffer trains with stage3_max_reuse_distance 0, while a reuse
    distance covering the whole model keeps every swapped tensor in memory (10 buffers needed). `within`: the call
    the fix passes the buffer settings in (build_ds_config: IN_SETTINGS).
    """
    if isinstance(buffer_count, bool) or not isinstance(buffer_count, int) or buffer_count < 1:
        raise ConfigError(f"nvme_buffer_count must be an integer >= 1 (got {buffer_count!r}): DeepSpeed swaps each "
                          "parameter through one of these buffers, and with none it fails in initialize ('No swap "
                          f"buffers to allocate'). Fix: {spelled_fix('nvme_buffer_count=8', within)} "
                          "(the course's value).")
    smallest = NVME_MIN_SWAPPED_BYTES // element_bytes
    needed = max(int(largest_param), smallest)
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < needed:
        what = (f"the model's largest tensor ({largest_param:,} elements)" if largest_param > smallest else
                f"the smallest tensor DeepSpeed swaps to NVMe ({smallest:,} elements of {element_bytes} bytes = 1 MiB)")
        raise ConfigError(f"nvme_buffer_size must hold {what} (got {buffer_size!r}); DeepSpeed fails in initialize "
                          f"with 'More elements ... than buffer size'. Fix: "
                          f"{spelled_fix(f'nvme_buffer_size={nvme_buffer_size_for(needed)}', within)} "
                          "(helpers.config.nvme_buffer_size_for(largest_param)).")


def _check_betas(betas: Any) -> None:
    """Adam's (beta1, beta2): two numbers in [0, 1); DeepSpeed unpacks two (IndexError in initialize otherwise)."""
    ok = (isinstance(betas, (tuple, list)) and len(betas) == 2
          and all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1 for b in betas))
    if not ok:
        raise ConfigError(f"betas must be Adam's two decay rates (beta1, beta2), each in [0, 1) (got {betas!r}). "
                          f"Fix: {IN_SETTINGS}(betas=(0.9, 0.999)) (the course's; 0.95 for beta2 is also common).")


_FLAG_WORDS = {"no": False, "false": False, "off": False, "0": False, "none": False, "": False,
               "yes": True, "true": True, "on": True, "1": True}


def _check_flag(name: str, value: Any, within: str = "") -> None:
    """A switch must be True or False: a string such as 'no' is truthy and would switch it on."""
    if isinstance(value, bool):
        return
    meant = _FLAG_WORDS.get(value.strip().lower()) if isinstance(value, str) else (
        bool(value) if isinstance(value, int) and value in (0, 1) else None)
    fix = (spelled_fix(f"{name}={meant!r}", within) if meant is not None else
           f"{spelled_fix(f'{name}=True', within)} (on) or {spelled_fix(f'{name}=False', within)} (off)")
    raise ConfigError(f"{name} must be True or False (got {value!r}, a {type(value).__name__}: any non-empty "
                      f"string counts as on). Fix: {fix}.")


def _resolve_precision(precision: str, runtime: "Runtime | None") -> str:
    check_runtime(runtime, "build_ds_config")
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


@dataclass(frozen=True)
class ConfigSettings:
    """`build_ds_config`'s less-used settings, one object (notebooks 01, 02, 05); the defaults are the course's.

    world_size: GPUs in the data-parallel world; given, train_batch_size is written (None: DeepSpeed derives it).
    nvme_bytes_needed: bytes NVMe offload will write, checked against the folder's free space (0: not known).
    n_params: the model's parameter count, for that free-space check when nvme_bytes_needed is 0.
    largest_param: elements of the model's largest tensor, which NVMe parameter swap buffers must hold.
    check_paths: check the NVMe folder (exists, writable, free space) now.
    nvme_buffer_count: NVMe parameter swap buffers in the pool.
    nvme_buffer_size: elements per NVMe parameter swap buffer.
    pin_memory: page-locked offload buffers (faster copies, taken from the RAM offload already fills).
    sub_group_size: ZeRO-3: elements the optimizer steps at a time (with NVMe, what is swapped in at once).
    prefetch_bucket_size: ZeRO-3: parameter elements fetched ahead of use.
    max_live_parameters: ZeRO-3: the most parameter elements gathered on a GPU at once.
    initial_scale_power: fp16: the dynamic loss scale starts at 2**this.
    optimizer: "AdamW" or "Adam".
    lr: learning rate (the warm-up's target with a scheduler).
    weight_decay: AdamW's weight decay.
    betas: Adam's (beta1, beta2).
    scheduler: None, "WarmupLR" (warm up, then hold) or "WarmupDecayLR" (then decay to 0 at total_steps).
    warmup_steps: optimizer steps of warm-up.
    total_steps: WarmupDecayLR: the step the learning rate reaches 0.
    gradient_clipping: the largest global gradient norm (None: no clipping).
    activation_checkpointing: write DeepSpeed's activation_checkpointing section.
    steps_per_print: DeepSpeed logs every this many optimizer steps.
    """

    world_size: int | None = None
    nvme_bytes_needed: int = 0
    n_params: int = 0
    largest_param: int = 0
    check_paths: bool = True
    nvme_buffer_count: int = 8
    nvme_buffer_size: int = 100_000_000
    pin_memory: bool = False
    sub_group_size: int = 100_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 100_000_000
    initial_scale_power: int = 16
    optimizer: str = "AdamW"
    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    scheduler: str | None = "WarmupLR"
    warmup_steps: int = 10
    total_steps: int | None = None
    gradient_clipping: float | None = 1.0
    activation_checkpointing: bool = False
    steps_per_print: int = 10_000


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in fields(ConfigSettings))


def _check_settings(settings: Any) -> ConfigSettings:
    """build_ds_config's `settings`: a ConfigSettings (None: the defaults)."""
    if settings is None:
        return ConfigSettings()
    if not isinstance(settings, ConfigSettings):
        raise ConfigError(f"settings must be a helpers.ConfigSettings (got {settings!r}, a {type(settings).__name__}). "
                          "Fix: settings=ConfigSettings(lr=1e-3) (what it leaves out keeps the course's default).")
    return settings


def _check_build_arguments(stage: Any, micro_batch_size: Any, grad_accum_steps: Any, offload_optimizer: Any,
                           offload_param: Any, s: ConfigSettings) -> None:
    """`build_ds_config`'s arguments and settings `s` checked before anything is built: each refusal names a fix that
    passes (a setting's as settings=ConfigSettings(...))."""
    _check_stage(stage)
    for name, value in (("micro_batch_size", micro_batch_size), ("grad_accum_steps", grad_accum_steps)):
        _check_int(name, value)
    _check_int("world_size", 1 if s.world_size is None else s.world_size, IN_SETTINGS)
    check_number("lr", s.lr, positive=True, integer=False, example=1e-4, within=IN_SETTINGS)
    check_number("weight_decay", s.weight_decay, positive=False, integer=False, example=0.01, within=IN_SETTINGS)
    check_number("warmup_steps", s.warmup_steps, positive=False, integer=True, example=10, within=IN_SETTINGS)
    check_number("initial_scale_power", s.initial_scale_power, positive=False, integer=True, example=16,
                 within=IN_SETTINGS)
    check_number("steps_per_print", s.steps_per_print, positive=True, integer=True, example=10_000, within=IN_SETTINGS,
                 hint=" (DeepSpeed prints every that many steps and divides by it: 0 fails mid-training)")
    _check_betas(s.betas)
    _check_flag("activation_checkpointing", s.activation_checkpointing, IN_SETTINGS)
    if s.gradient_clipping is not None:
        check_number("gradient_clipping", s.gradient_clipping, positive=False, integer=False, example=1.0,
                     within=IN_SETTINGS)
    if s.total_steps is not None:
        check_number("total_steps", s.total_steps, positive=True, integer=True, example=100, within=IN_SETTINGS)
    for name in ("prefetch_bucket_size", "max_live_parameters"):
        check_number(name, getattr(s, name), positive=False, integer=True, example=50_000_000, within=IN_SETTINGS)
    for name in ("n_params", "largest_param", "nvme_bytes_needed"):
        check_number(name, getattr(s, name), positive=False, integer=True, example=0, within=IN_SETTINGS)
    for name, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        check_offload_device(name, device)
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
    if s.optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {OPTIMIZERS} (got {s.optimizer!r}).")
    if s.scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler must be one of {SCHEDULERS} (got {s.scheduler!r}).")
    if s.scheduler == "WarmupDecayLR" and not s.total_steps:
        raise ConfigError(f"scheduler='WarmupDecayLR' needs total_steps. Fix: pass {IN_SETTINGS}(scheduler="
                          f"'WarmupDecayLR', total_steps=N) or use {IN_SETTINGS}(scheduler='WarmupLR').")
    if s.scheduler == "WarmupDecayLR" and s.total_steps <= s.warmup_steps:  # type: ignore[operator]
        total, warmup = s.total_steps, s.warmup_steps
        decay = f"{IN_SETTINGS}(scheduler='WarmupDecayLR', "
        raise ConfigError(f"scheduler='WarmupDecayLR' decays the learning rate from warmup_steps to total_steps, "
                          f"so total_steps must be larger than warmup_steps (got total_steps={total}, "
                          f"warmup_steps={warmup}: the learning rate would be 0 from step {total} on). "
                          f"Fix: {decay}warmup_steps={warmup}, total_steps={max(10 * warmup, warmup + 1)}), "
                          f"or a shorter warm-up: {decay}total_steps={total}, "
                          f"warmup_steps={total // 10}).")  # type: ignore[operator]


def _optimizer_sections(s: ConfigSettings, offload_optimizer: str) -> dict[str, Any]:
    """The config's "optimizer" and "scheduler" sections (`build_ds_config`) from settings `s`."""
    optimizer_params: dict[str, Any] = {"lr": s.lr, "betas": list(s.betas), "eps": 1e-8,
                                        "weight_decay": s.weight_decay}
    if offload_optimizer == "none":
        # torch's own AdamW: no fused_adam JIT build (about a minute on first use)
        optimizer_params["torch_adam"] = True
    sections: dict[str, Any] = {"optimizer": {"type": s.optimizer, "params": optimizer_params}}
    if s.scheduler == "WarmupLR":
        sections["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": s.lr, "warmup_num_steps": s.warmup_steps,
            "warmup_type": "linear"}}
    elif s.scheduler == "WarmupDecayLR":
        sections["scheduler"] = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": s.lr, "warmup_num_steps": s.warmup_steps,
            "warmup_type": "linear", "total_num_steps": s.total_steps}}
    return sections


def _precision_section(precision: str, initial_scale_power: int) -> dict[str, Any]:
    """The config's "fp16" (dynamic loss scale from 2^initial_scale_power) or "bf16" section; none for fp32."""
    if precision == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": initial_scale_power,
                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
    return {"bf16": {"enabled": True}} if precision == "bf16" else {}


def _zero_section(stage: int, offload_optimizer: str, offload_param: str, nvme_path: str | None,
                  s: ConfigSettings) -> dict[str, Any]:
    """The config's "zero_optimization" section (`build_ds_config`) with settings `s`."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=False, contiguous_gradients=True,
                    reduce_bucket_size=50_000_000, allgather_bucket_size=50_000_000)
    if stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True,
                    stage3_prefetch_bucket_size=s.prefetch_bucket_size,
                    stage3_param_persistence_threshold=100_000,
                    stage3_max_live_parameters=s.max_live_parameters,
                    stage3_max_reuse_distance=100_000_000)
        zero.pop("allgather_bucket_size")
    if stage == 3:
        _check_int("sub_group_size", s.sub_group_size, IN_SETTINGS)
        zero["sub_group_size"] = s.sub_group_size
    if offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_section(offload_optimizer, nvme_path, "optimizer",
                                                     s.nvme_buffer_count, s.nvme_buffer_size, s.pin_memory)
    if offload_param != "none":
        zero["offload_param"] = _offload_section(offload_param, nvme_path, "param",
                                                 s.nvme_buffer_count, s.nvme_buffer_size, s.pin_memory)
    return zero


def build_ds_config(
    stage: int = 2,
    *,
    precision: str = "auto",
    runtime: "Runtime | None" = None,
    micro_batch_size: int = 4,
    grad_accum_steps: int = 1,
    offload_optimizer: str = "none",
    offload_param: str = "none",
    nvme_path: str | None = None,
    settings: ConfigSettings | None = None,
) -> dict[str, Any]:
    """A DeepSpeed config dict for ZeRO `stage` 0-3 with optional CPU/NVMe offload (notebooks 01, 02, 05).

    precision: "auto" (follows `runtime`: fp16 on a T4, bf16 on Ampere or newer, fp32 on CPU), "fp16", "bf16", "fp32".
    runtime: helpers.detect_runtime()'s answer, checked against precision.
    micro_batch_size: samples per GPU per forward and backward.
    grad_accum_steps: micro-batches summed before each optimizer step.
    offload_optimizer / offload_param: "none", "cpu" or "nvme" (parameters only at stage 3).
    nvme_path: the NVMe offload folder (checked unless settings.check_paths is False).
    settings: everything else (`ConfigSettings`: optimizer, schedule, NVMe buffers, world size, ...); None: defaults.
    With NVMe the folder's free space is checked against settings.nvme_bytes_needed, else the estimate for
    settings.n_params, else NVME_MIN_FREE_BYTES. train_batch_size is written only with settings.world_size.
    """
    s = _check_settings(settings)
    _check_build_arguments(stage, micro_batch_size, grad_accum_steps, offload_optimizer, offload_param, s)
    resolved = _resolve_precision(precision, runtime)
    uses_nvme = "nvme" in (offload_optimizer, offload_param)
    if uses_nvme:
        nvme_path = _nvme_path_arg(nvme_path)
    if uses_nvme and not s.check_paths and not nvme_path:
        raise ConfigError("NVMe offload needs nvme_path. Fix: nvme_path='/content/nvme' on Colab.")
    if offload_param == "nvme":
        check_nvme_buffers(s.nvme_buffer_count, s.nvme_buffer_size, largest_param=s.largest_param,
                           element_bytes=4 if resolved == "fp32" else 2, within=IN_SETTINGS)

    config: dict[str, Any] = {} if s.world_size is None else {
        "train_batch_size": micro_batch_size * grad_accum_steps * s.world_size}
    config.update({
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "steps_per_print": s.steps_per_print,
        "wall_clock_breakdown": False,
    })
    config.update(_optimizer_sections(s, offload_optimizer))
    if s.gradient_clipping is not None:
        config["gradient_clipping"] = s.gradient_clipping
    config.update(_precision_section(resolved, s.initial_scale_power))

    config["zero_optimization"] = _zero_section(stage, offload_optimizer, offload_param, nvme_path, s)
    if uses_nvme:
        # DeepSpeed 0.19.8 reads its I/O thread count from "intra_op_parallelism" ("thread_count", the older key,
        # is ignored without a word: runtime/swap_tensor/aio_config.py)
        config["aio"] = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}
    if s.activation_checkpointing:
        # DeepSpeed's own section drives deepspeed.checkpointing; a Hugging Face model is switched with
        # model.gradient_checkpointing_enable() (see `activation_checkpointing_hint`).
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False,
                                              "synchronize_checkpoint_boundary": False}
    if uses_nvme and s.check_paths:
        nvme_bytes_needed = s.nvme_bytes_needed
        if not nvme_bytes_needed and s.n_params:
            nvme_bytes_needed = estimate_for_config(config, s.n_params,
                                                    largest_layer_params=s.largest_param).nvme_total
        check_nvme_path(nvme_path, nvme_bytes_needed)
    return config


def _flat_arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    """build_ds_config arguments with a `settings` among them spread out flat: each ConfigSettings field it sets
    apart from the default, on top of the flat ones (course_config / offload_config overrides)."""
    out = {k: v for k, v in args.items() if k != "settings"}
    if args.get("settings") is not None:
        s = _check_settings(args["settings"])
        out.update({f.name: getattr(s, f.name) for f in fields(s) if getattr(s, f.name) != f.default})
    return out


def _split_arguments(args: Mapping[str, Any]) -> dict[str, Any]:
    """Flat build_ds_config arguments (a named config's kwargs, course_config's overrides, the planner's: each
    ConfigSettings field beside the keywords) as build_ds_config takes them: the fields gathered into `settings`."""
    flat = _flat_arguments(args)
    direct = {k: v for k, v in flat.items() if k not in SETTING_NAMES}
    moved = {k: v for k, v in flat.items() if k in SETTING_NAMES}
    if moved:
        direct["settings"] = ConfigSettings(**moved)
    return direct


# ---- configs/*.json are the source of the named configs that have a file; `_arguments_of` reads them back

# the course's JSON configs, beside helpers/: the source of every NAMED_CONFIGS entry marked `in_configs_dir` (tests
# point it at a copy)
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
# build_ds_config argument -> the one key it writes its value to: `_arguments_of` reads it back from there
_ARGUMENT_KEYS: dict[str, str] = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum_steps": "gradient_accumulation_steps",
    "steps_per_print": "steps_per_print",
    "optimizer": "optimizer.type",
    "lr": "optimizer.params.lr",
    "betas": "optimizer.params.betas",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "initial_scale_power": "fp16.initial_scale_power",
    "stage": "zero_optimization.stage",
    "sub_group_size": "zero_optimization.sub_group_size",
    "prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "max_live_parameters": "zero_optimization.stage3_max_live_parameters",
}
# every key whose value follows from build_ds_config's arguments (the rest it writes are fixed defaults: a file may
# change those, `_differences`): a file whose value there is not what its other settings give cannot be expressed
_FOLLOWING_KEYS = frozenset([
    *_ARGUMENT_KEYS.values(), "train_batch_size", "gradient_clipping", "scheduler.type", "scheduler.params.warmup_max_lr",
    "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled", "zero_optimization.offload_param.buffer_count",
    "zero_optimization.offload_param.buffer_size",
    *(f"zero_optimization.{s}.{k}" for s in ("offload_optimizer", "offload_param")
      for k in ("device", "nvme_path", "pin_memory"))])
# every build_ds_config argument, a ConfigSettings field as one too (the flat form `_split_arguments` takes) -> default
_BUILD_DEFAULTS = {**{name: p.default for name, p in inspect.signature(build_ds_config).parameters.items()
                      if name != "settings"}, **{f.name: f.default for f in fields(ConfigSettings)}}


def _precision_of(config: dict[str, Any], where: str) -> str:
    """The precision a config trains in: its "fp16" or "bf16" section (enabled), fp32 with neither."""
    on = [half for half in ("fp16", "bf16") if isinstance(config.get(half), dict) and config[half].get("enabled") is True]
    off = [half for half in ("fp16", "bf16") if half in config and half not in on]
    if off or len(on) > 1:
        raise ConfigError(f"{where}: {' and '.join(off or on)} {'is' if len(off or on) == 1 else 'are'} there "
                          f"{'but not enabled' if off else 'both enabled'}; the course writes one precision section, "
                          "{\"enabled\": true, ...}, or none for fp32 (course_config then follows the runtime). Fix: "
                          f"keep one section with \"enabled\": true, or remove {' and '.join(off or on[1:])}.")
    return on[0] if on else "fp32"


def _arguments_of(config: Any, where: str) -> dict[str, Any]:
    """The `build_ds_config` arguments (precision included) that write `config`: the inverse of build_ds_config for
    the keys it writes, each read where `_ARGUMENT_KEYS` says (offload devices, the NVMe folder and pin_memory from the
    offload sections, precision from the fp16/bf16 section, world_size from train_batch_size, off where a section is
    missing). An argument whose key is missing keeps build_ds_config's default. The values are not checked here:
    build_ds_config does that (`_file_source`). `where`: the file, for the messages."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict) or "stage" not in zero:
        raise ConfigError(f"{where} has no \"zero_optimization\": {{\"stage\": ...}}: a course config is a JSON object "
                          "that names its ZeRO stage (0-3). Fix: add it.")
    args: dict[str, Any] = {arg: value for arg, key in _ARGUMENT_KEYS.items()
                            if (value := _dotted_get(config, key)) is not _MISSING}
    if isinstance(args.get("betas"), list):
        args["betas"] = tuple(args["betas"])
    args["precision"] = _precision_of(config, where)
    args["scheduler"] = _dotted_get(config, "scheduler.type", None) if "scheduler" in config else None
    if args["scheduler"] == "WarmupDecayLR":
        args["total_steps"] = _dotted_get(config, "scheduler.params.total_num_steps", None)
    args["gradient_clipping"] = config.get("gradient_clipping")
    sections = [zero[s] if isinstance(zero.get(s), dict) else {} for s in ("offload_optimizer", "offload_param")]
    args["offload_optimizer"], args["offload_param"] = (s.get("device", "none") for s in sections)
    if offloaded := [s for s in sections if s]:
        args["pin_memory"] = offloaded[0].get("pin_memory", False)
    if on_nvme := [s for s in sections if s.get("device") == "nvme"]:
        args["nvme_path"] = on_nvme[0].get("nvme_path")
    if args["offload_param"] == "nvme":
        args.update({arg: sections[1][key] for arg, key in (("nvme_buffer_count", "buffer_count"),
                                                            ("nvme_buffer_size", "buffer_size")) if key in sections[1]})
    args["activation_checkpointing"] = "activation_checkpointing" in config
    if "train_batch_size" in config:
        args["world_size"] = _world_size_of(config["train_batch_size"], args, where)
    return args


def _world_size_of(train_batch_size: Any, args: dict[str, Any], where: str) -> Any:
    """The world size a written train_batch_size stands for (micro-batch x accumulation x GPUs)."""
    per_gpu = [args.get(a, _BUILD_DEFAULTS[a]) for a in ("micro_batch_size", "grad_accum_steps")]
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (train_batch_size, *per_gpu)):
        if train_batch_size % (per_gpu[0] * per_gpu[1]) == 0:
            return train_batch_size // (per_gpu[0] * per_gpu[1])
    raise ConfigError(f"{where}: \"train_batch_size\": {train_batch_size!r} is not micro-batch x accumulation x GPUs "
                      f"({per_gpu[0]!r} x {per_gpu[1]!r} x the number of GPUs). Fix: remove it (DeepSpeed derives it; "
                      "the course's files leave it out), or write that product.")


def _differences(config: dict[str, Any], built: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """(dotted key, `config`'s value, whether `built` has the key) wherever `config` sets what `built` does not:
    a key `built` lacks (its whole value, however deep), or a value that differs."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if key not in built:
            yield dotted, value, False
        elif isinstance(value, dict) and isinstance(built[key], dict):
            yield from _differences(value, built[key], f"{dotted}.")
        elif value != built[key]:
            yield dotted, value, True


@dataclass(frozen=True)
class _FileSource:
    """A configs/<name>.json read back (`_file_source`): `kwargs` are the build_ds_config arguments that differ from its
    defaults (the stage always), `precision` the file's, `settings` what the file sets beyond them (`_differences`)."""

    kwargs: Mapping[str, Any]
    precision: str
    settings: tuple[tuple[str, Any, bool], ...]
    path: str


_SOURCES: dict[tuple[str, str], _FileSource] = {}  # (path, text) -> the file read back: re-read when it is edited


def _file_source(name: str) -> _FileSource:
    """configs/<name>.json (under CONFIGS_DIR) read back into build_ds_config arguments and the file's own settings.

    The round trip is checked: build_ds_config(**the arguments) must write every key the file sets that follows from
    them (`_FOLLOWING_KEYS`); the file may change a fixed default (reduce_bucket_size, wall_clock_breakdown, ...) and
    add keys; a key it leaves out gets build_ds_config's value. Anything else, a file missing or not JSON, or a value build_ds_config refuses (a stage outside 0-3),
    raises ConfigError naming the file and the fix. Read on use, never at import; cached per file text."""
    path, restore = CONFIGS_DIR / f"{name}.json", f"git checkout -- configs/{name}.json"
    if not CONFIGS_DIR.is_dir():
        raise ConfigError(f"the course's configs folder {str(CONFIGS_DIR)!r} is missing; course_config({name!r}) is "
                          f"built from {path.name} there. Fix: run from a whole checkout of the course (git checkout "
                          "-- configs restores the folder), or point helpers.config.CONFIGS_DIR at a copy of it.")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}, the source of course_config({name!r}) ({exc}). Fix: restore "
                          f"it: {restore}.") from exc
    if (cached := _SOURCES.get((str(path), text))) is not None:
        return cached
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({exc}). Fix: correct line {exc.lineno} (a comma or "
                          f"quote too many or too few; true/false in lower case), or {restore}.") from None
    where = str(path)
    try:
        args = _arguments_of(config, where)
    except ConfigError as exc:
        raise ConfigError(f"{exc} Or restore the course's file: {restore}.") from None
    try:
        built = build_ds_config(**_split_arguments({**args, "check_paths": False}))
    except ConfigError as exc:
        keys = {**_ARGUMENT_KEYS, "offload_optimizer": "zero_optimization.offload_optimizer.device",
                "offload_param": "zero_optimization.offload_param.device", "scheduler": "scheduler.type",
                "total_steps": "scheduler.params.total_num_steps", "gradient_clipping": "gradient_clipping"}
        in_file = "; ".join(f'{arg} is "{key}"' for arg, key in keys.items() if re.search(rf"\b{arg}(=| must\b)", str(exc)))
        raise ConfigError(f"{where} (the source of course_config({name!r})) sets what build_ds_config refuses: {exc} "
                          f"Make that change in the file{f' ({in_file})' if in_file else ''}, or restore it: {restore}.") from None
    settings = tuple(_differences(config, built))
    for key, value, _ in settings:
        if key in _FOLLOWING_KEYS:
            expected = _dotted_get(built, key, None)
            raise ConfigError(f"{where}: \"{key}\": {json.dumps(value)} disagrees with the file's other settings, "
                              f"from which build_ds_config writes {json.dumps(expected)} there (warmup_max_lr is the "
                              f"optimizer's lr; both offload sections share pin_memory and nvme_path). Fix: set it to "
                              f"{json.dumps(expected)}, or change the setting it follows, or {restore}.")
    kwargs = {arg: value for arg, value in args.items()
              if arg == "stage" or (arg != "precision" and value != _BUILD_DEFAULTS[arg])}
    source = _FileSource(MappingProxyType(kwargs), args["precision"], settings, where)
    _SOURCES[(str(path), text)] = source
    return source


def _with_file_settings(config: dict[str, Any], source: _FileSource | None) -> dict[str, Any]:
    """`config` (build_ds_config's output) with its source file's own settings merged under it, then checked by
    DeepSpeed's schema (`validate_ds_config`) when that changed anything (build_ds_config's output alone is checked by
    its own refusals). A fixed default the file changed replaces the builder's where `config` has that key; a key the
    builder does not write is added where `config` has its section and not the key (the builder's and the overrides'
    values win); a setting inside a section `config` leaves out (fp16 on a CPU runtime, an offload section turned off)
    is left out with it."""
    carried = []
    for key, value, builder_writes in source.settings if source else ():
        parent, _, leaf = key.rpartition(".")
        section = _dotted_get(config, parent, None) if parent else config
        if isinstance(section, dict) and (leaf in section) == builder_writes:
            section[leaf] = copy.deepcopy(value)
            carried.append(key)
    if source is None or not carried:
        return config
    try:
        return validate_ds_config(config)
    except ConfigError as exc:
        name = Path(source.path).name
        raise ConfigError(f"{exc}\nThis config carries what {source.path} sets beyond build_ds_config's arguments "
                          f"({', '.join(carried)}). Fix: correct that in the file (DeepSpeed's reference: "
                          f"{CONFIG_REFERENCE}), or restore it: git checkout -- configs/{name}.") from None


@dataclass(frozen=True)
class NamedConfig:
    """One of the course's named configs: `kwargs` are `build_ds_config` arguments, `label` the text shown for it.

    `in_configs_dir`: configs/<name>.json is its source: `kwargs` are read from that file when asked
    (`_file_source`), and course_config/offload_config carry what else the file sets; the other entries' kwargs
    are `given` here. `plain`: plain PyTorch AMP, no DeepSpeed engine (train_run gets ds_config=None); its kwargs
    build the stage-0 config whose batch and schedule fields a plain run reads. `ladder`: a column of
    benchmarks/ladder.py and of notebook 02's pre-flight tables. `trainer`: configs/<name>_trainer.json is derived
    from it, the same config with "auto" where Trainer's arguments own the value (`trainer_ds_config`), the file a
    Trainer program is given (notebook 04).
    """

    name: str
    label: str
    given: Mapping[str, Any]
    plain: bool = False
    in_configs_dir: bool = False
    ladder: bool = False
    trainer: bool = False

    @property
    def source(self) -> _FileSource | None:
        """configs/<name>.json read back (`_file_source`), None for an entry without a file."""
        return _file_source(self.name) if self.in_configs_dir else None

    @property
    def kwargs(self) -> Mapping[str, Any]:
        """build_ds_config arguments: read from configs/<name>.json for an `in_configs_dir` entry, else `given`."""
        source = self.source
        return source.kwargs if source is not None else self.given

    @property
    def placement(self) -> dict[str, Any]:
        """{"stage": ..., "offload_optimizer"/"offload_param": the device where one is used}: what makes this config
        the kind it is, without the other arguments its file may set (micro-batch, lr, ...); `plan` takes these."""
        kwargs = self.kwargs
        return {k: kwargs[k] for k in ("stage", "offload_optimizer", "offload_param") if kwargs.get(k, "none") != "none"}

    @property
    def offload(self) -> bool:
        """Optimizer states or parameters leave the GPU."""
        return "cpu" in self.devices or "nvme" in self.devices

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in self.devices

    @property
    def nvme_params(self) -> bool:
        """Parameters on NVMe: swap buffers must hold the model's largest tensor (`offload_config` sizes them)."""
        return self.kwargs.get("offload_param") == "nvme"

    @property
    def devices(self) -> tuple[str, str]:
        """(optimizer offload device, parameter offload device)."""
        return self.kwargs.get("offload_optimizer", "none"), self.kwargs.get("offload_param", "none")


def _named(name: str, label: str, plain: bool = False, in_configs_dir: bool = False, ladder: bool = False,
           trainer: bool = False, **kwargs: Any) -> tuple[str, NamedConfig]:
    assert not (in_configs_dir and kwargs), f"{name}: configs/{name}.json is the source of its arguments"
    return name, NamedConfig(name, label, MappingProxyType(kwargs), plain=plain, in_configs_dir=in_configs_dir,
                             ladder=ladder, trainer=trainer)


# THE list of the course's named configs (notebooks 00-05, configs/, benchmarks/ladder.py), cheapest first.
# An `in_configs_dir` entry's source is configs/<name>.json (CONFIGS_DIR), written for the Colab T4 target (fp16):
# a learner reads and edits that file, and notebooks rebuild it for their own runtime with
# `course_config(name, runtime)`, which changes only the precision. The entries without a file (plain PyTorch, the
# ladder's NVMe configs) give their build_ds_config arguments here.
NAMED_CONFIGS: dict[str, NamedConfig] = dict([
    _named("plain", "plain PyTorch AMP", plain=True, ladder=True, stage=0),
    _named("zero0", "ZeRO-0 (data parallel, nothing partitioned)", in_configs_dir=True),
    _named("zero1", "ZeRO-1 (optimizer states partitioned)", in_configs_dir=True),
    _named("zero2", "ZeRO-2 (optimizer states and gradients partitioned)", in_configs_dir=True, trainer=True),
    _named("zero3", "ZeRO-3 (optimizer states, gradients and parameters partitioned)", in_configs_dir=True,
           trainer=True),
    _named("zero2_offload_cpu", "ZeRO-2 + CPU optimizer", in_configs_dir=True, ladder=True),
    _named("zero3_offload_cpu", "ZeRO-3 + CPU params+optimizer", in_configs_dir=True, ladder=True),
    # the fp16 params stay on the GPU (a T4 has more VRAM than Colab has RAM), only the optimizer goes to NVMe
    _named("zero3_nvme_optimizer_gpu_params", "ZeRO-3, params on GPU, optimizer on NVMe", ladder=True,
           stage=3, offload_optimizer="nvme"),
    _named("zero3_nvme_optimizer", "ZeRO-3, optimizer on NVMe", ladder=True,
           stage=3, offload_optimizer="nvme", offload_param="cpu"),
    _named("zero3_nvme_all", "ZeRO-3, params+optimizer on NVMe", ladder=True,
           stage=3, offload_optimizer="nvme", offload_param="nvme"),
    # zero3_nvme_optimizer with Colab's NVMe folder written in: the JSON file a learner can copy
    _named("zero3_nvme", "ZeRO-3, optimizer on NVMe (/content/nvme)", in_configs_dir=True),
])
COURSE_CONFIG_PRECISION = "fp16"  # course_config's without a runtime, for the entries without a file
# views of NAMED_CONFIGS in its order, not lists of their own: the configs/ files, the ladder's columns, and the
# offload configs (name -> build_ds_config arguments) that `offload_config` sizes and pre-flight suggests
COURSE_CONFIGS: tuple[str, ...] = tuple(n for n, c in NAMED_CONFIGS.items() if c.in_configs_dir)
TRAINER_CONFIGS: tuple[str, ...] = tuple(n for n, c in NAMED_CONFIGS.items() if c.in_configs_dir and c.trainer)
LADDER_CONFIGS: tuple[str, ...] = tuple(n for n, c in NAMED_CONFIGS.items() if c.ladder)


class _OffloadKinds(Mapping[str, Mapping[str, Any]]):
    """name -> build_ds_config arguments (`NamedConfig.kwargs`) of the ladder's DeepSpeed columns, every one an
    offload config: the names are known at import, the arguments read (from configs/ where that is their source) when
    asked."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names

    def __getitem__(self, name: str) -> Mapping[str, Any]:
        if name not in self._names:
            raise KeyError(name)
        return NAMED_CONFIGS[name].kwargs

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"OFFLOAD_KINDS{self._names!r}"


OFFLOAD_KINDS: Mapping[str, Mapping[str, Any]] = _OffloadKinds(
    tuple(n for n in LADDER_CONFIGS if not NAMED_CONFIGS[n].plain))


def named_config(name: str) -> NamedConfig:
    """NAMED_CONFIGS[name], or ConfigError naming the choices."""
    if name not in NAMED_CONFIGS:
        raise ConfigError(f"unknown course config {name!r}. Fix: one of {sorted(NAMED_CONFIGS)}.")
    return NAMED_CONFIGS[name]


def course_config(name: str, runtime: Runtime | None = None, **overrides: Any) -> dict[str, Any]:
    """The named config (NAMED_CONFIGS) as a DeepSpeed dict; with `runtime`, precision follows it (fp32 on CPU,
    fp16 on T4), without it the precision of its configs/ file (the Colab T4's fp16; notebook 01). `overrides` are
    build_ds_config arguments, a ConfigSettings field by its own name (lr=1e-3) or in settings=ConfigSettings(...)
    (the fields it sets apart from their defaults, over the named config's). A config with a file in configs/ is
    built from that file: build_ds_config of the arguments read from it, with what else the file sets merged under
    the result and checked by DeepSpeed's schema (`_with_file_settings`); a learner's edit of configs/zero2.json
    shows here. NVMe folders are not checked (`offload_config` does, and sizes NVMe parameter buffers for a model).
    "plain" gives the stage-0 config a plain PyTorch run reads."""
    named = named_config(name)
    source = named.source
    kwargs: dict[str, Any] = {"precision": source.precision if source else COURSE_CONFIG_PRECISION,
                              "check_paths": False, **named.kwargs}
    if runtime is not None:
        kwargs.update(precision="auto", runtime=runtime)
    kwargs.update(_flat_arguments(overrides))
    return _with_file_settings(build_ds_config(**_split_arguments(kwargs)), source)


def offload_config(kind: str, runtime: Runtime, *, largest_param: int = 0, nvme_path: str | None = None,
                   n_params: int = 0, **overrides: Any) -> dict[str, Any]:
    """The offload config `kind` (OFFLOAD_KINDS) sized for a model whose largest tensor has `largest_param` elements
    (notebook 02). Built as `course_config` builds it: from its configs/ file where it has one (the file's other
    settings carried), precision following `runtime`.

    With parameters on NVMe every parameter in memory holds one swap buffer: buffers hold the largest tensor
    (the embedding); 8 buffers (`check_nvme_buffers` says what sets the number needed). On CPU, NVMe
    parameter offload runs in bf16 (DeepSpeed 0.19.8 fails in fp32 there: a dtype bug). Notebook 02, ladder.
    """
    if kind not in OFFLOAD_KINDS:
        raise ConfigError(f"unknown offload config {kind!r}. Fix: one of {sorted(OFFLOAD_KINDS)}.")
    check_runtime(runtime, "offload_config")
    for name, value in (("largest_param", largest_param), ("n_params", n_params)):
        _check_count(name, value)
    named = NAMED_CONFIGS[kind]
    source = named.source
    kwargs: dict[str, Any] = {**named.kwargs, "runtime": runtime, "largest_param": largest_param,
                              "n_params": n_params}
    if named.uses_nvme:
        kwargs["nvme_path"] = nvme_path
    if named.nvme_params:
        if largest_param <= 0:
            raise ConfigError("NVMe parameter offload needs the model's largest tensor (largest_param=...) to size "
                              "its swap buffers. Fix: largest_param=helpers.model_shape(model).largest_layer_params.")
        kwargs.update(nvme_buffer_count=8, nvme_buffer_size=nvme_buffer_size_for(largest_param),
                      prefetch_bucket_size=10_000_000, max_live_parameters=30_000_000)
        if not runtime.has_gpu:
            kwargs["precision"] = "bf16"
    kwargs.update(_flat_arguments(overrides))
    return _with_file_settings(build_ds_config(**_split_arguments(kwargs)), source)


def _check_count(name: str, value: Any) -> None:
    """An element count >= 0; a size written as text ('40M') gets its number as the fix."""
    from helpers.models import parse_param_count

    count = parse_param_count(value) if isinstance(value, str) else None
    example = count if count is not None and count >= 0 else 0
    check_number(name, value, positive=False, integer=True, example=example,
                 hint=f" (an element count; helpers.model_shape(model).{'largest_layer_params' if name == 'largest_param' else 'n_params'} gives a model's)")


def activation_checkpointing_hint(config: dict[str, Any]) -> str:
    """What to call on the model for the activation checkpointing a config asks for."""
    if "activation_checkpointing" not in config:
        return "activation checkpointing off: every layer keeps its activations for backward"
    return ("activation checkpointing on: call model.gradient_checkpointing_enable() on a Hugging Face model "
            "(or wrap blocks in deepspeed.checkpointing.checkpoint); activations are recomputed in backward, "
            "about 1/3 more compute for far less activation memory")


# DeepSpeed config key -> the TrainingArguments field transformers' Trainer writes there when the value is "auto"
# (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process; notebook 04)
AUTO_FIELDS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "world_size x per_device_train_batch_size x gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "[adam_beta1, adam_beta2]",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "0 (no TrainingArguments field)",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "scheduler.params.total_num_steps": "max_steps (computed when training starts)",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
}
# keys Trainer and Accelerate size from the model's hidden size when they are "auto"
HIDDEN_SIZE_AUTO: dict[str, str] = {
    "zero_optimization.reduce_bucket_size": "hidden x hidden",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 x hidden x hidden",
    "zero_optimization.stage3_param_persistence_threshold": "10 x hidden",
}
_MISSING = object()


def _dotted_get(config: dict[str, Any], dotted: str, default: Any = _MISSING) -> Any:
    """config["a"]["b"] for "a.b"; `default` where a part is missing."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _dotted_set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[last] = value


def _check_config_dict(ds_config: Any) -> None:
    """Refuse what is not a DeepSpeed config dict (trainer_ds_config and the drivers of helpers.integrations)."""
    if not isinstance(ds_config, dict) or "zero_optimization" not in ds_config:
        raise ConfigError("expected a DeepSpeed config dict with a 'zero_optimization' section. "
                          "Fix: build one with helpers.course_config('zero2', runtime) or helpers.build_ds_config().")


def trainer_ds_config(ds_config: dict[str, Any], *, auto_buckets: bool = False) -> dict[str, Any]:
    """A copy of a course config with "auto" wherever TrainingArguments owns the value (notebook 04; written as
    configs/<name>_trainer.json). `train_batch_size` is "auto" even where the config leaves it out (the course's
    do: DeepSpeed derives it), as in Hugging Face's example configs: Trainer then writes world size x micro-batch x
    accumulation into it, and the engine's config shows it. A config in fp16 (or bf16) gets the other half-precision
    switch too, both "auto", so one file runs in fp16 on a T4, bf16 on Ampere or newer and fp32 on CPU.

    `auto_buckets` also lets Trainer size the ZeRO buckets from the model's hidden size (`HIDDEN_SIZE_AUTO`);
    the course keeps its own sizes by default (DeepSpeed's 5e8-element bucket costs ~1 GB in fp16).
    """
    _check_config_dict(ds_config)
    out = {"train_batch_size": "auto", **copy.deepcopy(ds_config)}
    for half, other in (("fp16", "bf16"), ("bf16", "fp16")):
        if half in out and other not in out:  # both switches "auto": TrainingArguments' fp16/bf16 picks one (or fp32)
            out[other] = {"enabled": "auto"}
    keys = list(AUTO_FIELDS) + (list(HIDDEN_SIZE_AUTO) if auto_buckets else [])
    for key in keys:
        if _dotted_get(out, key) is not _MISSING:
            _dotted_set(out, key, "auto")
    return out


CONFIG_REFERENCE = "https://www.deepspeed.ai/docs/config-json/"
# every key the course's configs use (configs/*.json, build_ds_config's options) -> one line of what it does, after
# DeepSpeed's config reference and its pydantic config classes (runtime/zero/config.py, offload_config.py)
_OFFLOAD_KEYS = {
    "device": "where they live: cpu (RAM) or nvme (a fast disk)",
    "nvme_path": "the folder on the fast disk that holds the swapped tensors",
    "pin_memory": "page-locked host buffers (direct copies to the GPU; RAM the OS can never page out)",
    "buffer_count": "swap buffers in the pool (NVMe)",
    "buffer_size": "elements per swap buffer (NVMe)",
    "max_in_cpu": "parameter elements kept in CPU RAM besides NVMe",
    "fast_init": "initialise the optimizer states on NVMe quickly",
}
CONFIG_KEYS: dict[str, str] = {
    "train_batch_size": "samples per optimizer step over all GPUs = micro-batch x accumulation x GPUs (DeepSpeed "
                        "derives it when left out)",
    "train_micro_batch_size_per_gpu": "samples one GPU runs through one forward and backward (the micro-batch)",
    "gradient_accumulation_steps": "micro-batches whose gradients are summed before each optimizer step",
    "steps_per_print": "DeepSpeed logs progress every this many optimizer steps",
    "wall_clock_breakdown": "true: DeepSpeed times forward, backward and step and logs them",
    "optimizer.type": "the optimizer DeepSpeed builds (AdamW: Adam with decoupled weight decay)",
    "optimizer.params.lr": "learning rate (a scheduler, when there is one, sets it at every step)",
    "optimizer.params.betas": "Adam's decay rates for the running mean of the gradients and of their squares",
    "optimizer.params.eps": "added to Adam's denominator to keep the division finite",
    "optimizer.params.weight_decay": "AdamW's weight decay, applied apart from the gradient",
    "optimizer.params.torch_adam": "true: PyTorch's own AdamW rather than DeepSpeed's fused CUDA Adam (no kernel to "
                                   "compile first)",
    "scheduler.type": "the learning-rate schedule DeepSpeed builds (WarmupLR: warm up, then hold; WarmupDecayLR: "
                      "then decay to 0)",
    "scheduler.params.warmup_min_lr": "learning rate at the start of the warm-up (DeepSpeed's first two steps use it)",
    "scheduler.params.warmup_max_lr": "learning rate reached at the end of the warm-up",
    "scheduler.params.warmup_num_steps": "optimizer steps of warm-up (DeepSpeed uses at least 2)",
    "scheduler.params.warmup_type": "the warm-up's curve from min to max: linear or log",
    "scheduler.params.total_num_steps": "WarmupDecayLR: the step at which the learning rate has decayed to 0",
    "gradient_clipping": "the gradients are scaled down whenever their global norm exceeds this",
    "fp16.enabled": "fp16 (16-bit floating point) mixed precision: 16-bit weights, gradients and activations, fp32 "
                    "master weights in the optimizer",
    "fp16.auto_cast": "cast the model's inputs to fp16",
    "fp16.loss_scale": "0: dynamic loss scaling (the loss is multiplied so small fp16 gradients do not round to 0); "
                       "a number: that fixed scale",
    "fp16.initial_scale_power": "the dynamic loss scale starts at 2**this (16: 65,536)",
    "fp16.loss_scale_window": "optimizer steps without overflow before the loss scale is doubled",
    "fp16.hysteresis": "overflowing steps (each one skipped) before the loss scale is halved",
    "fp16.min_loss_scale": "the loss scale never drops below this",
    "bf16.enabled": "bf16 (bfloat16: fp32's range in 16 bits, no loss scaling) mixed precision; Ampere GPUs or newer, "
                    "not a T4",
    "zero_optimization.stage": "ZeRO (Zero Redundancy Optimizer) stage: 0 nothing, 1 optimizer states, 2 also "
                               "gradients, 3 also parameters partitioned across the data-parallel GPUs",
    "zero_optimization.overlap_comm": "true: reduce gradients while backward still runs (a second bucket of GPU "
                                      "memory)",
    "zero_optimization.contiguous_gradients": "copy gradients into one contiguous buffer as they are produced "
                                              "(no fragmentation in backward)",
    "zero_optimization.reduce_bucket_size": "gradient elements reduced at a time: a GPU buffer of that many "
                                            "elements (5e7 in fp16: 0.1 GB)",
    "zero_optimization.allgather_bucket_size": "elements gathered at a time when the updated parameter partitions "
                                               "are shared after the step",
    "zero_optimization.reduce_scatter": "average gradients with reduce-scatter (each GPU gets its partition) rather "
                                        "than all-reduce",
    "zero_optimization.sub_group_size": "ZeRO-3: parameter elements the optimizer steps at a time (with NVMe, what "
                                        "is swapped in at once)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "ZeRO-3: gather the whole 16-bit weights when "
                                                                   "the model is saved",
    "zero_optimization.stage3_prefetch_bucket_size": "ZeRO-3: parameter elements fetched ahead of use",
    "zero_optimization.stage3_param_persistence_threshold": "ZeRO-3: parameters smaller than this stay whole on "
                                                            "every GPU",
    "zero_optimization.stage3_max_live_parameters": "ZeRO-3: the most parameter elements gathered on a GPU at once",
    "zero_optimization.stage3_max_reuse_distance": "ZeRO-3: a parameter needed again within this many elements is "
                                                   "kept rather than released",
    **{f"zero_optimization.offload_optimizer.{k}": f"optimizer states: {v}" for k, v in _OFFLOAD_KEYS.items()},
    **{f"zero_optimization.offload_param.{k}": f"parameters: {v}" for k, v in _OFFLOAD_KEYS.items()},
    "aio.block_size": "bytes per asynchronous disk request (NVMe offload)",
    "aio.queue_depth": "disk requests in flight at once",
    "aio.intra_op_parallelism": "threads submitting disk requests",
    "aio.single_submit": "true: submit requests one by one rather than in batches",
    "aio.overlap_events": "overlap submitting requests with waiting for them",
    "activation_checkpointing.partition_activations": "split checkpointed activations across model-parallel GPUs",
    "activation_checkpointing.cpu_checkpointing": "keep the checkpointed activations in CPU RAM",
    "activation_checkpointing.contiguous_memory_optimization": "copy checkpoints into one contiguous buffer",
    "activation_checkpointing.synchronize_checkpoint_boundary": "wait for the GPU at each checkpoint boundary",
}


def _leaves(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every non-dict value of `config`, in its order."""
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def explain_config(config: dict[str, Any]) -> str:
    """Every key of a DeepSpeed config with its value and one line of what it does (`CONFIG_KEYS`), one block per
    section, headed by DeepSpeed's config reference (notebook 01 shows configs/zero2.json so). A key the course does
    not know is named as such, with the reference to look it up in."""
    if not isinstance(config, dict):
        raise ConfigError(f"explain_config takes a DeepSpeed config dict (got {type(config).__name__}). Fix: "
                          "helpers.explain_config(json.loads(Path('configs/zero2.json').read_text())).")
    rows: list[tuple[str, str]] = []  # (left column, meaning); a section's heading has no meaning
    section = None
    for key, value in _leaves(config):
        parent, _, leaf = key.rpartition(".")
        if parent != section:
            section = parent
            if parent:
                rows.append((f"{parent}:", ""))
        indent = "  " if parent else ""
        rows.append((f"{indent}{leaf} = {json.dumps(value)}",
                     CONFIG_KEYS.get(key, f"not one of the course's keys: see {CONFIG_REFERENCE}")))
    width = max([10] + [len(left) + 2 for left, meaning in rows if meaning])
    lines = [f"each key, its value and what it does (DeepSpeed's reference: {CONFIG_REFERENCE})"]
    lines += [f"{left:<{width}}{meaning}" if meaning else left for left, meaning in rows]
    return "\n".join(lines)


def validate_ds_config(config: dict[str, Any]) -> dict[str, Any]:
    """Run DeepSpeed's own pydantic config classes over `config`; raise ConfigError with the reason (notebook 00)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        DeepSpeedConfig(copy.deepcopy(config))
    except Exception as exc:  # DeepSpeed raises ValidationError, AssertionError, ValueError ...
        raise ConfigError(f"DeepSpeed rejected this config: {exc}") from exc
    return config


def write_course_configs(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write what configs/ derives from its source files: configs/<name>_trainer.json for every `trainer` entry, the
    "auto" form for Trainer (`trainer_ds_config`) of course_config(name), the config its source file configs/<name>.json
    gives (run: python -m helpers.config after editing configs/zero2.json or zero3.json). `directory`: where to write
    them (CONFIGS_DIR, the folder the sources are read from, by default). The source files are never written."""
    out = CONFIGS_DIR if directory is None else Path(directory)
    files = {f"{name}_trainer.json": trainer_ds_config(course_config(name)) for name in TRAINER_CONFIGS}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, config in files.items():
        text = json.dumps(config, indent=2) + "\n"
        written.append(write_atomically(out / file_name, lambda tmp, text=text: tmp.write_text(text)))
    return written


if __name__ == "__main__":
    for p in write_course_configs():
        print("wrote", p)
