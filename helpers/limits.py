"""What this runtime can move and compute per second: the inputs of the step-time model (notebook 02).

    limits = helpers.measure_limits(nvme_path="/content/nvme")   # a few seconds each, cached per runtime
    print(limits.table())

Measured, never assumed:
- disk: read and write bandwidth of the NVMe folder through DeepSpeed's own async I/O handle (the `aio` op that
  ZeRO-Infinity swaps with; O_DIRECT, so the page cache does not flatter it), with the config's `aio` settings;
- PCIe: host-to-GPU and GPU-to-host copies, from pinned and from pageable (ordinary) memory;
- CPU Adam: parameters per second that DeepSpeedCPUAdam updates on the cores this process may use;
- GPU matmul: fp16 (bf16/fp32 as the runtime trains) TFLOP/s of a large square matmul; on a CPU runtime the CPU's;
- optionally, for the model a benchmark trains (benchmarks/offload_speed.py), the parts of a ZeRO-3 offload step
  that no bandwidth above predicts, each timed on the code DeepSpeed runs: the gradient round trip through the
  host every micro-batch (`measure_grad_round_trip`), the TFLOP/s of two GPT-2 blocks of the model's width at its
  micro-batch (`measure_block_compute`), ZeRO-3's own cost per micro-batch - its parameter and gradient hooks on
  the host - on a model of the same depth but 64 wide (`measure_zero3_micro_batch`), the fp16 overflow check over
  the host gradient buffer (`measure_overflow_check`), and the updated fp32 weights copied into the GPU's fp16
  ones (`measure_weights_to_gpu`).
Units: GB/s = 1e9 bytes per second (disks and links are sold in them); TFLOP/s = 1e12 per second.
Results are cached as JSON under ~/.cache/ds-course/ (one file per runtime label and disk); `refresh=True` measures again.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["measure_limits"]

GB = 1e9
CACHE_DIR = Path(os.environ.get("DS_COURSE_CACHE", Path.home() / ".cache" / "ds-course"))
# DeepSpeed 0.19.8's aio keys and defaults (runtime/swap_tensor/constants.py); "thread_count" of older releases is
# not read any more: the thread count is "intra_op_parallelism"
AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True}


@dataclass
class RuntimeLimits:
    """Measured bandwidths and throughputs of one runtime (GB/s, TFLOP/s, parameters/s); None where not measurable."""

    runtime: str
    cpus: int
    has_gpu: bool = True
    disk_path: str | None = None
    disk_read_gbps: float | None = None
    disk_write_gbps: float | None = None
    aio: dict[str, Any] = field(default_factory=dict)
    h2d_pinned_gbps: float | None = None
    h2d_pageable_gbps: float | None = None
    d2h_pinned_gbps: float | None = None
    d2h_pageable_gbps: float | None = None
    cpu_adam_params_per_s: float | None = None
    matmul_tflops: float | None = None
    matmul_dtype: str = ""
    # gradient bytes per second through ZeRO-3's host round trip (stage3.py partition_grads), pinned / pageable
    grad_round_trip_pinned_gbps: float | None = None
    grad_round_trip_pageable_gbps: float | None = None
    block_tflops: dict[str, float] = field(default_factory=dict)  # block_key(...) -> TFLOP/s of a GPT-2 block
    zero3_micro_batch_s: dict[str, float] = field(default_factory=dict)  # "48 layers" -> ZeRO-3's seconds/micro-batch
    overflow_check_per_s: float | None = None  # elements/s of DeepSpeed's fp16 overflow check on a host buffer
    overflow_check_chunked_per_s: float | None = None  # the same with helpers.chunk_zero3_overflow_check's check
    weights_to_gpu_pinned_gbps: float | None = None  # fp32 host bytes/s copied into fp16 GPU weights
    weights_to_gpu_pageable_gbps: float | None = None
    cpu_adam_group_params: int = 0  # the sub-group size CPU Adam was timed at
    seconds: dict[str, float] = field(default_factory=dict)  # what each measurement took
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RuntimeLimits":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def table(self) -> str:
        """The limits as aligned text lines (notebook 02)."""
        def f(v: float | None, unit: str, scale: float = 1.0) -> str:
            return "not measured" if v is None else f"{v / scale:,.2f} {unit}"

        rows = [("disk read (DeepSpeed aio)", f(self.disk_read_gbps, "GB/s")),
                ("disk write (DeepSpeed aio)", f(self.disk_write_gbps, "GB/s")),
                ("host -> GPU, pinned", f(self.h2d_pinned_gbps, "GB/s")),
                ("host -> GPU, pageable", f(self.h2d_pageable_gbps, "GB/s")),
                ("GPU -> host, pinned", f(self.d2h_pinned_gbps, "GB/s")),
                ("GPU -> host, pageable", f(self.d2h_pageable_gbps, "GB/s")),
                (f"CPU Adam ({self.cpus} CPU{'s' if self.cpus != 1 else ''})",
                 f(self.cpu_adam_params_per_s, "M params/s", 1e6)),
                (f"matmul ({self.matmul_dtype or '-'})", f(self.matmul_tflops, "TFLOP/s"))]
        if self.grad_round_trip_pinned_gbps or self.grad_round_trip_pageable_gbps:
            rows += [("gradients via host, pinned", f(self.grad_round_trip_pinned_gbps, "GB/s")),
                     ("gradients via host, pageable", f(self.grad_round_trip_pageable_gbps, "GB/s"))]
        rows += [(f"GPT-2 blocks {k}", f(v, "TFLOP/s")) for k, v in self.block_tflops.items()]
        rows += [(f"ZeRO-3 hooks, {k} (64 wide)", f"{v:,.3f} s per micro-batch")
                 for k, v in self.zero3_micro_batch_s.items()]
        if self.overflow_check_per_s:
            rows.append(("fp16 overflow check (host)", f(self.overflow_check_per_s, "G elements/s", 1e9)))
        if self.overflow_check_chunked_per_s:
            rows.append(("fp16 overflow check, chunked (host)",
                         f(self.overflow_check_chunked_per_s, "G elements/s", 1e9)))
        if self.weights_to_gpu_pinned_gbps or self.weights_to_gpu_pageable_gbps:
            rows += [("fp32 weights -> GPU fp16, pinned", f(self.weights_to_gpu_pinned_gbps, "GB/s")),
                     ("fp32 weights -> GPU fp16, pageable", f(self.weights_to_gpu_pageable_gbps, "GB/s"))]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        return "\n".join(lines + [f"({n})" for n in self.notes])


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls of `fn` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_disk(path: str | os.PathLike[str], *, size_bytes: int = 1 << 30, buffer_bytes: int = 256 << 20,
                 aio: dict[str, Any] | None = None) -> tuple[float, float]:
    """(read GB/s, write GB/s) of folder `path` through DeepSpeed's async I/O handle (notebook 02's NVMe folder).

    Writes a `size_bytes` file in `buffer_bytes` pieces from one pinned buffer (the way ZeRO-Infinity swaps:
    O_DIRECT, `aio` = the config's "aio" section), reads it back, and removes it. Needs the async_io op
    (libaio: `apt-get install libaio-dev`); raises RuntimeError with that fix when it cannot load.
    """
    import torch

    settings = {**AIO_DEFAULTS, **{k: v for k, v in (aio or {}).items() if k in AIO_DEFAULTS}}
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        op = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - the op builder raises several kinds
        raise RuntimeError(f"DeepSpeed's async_io op could not load ({exc}). Fix: apt-get install libaio-dev, "
                           "then run `ds_report` to check that async_io is [OKAY].") from exc
    handle = op.aio_handle(settings["block_size"], settings["queue_depth"], settings["single_submit"],
                           settings["overlap_events"], settings["intra_op_parallelism"])
    folder = Path(os.path.expanduser(os.fspath(path)))  # '~/nvme' is the home folder's (not a folder named '~')
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f".ds-course-disk-probe-{os.getpid()}"
    pieces = max(1, size_bytes // buffer_bytes)
    buffer = torch.empty(buffer_bytes, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() else \
        handle.new_cpu_locked_tensor(buffer_bytes, torch.empty(0, dtype=torch.uint8))
    buffer.fill_(7)
    try:
        t = time.perf_counter()
        for i in range(pieces):
            handle.sync_pwrite(buffer, str(target), i * buffer_bytes)
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(pieces):
            handle.sync_pread(buffer, str(target), i * buffer_bytes)
        read_s = time.perf_counter() - t
    finally:
        target.unlink(missing_ok=True)
        if not torch.cuda.is_available():
            handle.free_cpu_locked_tensor(buffer)
    moved = pieces * buffer_bytes
    return moved / read_s / GB, moved / write_s / GB


def _copy_seconds(dst: Any, src: Any, repeats: int, non_blocking: bool) -> float:
    import torch

    def copy() -> None:
        dst.copy_(src, non_blocking=non_blocking)
        torch.cuda.synchronize()

    return _timed(copy, repeats)


def measure_pcie(size_bytes: int = 256 << 20, repeats: int = 3) -> dict[str, float]:
    """GB/s of host-to-GPU and GPU-to-host copies from pinned and pageable memory (needs a GPU)."""
    import torch

    n = size_bytes // 2
    gpu = torch.empty(n, dtype=torch.float16, device="cuda")
    out: dict[str, float] = {}
    for kind in ("pinned", "pageable"):
        host = torch.ones(n, dtype=torch.float16)
        if kind == "pinned":
            host = host.pin_memory()
        out[f"h2d_{kind}_gbps"] = size_bytes / _copy_seconds(gpu, host, repeats, kind == "pinned") / GB
        out[f"d2h_{kind}_gbps"] = size_bytes / _copy_seconds(host, gpu, repeats, kind == "pinned") / GB
    del gpu
    torch.cuda.empty_cache()
    return out


def measure_grad_round_trip(size_bytes: int = 1 << 30, piece_bytes: int = 20 << 20, pinned: bool = False,
                            repeats: int = 3) -> float:
    """Gradient GB/s through the host the way ZeRO-3 with an offloaded optimizer accumulates them (needs a GPU).

    DeepSpeed 0.19.8's `partition_grads` (runtime/zero/stage3.py), for every gradient partition of every
    micro-batch after the first: copy the host accumulation buffer's slice to the GPU (`.to(device,
    non_blocking=True)`), add the new gradient there, copy the sum back (`copy_(non_blocking=True)`); the first
    micro-batch does the same two copies. Here fp16 pieces of `piece_bytes` (a GPT-2 XL MLP matrix is 20 MB)
    go through a flat host buffer of `size_bytes` (pinned or not: the config's `pin_memory`).
    Returns gradient bytes per second (each byte crosses PCIe twice).
    """
    import torch

    n, piece = size_bytes // 2, max(1, piece_bytes // 2)
    host = torch.zeros(n, dtype=torch.float16)
    if pinned:
        host = host.pin_memory()
    grads = torch.ones(n, dtype=torch.float16, device="cuda")

    def round_trip() -> None:
        for start in range(0, n, piece):
            length = min(piece, n - start)
            buffer = host.narrow(0, start, length)
            on_gpu = buffer.to("cuda", non_blocking=True)
            on_gpu.add_(grads.narrow(0, start, length))
            buffer.copy_(on_gpu, non_blocking=True)
        torch.cuda.synchronize()

    seconds = _timed(round_trip, repeats)
    host = grads = None  # freed before empty_cache
    torch.cuda.empty_cache()
    return size_bytes / seconds / GB


def flops_per_token(weights: int, n_layers: int, hidden: int, seq_len: int, *, checkpointing: bool = True) -> float:
    """FLOPs to train on one token through `weights` multiplied parameters and `n_layers` attention layers:
    forward + backward (+ the recomputed forward with activation checkpointing) (nanoGPT's `estimate_mfu`); the
    step-time model's count (helpers.step_time.training_flops_per_token) and the blocks' TFLOP/s here."""
    return float((8 if checkpointing else 6) * weights + (16 if checkpointing else 12) * n_layers * hidden * seq_len)


def block_key(hidden: int, seq_len: int, micro_batch: int) -> str:
    """The `RuntimeLimits.block_tflops` key of one shape: "hidden 1600, 8 x 512"."""
    return f"hidden {hidden}, {micro_batch} x {seq_len}"


def block_flops(hidden: int, seq_len: int, micro_batch: int, layers: int, *, checkpointing: bool = True) -> float:
    """FLOPs of training `layers` GPT-2 blocks on one micro-batch: weights 12 h^2 per block, (6 + 2 recomputed) x
    parameters per token, attention (12 + 4) x h x sequence per token per block (helpers.step_time's count)."""
    return micro_batch * seq_len * flops_per_token(12 * hidden**2 * layers, layers, hidden, seq_len,
                                                   checkpointing=checkpointing)


def measure_block_compute(hidden: int, n_head: int, seq_len: int, micro_batch: int, *, layers: int = 2,
                          dtype: str = "fp16", repeats: int = 3) -> float:
    """TFLOP/s of forward + backward (+ the recomputed forward) through `layers` GPT-2 blocks (transformers'
    GPT2Block: attention through SDPA, MLP, layer norms) at one micro-batch, in `dtype` autocast on the GPU.

    The GPU's matmul peak (`measure_matmul`) is what square 8192 matrices reach; a block at a model's width
    and micro-batch reaches less (narrower GEMMs, softmax, norms, GELU): this is the rate the step-time model uses
    for that shape when it was measured."""
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_embd=hidden, n_head=n_head, n_positions=seq_len, n_layer=layers)
    cfg._attn_implementation = "sdpa"
    blocks = torch.nn.ModuleList(GPT2Block(cfg, layer_idx=i) for i in range(layers)).to("cuda")
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.randn(micro_batch, seq_len, hidden, device="cuda", requires_grad=True)

    def train_once() -> None:
        with torch.autocast("cuda", dtype=torch_dtype, enabled=dtype != "fp32"):
            h = x
            for block in blocks:
                h = checkpoint(lambda t, b=block: _first(b(t)), h, use_reentrant=False)
            h.float().sum().backward()
        torch.cuda.synchronize()

    seconds = _timed(train_once, repeats)
    blocks = x = None  # freed before empty_cache
    torch.cuda.empty_cache()
    return block_flops(hidden, seq_len, micro_batch, layers) / seconds / 1e12


def measure_overflow_check(n_elements: int = 256_000_000, repeats: int = 3, chunked: bool = False) -> float:
    """Elements per second of DeepSpeed 0.19.8's fp16 overflow check on a host buffer, on this process's CPUs.

    ZeRO-3 with the optimizer offloaded keeps the 16-bit gradients in one host buffer, and `has_overflow`
    (runtime/zero/stage3.py) runs `torch.isinf(buffer).any()` and `torch.isnan(buffer).any()` over all of it at
    every optimizer step (fp16 only; bf16 and fp32 skip it). `chunked`: the check
    `helpers.chunk_zero3_overflow_check` puts in its place (min/max per slice)."""
    import torch

    from helpers.overflow_check import DEFAULT_CHUNK_ELEMENTS, _any_inf_or_nan

    buffer = torch.zeros(n_elements, dtype=torch.float16)

    def check() -> None:
        if chunked:
            bool(_any_inf_or_nan(buffer, DEFAULT_CHUNK_ELEMENTS))
        else:
            bool(torch.isinf(buffer).any()) or bool(torch.isnan(buffer).any())

    seconds = _timed(check, repeats)
    buffer = None
    return n_elements / seconds


def measure_weights_to_gpu(n_elements: int = 256_000_000, pinned: bool = True, repeats: int = 3) -> float:
    """fp32 host bytes per second copied into fp16 GPU weights (needs a GPU): ZeRO-3's
    `_reassign_or_swap_out_partitioned_parameters` after each CPU Adam sub-group step
    (`fp16_flat.copy_(fp32_flat)`; the fp32 weights sit in pinned swap buffers with NVMe offload)."""
    import torch

    host = torch.ones(n_elements, dtype=torch.float32)
    if pinned:
        host = host.pin_memory()
    gpu = torch.empty(n_elements, dtype=torch.float16, device="cuda")
    seconds = _copy_seconds(gpu, host, repeats, non_blocking=False)
    del host, gpu
    torch.cuda.empty_cache()
    return 4 * n_elements / seconds / GB


def measure_zero3_micro_batch(n_layers: int, *, zero: dict[str, Any] | None = None, micro_batches: int = 6) -> float:
    """Seconds of one micro-batch (forward, backward, engine.step inside the accumulation) of a GPT-2 with
    `n_layers` blocks but 64 wide, under ZeRO-3 with the optimizer on the CPU and activation checkpointing.

    Its compute and its copies are tiny, so what is left is what ZeRO-3 costs per micro-batch whatever the width:
    fetching and releasing every block's parameters for the forward, the recomputed forward and the backward,
    and the gradient hooks (reduce, partition, copy to the host) of every parameter, run by Python on the host's
    CPUs while the GPU waits. A model of the same depth pays the same (benchmarks/offload_speed.py). `zero`: the
    config's zero_optimization section (its bucket sizes and thresholds), with the optimizer offloaded to the CPU
    and the parameters kept on the GPU whatever it says (no disk in this measurement)."""
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from helpers.runtime import destroy_engine, setup_single_process

    setup_single_process()
    gpu = torch.cuda.is_available()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1000, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {**{k: v for k, v in (zero or {}).items() if k not in ("offload_param",)},
                                    "stage": 3, "offload_optimizer": {"device": "cpu"}}}
    if gpu:
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=n_layers, n_positions=64, vocab_size=256))
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    del model
    try:
        ids = torch.randint(0, 256, (1, 64), device=engine.device)

        def micro_batch() -> None:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            if gpu:
                torch.cuda.synchronize()

        micro_batch()
        return _timed(micro_batch, micro_batches)
    finally:
        destroy_engine(engine)


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def measure_cpu_adam(n_params: int = 16_000_000, repeats: int = 5) -> float:
    """Parameters per second that DeepSpeedCPUAdam updates (fp32 states, AdamW) on this process's cores.

    Builds DeepSpeed's cpu_adam op on first use (the same build CPU offload needs; minutes on 2 cores, then cached).
    """
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from helpers.runtime import announce_op_builds

    announce_op_builds()
    p = torch.nn.Parameter(torch.zeros(n_params))
    p.grad = torch.full_like(p, 1e-3)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    seconds = _timed(opt.step, repeats)
    del opt, p
    return n_params / seconds


def measure_matmul(dtype: str = "fp16", size: int = 8192, repeats: int = 5) -> float:
    """TFLOP/s of a `size` x `size` matmul in `dtype` on the GPU (on the CPU, fp32 at size 1024, without a GPU)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        dtype, size = "fp32", min(size, 1024)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    a = torch.randn(size, size, dtype=torch_dtype, device=device)
    b = torch.randn(size, size, dtype=torch_dtype, device=device)

    def mm() -> None:
        for _ in range(4):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()

    seconds = _timed(mm, repeats) / 4
    return 2 * size**3 / seconds / 1e12


def _measure_disk_in_child(path: str, aio: dict[str, Any] | None) -> tuple[float, float]:
    """`measure_disk` in a fresh Python. Inside a notebook kernel DeepSpeed's async_io op can refuse to load:
    its compatibility check (`AsyncIOBuilder.is_compatible`) redirects stderr's file descriptor while it compiles a
    test program and answers False on any exception; a child process has clean stdio (see
    `helpers.async_io_available`)."""
    import subprocess
    import sys

    code = ("import json, sys; from helpers.limits import measure_disk; "
            f"print('DISK ' + json.dumps(measure_disk({path!r}, aio={aio or {}!r})))")
    root = str(Path(__file__).resolve().parent.parent)  # the course: the child imports helpers from it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DISK ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(tail)
    read, write = json.loads(lines[-1][5:])
    return read, write


def _cache_file(label: str, disk_path: str | None) -> Path:
    device = ""
    if disk_path:
        try:
            device = f"-dev{os.stat(Path(disk_path) if Path(disk_path).exists() else Path(disk_path).parent).st_dev}"
        except OSError:
            device = ""
    safe = "".join(c if c.isalnum() else "_" for c in label)[:80]
    return CACHE_DIR / f"limits-{safe}{device}.json"


@dataclass(frozen=True)
class ExtraProbes:
    """What benchmarks/offload_speed.py measures beyond a notebook's limits (`measure_limits(extra=...)`): on a GPU,
    `grad_round_trip` ZeRO-3's gradient round trip through the host, its fp16 overflow check and the fp32 -> fp16
    weight copy; `blocks` [(hidden, heads, seq_len, micro_batch)] the compute rate of GPT-2 blocks of those shapes;
    `zero3_layers` ZeRO-3's cost per micro-batch at those depths (with `zero3_config`, a zero_optimization section);
    `adam_params` sizes the CPU Adam measurement (the config's sub_group_size: the tensor DeepSpeed steps at a
    time)."""

    grad_round_trip: bool = False
    blocks: tuple[tuple[int, int, int, int], ...] = ()
    zero3_layers: tuple[int, ...] = ()
    zero3_config: dict[str, Any] | None = None
    adam_params: int = 16_000_000


def measure_limits(nvme_path: str | os.PathLike[str] | None = None, *, runtime: Any = None,
                   aio: dict[str, Any] | None = None, refresh: bool = False, cache: bool = True,
                   cpu_adam: bool = True, extra: ExtraProbes | None = None) -> RuntimeLimits:
    """Measure (or read from the cache) this runtime's limits; the disk only when `nvme_path` is given (notebook 02).

    Each measurement takes a few seconds (the first CPU Adam measurement also builds DeepSpeed's cpu_adam op).
    A measurement that cannot run here is left None with a note saying why. `aio`: the config's aio section the disk
    is measured with; `extra`: the benchmark's further measurements (`ExtraProbes`).
    """
    extra = extra or ExtraProbes()
    from helpers.hardware import detect_runtime, usable_cpus

    runtime = runtime or detect_runtime()
    disk = os.path.expanduser(os.fspath(nvme_path)) if nvme_path else None
    path = _cache_file(runtime.label, disk)
    if cache and not refresh and path.exists():
        try:
            got = RuntimeLimits.from_dict(json.loads(path.read_text()))
            if got.runtime == runtime.label and got.disk_path == disk and (got.aio == {**AIO_DEFAULTS, **(aio or {})}
                                                                            or not disk):
                return got
        except (OSError, ValueError, TypeError):
            pass
    limits = RuntimeLimits(runtime=runtime.label, cpus=usable_cpus(), has_gpu=runtime.has_gpu, disk_path=disk,
                           aio={**AIO_DEFAULTS, **(aio or {})} if disk else {})

    def run(name: str, fn: Callable[[], None]) -> None:
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a limit that cannot be measured here is a note, not a failure
            limits.notes.append(f"{name} not measured: {str(exc).splitlines()[0][:200]}")
        limits.seconds[name] = round(time.perf_counter() - t, 2)

    if disk:
        def disk_fn() -> None:
            limits.disk_read_gbps, limits.disk_write_gbps = (round(v, 3) for v in _measure_disk_in_child(disk, aio))
        run("disk", disk_fn)
    if runtime.has_gpu:
        def pcie_fn() -> None:
            for k, v in measure_pcie().items():
                setattr(limits, k, round(v, 2))
        run("pcie", pcie_fn)
    else:
        limits.notes.append("no GPU: no PCIe copies to measure")
    if cpu_adam:
        def adam_fn() -> None:
            limits.cpu_adam_params_per_s = round(measure_cpu_adam(extra.adam_params), -3)
            limits.cpu_adam_group_params = extra.adam_params
        run("cpu_adam", adam_fn)

    def matmul_fn() -> None:
        dtype = runtime.precision if runtime.has_gpu else "fp32"
        limits.matmul_dtype = dtype if runtime.has_gpu else "fp32 (CPU)"
        limits.matmul_tflops = round(measure_matmul(dtype), 3)
    run("matmul", matmul_fn)
    _measure_extras(limits, extra, runtime, run)
    if cache:
        from helpers.atomic import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(limits.as_dict(), indent=1)
        write_atomically(path, lambda tmp: tmp.write_text(text))
    return limits


def _measure_extras(limits: RuntimeLimits, extra: ExtraProbes, runtime: Any,
                    run: Callable[[str, Callable[[], None]], None]) -> None:
    """`measure_limits`' benchmark-only measurements (`ExtraProbes`), each through `run` (timed; a failure a note)."""
    if runtime.has_gpu and extra.grad_round_trip:
        def round_trip_fn() -> None:
            limits.grad_round_trip_pinned_gbps = round(measure_grad_round_trip(pinned=True), 2)
            limits.grad_round_trip_pageable_gbps = round(measure_grad_round_trip(pinned=False), 2)
        run("grad_round_trip", round_trip_fn)

        def overflow_fn() -> None:
            limits.overflow_check_per_s = round(measure_overflow_check(), -6)
            limits.overflow_check_chunked_per_s = round(measure_overflow_check(chunked=True), -6)
        run("overflow_check", overflow_fn)

        def weights_fn() -> None:
            limits.weights_to_gpu_pinned_gbps = round(measure_weights_to_gpu(pinned=True), 2)
            limits.weights_to_gpu_pageable_gbps = round(measure_weights_to_gpu(pinned=False), 2)
        run("weights_to_gpu", weights_fn)
    for layers in extra.zero3_layers:
        def zero3_fn(n: int = layers) -> None:
            limits.zero3_micro_batch_s[f"{n} layers"] = round(measure_zero3_micro_batch(n, zero=extra.zero3_config),
                                                              4)
        run(f"zero3 {layers} layers", zero3_fn)
    for hidden, heads, seq_len, micro_batch in extra.blocks if runtime.has_gpu else ():
        def block_fn(h: int = hidden, n: int = heads, s: int = seq_len, b: int = micro_batch) -> None:
            limits.block_tflops[block_key(h, s, b)] = round(measure_block_compute(h, n, s, b,
                                                                                  dtype=runtime.precision), 2)
        run(f"block {block_key(hidden, seq_len, micro_batch)}", block_fn)


def _main(argv: list[str] | None = None) -> int:
    """`python -c "from helpers.limits import _main; _main()" [--nvme PATH] [--out FILE] [--refresh]`: measure and
    print (benchmarks/offload_speed.py runs it inside a Colab enclosure, so that CPU Adam gets the enclosure's CPUs)."""
    import argparse

    p = argparse.ArgumentParser(description="Measure this runtime's disk, PCIe, CPU Adam and matmul rates.")
    p.add_argument("--nvme", default=None, help="the NVMe folder to measure (none: no disk measurement)")
    p.add_argument("--aio", default="{}", help="the config's aio section, as JSON")
    p.add_argument("--out", default=None, help="also write the limits to this JSON file")
    p.add_argument("--refresh", action="store_true", help="measure again even if cached")
    p.add_argument("--grad-round-trip", action="store_true", help="also ZeRO-3's gradient round trip via the host")
    p.add_argument("--blocks", default="[]", help="GPT-2 block shapes to time, JSON [[hidden, heads, seq, batch]]")
    p.add_argument("--zero3-layers", type=int, nargs="*", default=[], help="ZeRO-3's cost per micro-batch at these depths")
    p.add_argument("--adam-params", type=int, default=16_000_000, help="CPU Adam timed on this many parameters")
    p.add_argument("--zero3-config", default="{}", help="the zero_optimization section for --zero3-layers, as JSON")
    args = p.parse_args(argv)
    extra = ExtraProbes(grad_round_trip=args.grad_round_trip, blocks=tuple(tuple(b) for b in json.loads(args.blocks)),
                        zero3_layers=tuple(args.zero3_layers), zero3_config=json.loads(args.zero3_config),
                        adam_params=args.adam_params)
    limits = measure_limits(args.nvme, aio=json.loads(args.aio), refresh=args.refresh, extra=extra)
    print(limits.table())
    if args.out:
        Path(args.out).write_text(json.dumps(limits.as_dict(), indent=1))
    return 0

