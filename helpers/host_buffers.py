"""The host RAM that DeepSpeed's ZeRO-3 offload allocates, buffer by buffer, with the line of DeepSpeed that allocates
each: the estimate side of the host byte account (issue 25: what keeps GPT-2 2.7B from fitting Colab's 12.7 GB;
`helpers.host_trace` is the measured side, `benchmarks/host_memory.py` compares them).

Checked against DeepSpeed 0.19.8 (`helpers.overflow_check.CHECKED_DEEPSPEED`): the sites name its files, functions and
lines, which move between releases. Sizes follow from the config (sub-group size, buffer counts and sizes, offload
devices, dtypes) and the model's parameter tensors in `model.parameters()` order (DeepSpeed cuts sub-groups in that
order).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from helpers.memory import RUNTIME_GROWTH_BYTES  # the runtime's own growth, measured (see there)

__all__ = []

AIO_ALIGNED_BYTES = 1024  # deepspeed/runtime/swap_tensor/utils.py: swap buffers are whole multiples of this
NORM_BUFFER_ELEMENTS = 250_000_000  # stage3.py _constant_buffered_norm2's split size
# Allocation sites that are on the accelerator on a GPU runtime (on a CPU-only run they are host RAM too): a CPU
# trace lists them, the host account leaves them out.
DEVICE_SITES = (
    "runtime/zero/stage3.py:782 _setup_for_real_optimizer",  # the reduce (IPG) bucket, on the current device
    "runtime/zero/utils.py:221 defragment",  # the flat 16-bit parameter partitions, when parameters stay on the GPU
    "runtime/zero/partition_parameters.py",  # parameters gathered and partitioned
    "runtime/zero/linear.py", "runtime/engine.py", "runtime/zero/parameter_offload.py",  # activations, gradients
    "comm/torch.py", "utils/nvtx.py",  # the gradient reduce-scatter
    "transformers/",  # initialisation of the layers
)


@dataclass
class HostBuffer:
    """One host allocation of a ZeRO-3 offload run: what it holds, where DeepSpeed makes it, how big, and when."""

    name: str
    site: str  # "runtime/zero/stage3.py:791 _setup_for_real_optimizer" (under deepspeed/, CHECKED_DEEPSPEED)
    bytes: int
    formula: str
    when: str  # "always" (from deepspeed.initialize on), "initialize" or "step" (freed again), "first step"
    one_at_a_time: bool = False  # the site's lines allocate in turn: measured as the most any one of them held
    traced: bool = True  # False: made inside an operator (helpers.host_trace sees only what operators return)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parameter_numels(model: Any) -> list[int]:
    """Element counts of the model's parameter tensors in `model.parameters()` order (tied weights once); `model` as
    `helpers.model_shape` takes it. Built on the meta device: nothing is allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.models import gpt2_config

    config = gpt2_config(model) if isinstance(model, str) else model
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return [p.numel() for p in m.parameters()]


def sub_group_numels(numels: list[int], sub_group_size: int) -> list[int]:
    """DeepSpeed's ZeRO-3 sub-groups (stage3.py `_create_fp16_sub_groups`): parameters in order, a group closed as soon
    as it reaches `sub_group_size` elements, so a group can exceed it by up to one tensor."""
    if sub_group_size >= sum(numels):
        return [sum(numels)]
    groups, current = [], 0
    for n in numels:
        current += n
        if current >= sub_group_size:
            groups.append(current)
            current = 0
    if current:
        groups.append(current)
    return groups


