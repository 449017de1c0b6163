"""Refusing a bad input with the fix in the message: `ConfigError` and the checks that raise it.

The floor under helpers.memory (estimates), helpers.config (the config builder) and helpers.planner (pre-flight):
each imports these, none of them imports another for its checks. Used by notebooks 00-02 through those modules.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

__all__ = ["ConfigError", "check_run_lengths"]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


class ConfigError(ValueError):
    """A DeepSpeed config that cannot work here; the message says how to fix it (notebook 07)."""


def _as_number(value: Any) -> float | None:
    """`value` as a float when it is a real number (not a bool, not a string), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def spelled_fix(assignment: str, within: str = "") -> str:
    """`name=value` as a refusal's fix writes it: inside `within`'s call when given (within="settings=ConfigSettings":
    settings=ConfigSettings(name=value), a build_ds_config setting), else as it is."""
    return f"{within}({assignment})" if within else assignment


def check_number(name: str, value: Any, *, positive: bool, integer: bool, example: Any, hint: str = "",
                 within: str = "") -> None:
    """Refuse anything but a positive (or non-negative) number, an int where `integer`, with ConfigError whose fix
    (`example`, or the value itself when it was a number in a string) passes this check; `hint` is appended.
    `within`: the call the setting is passed in, e.g. "settings=ConfigSettings": the fix then reads
    settings=ConfigSettings(name=...)."""
    def passes(v: Any) -> bool:
        number = _as_number(v)
        return (number is not None and (isinstance(v, int) or not integer)
                and (number > 0 if positive else number >= 0))

    if passes(value):
        return
    fix = spelled_fix(f"{name}={example!r}", within)
    candidate: Any = None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            candidate = float(value)
    elif isinstance(value, float):
        candidate = value
    if isinstance(candidate, float) and integer and candidate.is_integer():
        candidate = int(candidate)
    if candidate is not None and passes(candidate):
        fix = spelled_fix(f"{name}={candidate!r}", within) + (" (a number, not a string)" if isinstance(value, str)
                                                              else " (an int)")
    kind = ("a positive " if positive else "a non-negative ") + ("integer" if integer else "number")
    got = repr(value) if _as_number(value) is not None else f"{value!r}, a {type(value).__name__}"
    raise ConfigError(f"{name} must be {kind} (got {got}). Fix: {fix}{hint}.")


def config_micro_batch(config: Any, micro_batch: Any, *, caller: str) -> int:
    """The micro-batch of a function that takes both a DeepSpeed config and a `micro_batch` argument (notebook 02's
    `estimate_run`, `estimate_step_time`): the config's `train_micro_batch_size_per_gpu`; the argument only for a
    config without one (1 when neither says) or for None (plain PyTorch, where it is needed). An argument that
    disagrees with the config is refused with the fix (ConfigError), never silently used: the config is the one
    home of the micro-batch."""
    configured = config.get("train_micro_batch_size_per_gpu") if config is not None else None
    if micro_batch is not None and configured is not None and int(configured) != int(micro_batch):
        raise ConfigError(f"{caller}: micro_batch={micro_batch} but the config says train_micro_batch_size_per_gpu="
                          f"{configured}. Fix: leave micro_batch out; the config's value is used (or build the "
                          f"config with micro_batch_size={micro_batch}).")
    if configured is not None:
        return int(configured)
    if micro_batch is None and config is None:
        raise ConfigError(f"{caller}(None, ...) is plain PyTorch: no config to read the micro-batch from. Fix: pass "
                          "micro_batch=4 (the samples one forward and backward runs).")
    return 1 if micro_batch is None else int(micro_batch)


def check_offload_device(name: str, device: Any) -> None:
    """`device` must be one of OFFLOAD_DEVICES (the config builder and the estimators)."""
    if device in OFFLOAD_DEVICES:
        return
    fix = f"{name}={device.lower()!r}" if isinstance(device, str) and device.lower() in OFFLOAD_DEVICES else \
        f"{name}='none' (keeps it on the GPU), 'cpu' or 'nvme'"
    raise ConfigError(f"{name} must be one of {OFFLOAD_DEVICES} (got {device!r}). Fix: {fix}.")


def check_model_size(n_params: Any, largest_layer_params: Any) -> None:
    """A model's size for the estimators: a positive parameter count, a non-negative largest layer."""
    check_number("n_params", n_params, positive=True, integer=False, example=124_439_808,
                 hint=" (GPT-2 124M; helpers.model_shape(name).n_params gives a model's count)")
    check_number("largest_layer_params", largest_layer_params, positive=False, integer=False, example=0,
                 hint=" (unknown), or helpers.model_shape(name).largest_layer_params")


