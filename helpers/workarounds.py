"""Every place the course works around DeepSpeed, in one list (issue 43 item 5): what each fixes, where its code is,
the DeepSpeed versions it was checked against and what upstream knows. tests/test_workarounds.py fails when the
installed DeepSpeed is not one of an entry's checked versions (re-check that entry's code against the new version,
then add the version or remove the workaround) and when an entry names code that no longer exists.

Nothing here changes DeepSpeed: the code lives where `where` says; docs/decisions.md ("Workarounds for DeepSpeed
0.19.8", "DeepSpeed 0.19.8 bugs") has the measurements behind each.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers.overflow_check import CHECKED_DEEPSPEED

__all__ = []


@dataclass(frozen=True)
class Workaround:
    """One workaround: `where` is the helpers object holding it ("module.name"), `checked` the DeepSpeed versions it
    was checked against, `upstream` the issue or PR (or where upstream's code is, when none is filed)."""

    name: str
    where: str
    checked: tuple[str, ...]
    fixes: str
    upstream: str


CHECKED = (CHECKED_DEEPSPEED,)  # the DeepSpeed versions every entry below was checked against

DEEPSPEED_WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround("ZeRO-0 fp16 loss scale", "train.stage0_fp16_loss", CHECKED,
               "with ZeRO off in fp16 the loss is never scaled, yet the optimizer divides by the scale: gradients "
               "65,536x too small (notebook 01)",
               "deepspeedai/DeepSpeed#8393 (open); runtime/engine.py backward"),
    Workaround("chunked fp16 overflow check", "overflow_check.chunk_zero3_overflow_check", CHECKED,
               "ZeRO-3's has_overflow runs torch.isinf over the whole host gradient buffer: 3 bytes per parameter of "
               "RAM at each step (GPT-2 XL +4.67 GB; notebook 02)",
               "not filed; runtime/zero/stage3.py:3013 has_overflow"),
    Workaround("ZeRO-3 globals that keep torn-down engines", "runtime.release_zero3_globals", CHECKED,
               "parameter_offload.FWD_MODULE_STACK and the coordinator's lru_cache keep every destroyed engine's "
               "model alive (+2.3 GiB per training in one kernel)",
               "not filed; runtime/zero/parameter_offload.py, partitioned_param_coordinator.py"),
    Workaround("NVMe parameter swap buffers never freed", "runtime.release_nvme_swappers", CHECKED,
               "the page-locked parameter swap buffers outlive engine.destroy() (+0.85 GB locked per run)",
               "not filed; runtime/swap_tensor/partitioned_param_swapper.py:131, :396"),
    Workaround("hooks an interrupted ZeRO-3 constructor leaves", "runtime.remove_deepspeed_hooks", CHECKED,
               "an interrupt while the stage-3 optimizer registers its hooks leaves hooks engine.destroy() cannot "
               "remove",
               "not filed; runtime/zero/stage3.py"),
    Workaround("cpu_checkpointing's page-locked pool", "long_context.checkpoints_on_cpu", CHECKED,
               "_ActivationOffloadEngine.reset() never empties its pool keyed by exact shape: each new sequence length "
               "locks a new set (killed at 12.13 GB; notebook 06)",
               "not filed; runtime/activation_checkpointing/offload_activations.py (came with #8282)"),
    Workaround("TiledFusedLogitsLoss under fp16", "long_context.tiled_causal_lm_loss", CHECKED,
               "the weight gradient taken in forward misses the fp16 loss scale (1/256 of right at scale 256)",
               "not filed; runtime/sequence_parallel/ulysses_sp.py TiledFusedLogitsLoss"),
    Workaround("/dev/shm all-reduce buffers left behind", "launch.remove_shm_buffers", CHECKED,
               "CPU ranks' deepspeed_allreduce_buffer_* files are never unlinked (69 MB per rank per run)",
               "not filed; ops/csrc/cpu/comm/shm.cpp"),
    Workaround("async_io check in a fresh process", "health.async_io_available", CHECKED,
               "an interrupt in the kernel made AsyncIOBuilder().is_compatible() answer False from then on",
               "not filed; op_builder/async_io.py is_compatible"),
    Workaround("aio thread count key", "config.build_ds_config", CHECKED,
               "the older aio key thread_count is ignored without a warning: configs write intra_op_parallelism",
               "not filed; runtime/swap_tensor/aio_config.py"),
    Workaround("allocator retries counted again by each new ZeRO-3 engine", "runtime._forget_allocator_retries",
               CHECKED,
               "stage-3's step compares the process's cumulative num_alloc_retries with a count each new engine starts "
               "at 0: after one out-of-memory error every later engine warns of cache flushes at its first step "
               "(notebook 02's checkpoint section, a 124M model, three warnings)",
               "not filed; runtime/zero/stage3.py step (n_caching_allocator_flushes = 0 in __init__)"),
    Workaround("plain PyTorch on DeepSpeed's own scheduler", "train.lr_scheduler_from_config", CHECKED,
               "WarmupLR warms up over at least 2 steps, its first updates at warmup_min_lr: a plain baseline on its "
               "own LambdaLR trains a step ahead (notebook 01)",
               "behaviour, worth a docs note; runtime/lr_schedules.py WarmupLR"),
)
