"""ZeRO-3's fp16 overflow check in chunks: the one change of DeepSpeed the course makes, optional, for the 2.7B rung of
notebook 02's ladder (issue 25).

With fp16, every optimizer step of DeepSpeed 0.19.8's ZeRO-3 asks whether any gradient is inf or NaN
(`DeepSpeedZeroOptimizer_Stage3.has_overflow`, deepspeed/runtime/zero/stage3.py) with
`torch.isinf(self.grad_partitions_flat_buffer).any()` and then `torch.isnan(...)` over the whole gradient buffer at
once. With `offload_optimizer` that buffer is in host RAM, 2 bytes per parameter, and `torch.isinf` builds
`buffer.abs() == inf`: a 2-byte copy and a 1-byte mask of every parameter, 3 bytes per parameter for a moment
(measured on the GPU machine, GPT-2 XL: the RSS rose 4.67 GB above its steady 7.11 GB in every step; 2.7B: 7.95 GB,
the difference between fitting Colab's RAM and not). `chunk_zero3_overflow_check()` makes the same check over slices
of `chunk_elements` (2^25 by default) with one min/max reduction per slice (`torch.aminmax`: a NaN makes both NaN,
+-inf is the max or min): same answer, same streams and all-reduces, no temporary at all. Speed: one read of the
buffer instead of isinf's copy + mask and isnan's mask; on 2 CPUs ~18 G elements/s against DeepSpeed's ~0.4
(`helpers.limits.measure_overflow_check`): GPT-2 XL's check from ~7 s per optimizer step to ~0.1 s (issue 24).

It replaces that one method of that one class, for DeepSpeed `CHECKED_DEEPSPEED` only (other versions: a clear
refusal, since the method may have changed); `restore_zero3_overflow_check()` puts DeepSpeed's own back.
"""

from __future__ import annotations

from typing import Any

__all__ = ["chunk_zero3_overflow_check", "restore_zero3_overflow_check"]

# The DeepSpeed version the course was checked against, its one home: helpers.workarounds (CHECKED), host_buffers'
# sites, moe's message and the requirements' pin (tests/test_workarounds.py) read it from here, the lowest floor.
CHECKED_DEEPSPEED = "0.19.8"
PATCHED_FUNCTION = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow"
DEFAULT_CHUNK_ELEMENTS = 2**25
_ORIGINAL: dict[str, Any] = {}


def _stage3() -> Any:
    import deepspeed
    from deepspeed.runtime.zero import stage3

    if deepspeed.__version__ != CHECKED_DEEPSPEED:
        raise RuntimeError(f"chunk_zero3_overflow_check replaces {PATCHED_FUNCTION}, checked against DeepSpeed "
                           f"{CHECKED_DEEPSPEED} only; this is DeepSpeed {deepspeed.__version__}. Run without it "
                           f"(the 2.7B rung then needs ~3 bytes per parameter more RAM at each step), or install "
                           f"deepspeed=={CHECKED_DEEPSPEED}.")
    return stage3


def _any_inf_or_nan(flat: Any, chunk_elements: int) -> Any:
    """A 0-dim bool tensor on `flat`'s device: does any element of `flat` fail isfinite (inf or NaN)?

    Each slice's smallest and largest element (`torch.aminmax`, a reduction: no temporary of the slice's size):
    a NaN anywhere makes both NaN, +inf is the largest, -inf the smallest, so the answer is isinf/isnan's."""
    import torch

    found = torch.zeros((), dtype=torch.bool, device=flat.device)
    for part in flat.view(-1).split(chunk_elements):
        low, high = torch.aminmax(part)
        found.logical_or_(~(torch.isfinite(low) & torch.isfinite(high)))
    return found


def _check_chunk_elements(chunk_elements: Any) -> None:
    """Refuse anything but an int >= 1 (issue 41: '1e6' raised a TypeError, 2.5 failed at every optimizer step), with a
    fix that passes: the number the learner meant when it is a whole one, else the default."""
    if not isinstance(chunk_elements, bool) and isinstance(chunk_elements, int) and chunk_elements >= 1:
        return
    meant: Any = None
    if not isinstance(chunk_elements, bool):
        try:
            meant = float(chunk_elements)
        except (TypeError, ValueError):
            pass
    fix = int(meant) if meant is not None and meant.is_integer() and meant >= 1 else DEFAULT_CHUNK_ELEMENTS
    raise ValueError(f"chunk_elements must be an integer >= 1 (got {chunk_elements!r}). Fix: chunk_elements={fix} "
                     f"(the default is {DEFAULT_CHUNK_ELEMENTS})")


def chunk_zero3_overflow_check(chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
    """Make ZeRO-3's fp16 overflow check scan the gradient buffer in slices of `chunk_elements` (this process, all
    engines made from now on and those already made) (notebook 02). Idempotent; refuses DeepSpeed versions other than
    0.19.8."""
    _check_chunk_elements(chunk_elements)
    stage3 = _stage3()
    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    original = _ORIGINAL.setdefault("has_overflow", cls.has_overflow)
    dist, get_accelerator, torch = stage3.dist, stage3.get_accelerator, stage3.torch

    def has_overflow(self: Any, partition_gradients: bool = True) -> bool:
        if not partition_gradients:
            return original(self, partition_gradients)
        # DeepSpeed 0.19.8's body, with the two whole-buffer checks done as min/max slice by slice
        with get_accelerator().stream(self.reduce_and_partition_stream):
            self.inf_or_nan_tracker.logical_or_(_any_inf_or_nan(self.grad_partitions_flat_buffer, chunk_elements))
            overflow_gpu = self.inf_or_nan_tracker.clone().to(get_accelerator().current_device_name()).to(
                torch.uint8)
            self.inf_or_nan_tracker.zero_()
        if not get_accelerator().resolves_data_dependency():
            get_accelerator().default_stream().wait_stream(self.reduce_and_partition_stream)
        dist.all_reduce(overflow_gpu, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=overflow_gpu, op=dist.ReduceOp.MAX)
        return bool(overflow_gpu[0].item())

    has_overflow.chunk_elements = chunk_elements  # type: ignore[attr-defined]
    has_overflow.__doc__ = f"{PATCHED_FUNCTION}, scanning in slices of {chunk_elements:,} (helpers.overflow_check)"
    cls.has_overflow = has_overflow


def restore_zero3_overflow_check() -> None:
    """DeepSpeed's own has_overflow again (after chunk_zero3_overflow_check) (notebook 02). Putting the original back
    needs no version check (it is DeepSpeed's own function), and the saved original is dropped only once it is back in
    place: under another DeepSpeed version this used to take it out of the store and then raise (issue 41)."""
    if "has_overflow" in _ORIGINAL:
        from deepspeed.runtime.zero import stage3

        stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow = _ORIGINAL["has_overflow"]
        del _ORIGINAL["has_overflow"]


def chunked_overflow_check_active() -> bool:
    """Whether this process checks ZeRO-3's gradients for overflow in slices (chunk_zero3_overflow_check)."""
    return "has_overflow" in _ORIGINAL