def check_runtime(runtime: Any, where: str) -> None:
    """`runtime` must be what helpers.detect_runtime() returns (or None where `where` accepts None): a device name
    such as 'cpu' or 'cuda' is refused with the fix, before any attribute of it is read."""
    if runtime is None or (hasattr(runtime, "has_gpu") and hasattr(runtime, "ram_budget_bytes")
                           and hasattr(runtime, "precision")):
        return
    hint = ""
    if isinstance(runtime, str):
        hint = (" A runtime is not a device name: it holds this machine's GPU, RAM and disk budgets"
                + (" (for a CPU config without one, pass precision='fp32' and leave runtime out)"
                   if runtime.strip().lower() == "cpu" else "") + ".")
    raise ConfigError(f"{where} needs runtime=helpers.detect_runtime() (got {runtime!r}, a {type(runtime).__name__})."
                      f"{hint} Fix: runtime=helpers.detect_runtime() (or helpers.colab_t4_profile() for a what-if "
                      "of a free Colab T4).")


def _check_seq_len(seq_len: Any, max_positions: Any) -> None:
    """SEQ_LEN: an int from 2 up to `max_positions` (when that is known: an int >= 2), refused with a fix that passes."""
    limit = max_positions if isinstance(max_positions, int) and not isinstance(max_positions, bool) \
        and max_positions >= 2 else 0

    def fits(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 2 and (not limit or n <= limit)

    if fits(seq_len):
        return
    if isinstance(seq_len, int) and not isinstance(seq_len, bool) and limit and seq_len > limit:
        raise ValueError(f"SEQ_LEN = {seq_len!r} is longer than the model's {limit:,} positions: its position "
                         f"embeddings stop there, and the fine-tune would fail in its first forward (torch's "
                         f"IndexError). Fix: SEQ_LEN = {min(512, limit)} (at most {limit}).")
    number: Any = None
    if isinstance(seq_len, str):
        with contextlib.suppress(ValueError):
            number = int(seq_len.strip())
    elif isinstance(seq_len, float) and seq_len.is_integer():
        number = int(seq_len)
    fix = (f"SEQ_LEN = {number} " + ("(no quotes)" if isinstance(seq_len, str) else "(an int)") if fits(number)
           else f"SEQ_LEN = {min(512, limit) if limit else 512}")
    most = f" and at most the model's {limit:,} positions" if limit else ""
    raise ValueError(f"SEQ_LEN = {seq_len!r}: a block is a whole number of tokens, at least 2 (each token is "
                     f"predicted from the ones before it){most}. Fix: {fix}.")


def check_run_lengths(*, steps: Any, eval_every: Any = None, compare_steps: Any = None, seq_len: Any = None,
                      max_positions: Any = None) -> None:
    """A notebook's step counts and block length, checked in the cell after its parameters, before anything trains
    (notebook 01): STEPS a positive integer giving at least two validation losses at EVAL_EVERY (the loss must be seen
    to fall), COMPARE_STEPS at least 4 (each comparison run leaves 2 steps untimed and needs 2 timed ones for a
    spread), and SEQ_LEN an integer from 2 (a block predicts each token from the ones before it) up to the model's
    `max_positions` (GPT-2 learned 1,024 positions: a longer block fails inside the model's first forward, with
    torch's IndexError; 0 or None: not known, not checked). Each refusal names the notebook's variable and a fix
    that passes."""
    if seq_len is not None:
        _check_seq_len(seq_len, max_positions)
    check_number("STEPS", steps, positive=True, integer=True, example=120, hint=" (optimizer steps to train)")
    if compare_steps is not None and not (isinstance(compare_steps, int) and not isinstance(compare_steps, bool)
                                          and compare_steps >= 4):
        raise ValueError(f"COMPARE_STEPS = {compare_steps!r}: each comparison run leaves its first 2 steps untimed and "
                         "needs at least 2 timed steps for a speed and its spread. Fix: COMPARE_STEPS = 4 or more (6 "
                         "on CPU, 10 on Colab).")
    valid_every = isinstance(eval_every, int) and not isinstance(eval_every, bool) and eval_every > 0
    if eval_every is not None and not (valid_every and steps >= 2 * eval_every):
        if steps >= 2:  # each fix below passes this check
            fix = f"EVAL_EVERY = {steps // 2}" + (f" (or STEPS = {2 * eval_every} or more)" if valid_every else "")
        else:
            fix = f"STEPS = {2 * eval_every} or more" if valid_every else "STEPS = 2 or more with EVAL_EVERY = 1"
        raise ValueError(f"STEPS = {steps!r} with EVAL_EVERY = {eval_every!r} gives fewer than 2 validation losses, "
                         f"and the fine-tune checks that the validation loss falls. Fix: {fix}.")