def _aligned(numel: int, element_bytes: int, intra_op_parallelism: int) -> int:
    unit = AIO_ALIGNED_BYTES * intra_op_parallelism // element_bytes
    return -(-numel // unit) * unit


def stage3_host_buffers(config: dict[str, Any], numels: list[int], *, gpu: bool = True,
                        overflow_chunk: int = 0) -> list[HostBuffer]:
    """The host buffers of a ZeRO-3 `config` with offload, for a model whose parameter tensors have `numels` elements
    (`parameter_numels`), on a GPU runtime (`gpu=False`: a CPU-only one, where the accelerator is the CPU and
    DeepSpeed's gradient work at the accumulation boundary - the float64 norm, the fp32 copy before the swap-out -
    happens in host RAM too). `overflow_chunk`: the slice size when `helpers.chunk_zero3_overflow_check` is on (its
    min/max per slice holds nothing; 0: DeepSpeed's own whole-buffer check, 3 B per parameter). Empty without offload (everything then lives on the GPU)."""
    z = config.get("zero_optimization", {})
    if z.get("stage") != 3:
        return []
    opt = (z.get("offload_optimizer") or {}).get("device", "none")
    par = (z.get("offload_param") or {}).get("device", "none")
    e = 2 if (config.get("fp16", {}).get("enabled") or config.get("bf16", {}).get("enabled")) else 4
    grad_accum = {"fp32": 4, "fp16": 2, "bf16": 2}.get(str(config.get("data_types", {}).get("grad_accum_dtype")), e)
    intra = int(config.get("aio", {}).get("intra_op_parallelism", 1))
    psi, largest = sum(numels), max(numels)
    groups = sub_group_numels(numels, int(z.get("sub_group_size", 1_000_000_000)))
    g = max(groups)
    s3 = "runtime/zero/stage3.py"
    rows: list[HostBuffer] = []
    if opt != "none":
        rows.append(HostBuffer("16-bit gradient partitions, one flat buffer", f"{s3}:791 _setup_for_real_optimizer",
                               grad_accum * psi, f"{grad_accum} B x {psi:,} params", "always"))
        if not gpu:  # on a GPU, partition_grads moves each gradient partition to the device first
            rows.append(HostBuffer("gradient norm in float64, one tensor at a time",
                                   f"{s3}:1964 _constant_buffered_norm2", 8 * min(largest, NORM_BUFFER_ELEMENTS),
                                   f"8 B x largest tensor ({largest:,})", "step"))
        if config.get("fp16", {}).get("enabled") and not overflow_chunk:
            # loss scaling: has_overflow checks the whole buffer on the host (the chunked check's min/max per slice
            # makes no temporary)
            rows.append(HostBuffer("inf/nan mask of the gradient buffer (torch.isinf, then torch.isnan)",
                                   f"{s3} has_overflow", psi, f"1 B (bool) x {psi:,} params", "step",
                                   one_at_a_time=True))
            # torch.isinf(x) is `x.abs() == inf` inside the operator: a 16-bit copy beside the mask, never returned
            rows.append(HostBuffer("|gradient| copy inside torch.isinf (not traced: made inside the operator)",
                                   f"{s3}:3013 has_overflow", grad_accum * psi,
                                   f"{grad_accum} B x {psi:,} params", "step", traced=False))
    if opt == "nvme":
        count = int(z["offload_optimizer"].get("buffer_count", 4))
        rows.append(HostBuffer("optimizer swap buffers (fp32)", "runtime/swap_tensor/utils.py:192 <listcomp>",
                               count * _aligned(g, 4, intra) * 4,
                               f"{count} buffers x 4 B x largest sub-group ({g:,}, aligned)", "always"))
        # partition_grads converts one reduce bucket's gradients to fp32 and swaps them out together; a bucket
        # closes before the tensor that would overflow it, so it holds at most max(bucket, largest tensor)
        bucket = min(max(int(z.get("reduce_bucket_size", 500_000_000)), largest), psi)
        # (measured the same with gradient_accumulation_steps=2: GPT-2 124M, 0.198 GB against 0.200)
        if not gpu:  # on a GPU these fp32 copies are made on the device
            rows.append(HostBuffer("fp32 gradients of one reduce bucket, before their swap-out",
                                   f"{s3}:1453 _offload_grad_partition_at_boundary", 4 * bucket,
                                   f"4 B x max(reduce bucket, largest tensor) ({bucket:,})", "step"))
        rows.append(HostBuffer("Adam moments made at the first step (then swapped out)", "ops/adam/cpu_adam.py step",
                               8 * g, f"2 x 4 B x largest sub-group ({g:,})", "first step"))
        rows.append(HostBuffer("gradient buffer while optimizer states are initialised",
                               f"{s3}:1306 initialize_optimizer_states", 4 * g,
                               f"4 B x largest sub-group ({g:,})", "initialize"))
    elif opt == "cpu":
        rows.append(HostBuffer("fp32 master weights", f"{s3} _create_fp32_partitions", 4 * psi,
                               f"4 B x {psi:,} params", "always"))
        rows.append(HostBuffer("fp32 gradients", f"{s3}:1338 initialize_optimizer_states", 4 * psi,
                               f"4 B x {psi:,} params", "always"))
        rows.append(HostBuffer("Adam moments", "ops/adam/cpu_adam.py step", 8 * psi, f"2 x 4 B x {psi:,} params",
                               "first step"))
    if par == "nvme":
        count = int(z["offload_param"].get("buffer_count", 5))
        size = int(z["offload_param"].get("buffer_size", 100_000_000))
        swap = count * _aligned(size, e, intra) * e
        pps = "runtime/swap_tensor/partitioned_param_swapper.py"
        # page-locked by the aio handle (C++): the trace first sees them where a buffer is handed out
        rows.append(HostBuffer("parameter swap buffers (page-locked)", f"{pps}:363 get_buffer", swap,
                               f"{count} buffers x {e} B x {size:,} (aligned)", "always"))
        rows.append(HostBuffer("a torch.empty of the same size, replaced by the page-locked buffers",
                               f"{pps}:124 _configure_aio", swap, "as the parameter swap buffers", "initialize"))
        rows.append(HostBuffer("swap space for the updated 16-bit partition of a sub-group",
                               "runtime/swap_tensor/partitioned_param_swapper.py:397 reserve_partitioned_swap_space",
                               e * g, f"{e} B x largest sub-group ({g:,})", "always"))
        if opt == "nvme":
            # one fp32 buffer per sub-group in a loop: the next is allocated before the last one is released
            pair = max([a + b for a, b in zip(groups, groups[1:])] + [g])
            rows.append(HostBuffer("fp32 master weights read back from NVMe parameters at initialisation",
                                   f"{s3}:1135 _create_fp32_partitions", 4 * pair,
                                   f"4 B x the largest two adjacent sub-groups ({pair:,})", "initialize"))
    elif par == "cpu":
        rows.append(HostBuffer("16-bit parameters, one flat pinned buffer per group",
                               f"{s3}:906 _create_param_groups_fp16_flat_cpu_memory", e * psi,
                               f"{e} B x {psi:,} params (torch's pinned allocator rounds it up to a power of two)",
                               "always"))
    return rows


@dataclass
class HostPeak:
    """The peak host RAM of a ZeRO-3 offload run, by part (bytes): what the process held before its model
    (`baseline`), what the runtime adds (`runtime`), the buffers held from `deepspeed.initialize` on (`always`), and
    the largest moment on top of them (`transient`: inside a step, the first step, or initialisation, whichever is
    largest; `transient_when` says which)."""

    baseline: int
    runtime: int
    always: int
    transient: int
    transient_when: str
    rows: list[HostBuffer] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.baseline + self.runtime + self.always + self.transient


def stage3_host_peak(config: dict[str, Any], numels: list[int], *, baseline_bytes: int, gpu: bool = True,
                     overflow_chunk: int = 0) -> HostPeak:
    """Peak host RAM of a ZeRO-3 offload run from its named buffers (`stage3_host_buffers`), the process's own
    `baseline_bytes` before the model exists (helpers.child_baseline_rss measures it) and `RUNTIME_GROWTH_BYTES`.
    Transients of one kind are alive together, kinds at different moments (has_overflow's mask and copy are freed
    before the optimizer step makes the first step's Adam moments). Checked against reports/host_memory.json and the
    2.7B rung of reports/ladder_2p7b_colab_emulation.json (tests/test_host_memory.py)."""
    rows = stage3_host_buffers(config, numels, gpu=gpu, overflow_chunk=overflow_chunk)
    always = sum(b.bytes for b in rows if b.when == "always")
    moments = {when: sum(b.bytes for b in rows if b.when == when) for when in ("step", "first step", "initialize")}
    when = max(moments, key=lambda k: moments[k]) if moments else "step"
    return HostPeak(int(baseline_bytes), RUNTIME_GROWTH_BYTES, always, moments.get(when, 0), when, rows)
