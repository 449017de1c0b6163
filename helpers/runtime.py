"""DeepSpeed inside a notebook: one process, no launcher; clean teardown between runs.

Notebook 00 shows these steps literally; later notebooks call them. DeepSpeed normally gets
MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE from its launcher; without them it
falls back to MPI discovery and fails (``ModuleNotFoundError: mpi4py``).
"""
from __future__ import annotations

import gc
import os
import socket
from typing import Any

DIST_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup_single_process(port: int | None = None) -> dict[str, str]:
    """Set the five distributed variables for a world of one process, on a free port.

    Once torch.distributed is initialised (a second run in the same kernel) the port is left as it
    is: DeepSpeed reuses the existing process group.
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    if port is not None or not initialised or not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(port or free_port())
    return {k: os.environ[k] for k in DIST_ENV_VARS}


def gpu_allocated_bytes() -> int:
    """Bytes the CUDA caching allocator has handed out now (0 on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def warm_up_cuda() -> None:
    """Create this process's cuBLAS / cuBLASLt workspaces now (no-op on CPU).

    The first matrix multiply of each thread allocates them (32 MiB each on Hopper, a few MiB on a
    T4; backward runs in autograd's own thread) and PyTorch keeps them for the life of the process:
    taken before that, a baseline would wrongly show them as memory a teardown failed to give back.
    """
    import torch

    if not torch.cuda.is_available():
        return
    for dtype in (torch.float32, torch.float16):
        a = torch.ones(16, 16, device="cuda", dtype=dtype)
        w = torch.ones(16, 16, device="cuda", dtype=dtype, requires_grad=True)
        # forward in this thread (cuBLASLt with the bias epilogue, plain cuBLAS), backward in autograd's
        # device thread, which has cuBLAS handles and workspaces of its own
        (torch.nn.functional.linear(a, w, a[0]) + a @ w).float().sum().backward()
    torch.cuda.synchronize()


def reset_peak_stats() -> None:
    """Forget earlier peaks so the next measured run starts from the current allocation."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        warm_up_cuda()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def teardown(namespace: dict[str, Any], *names: str) -> int:
    """Destroy and forget the objects that `names` point to in `namespace`, then free their memory.

    From a notebook: ``helpers.teardown(globals(), "engine", "optimizer", "model")``. The objects are
    taken out of the namespace here rather than passed in, because an argument stays referenced by
    the caller until the call returns, which would keep their memory alive through the collection.
    Engines are destroyed (``engine.destroy()``), optimizer states cleared. Returns the CUDA bytes
    still allocated afterwards, to compare with the baseline taken before.
    """
    import torch

    for name in names:
        obj = namespace.pop(name, None)
        if obj is None:
            continue
        if callable(getattr(obj, "destroy", None)) and type(obj).__name__.endswith("Engine"):
            destroy_engine(obj)
        state = getattr(obj, "state", None)
        if isinstance(state, dict):
            state.clear()
        del obj
    release_host_memory()  # collects first
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return gpu_allocated_bytes()


def destroy_engine(engine: Any) -> None:
    """`engine.destroy()`, then drop what ZeRO-3 keeps of it in process-wide state (`release_zero3_globals`)."""
    module = getattr(engine, "module", None)
    engine.destroy()
    release_zero3_globals(module)


def release_zero3_globals(module: Any = None) -> None:
    """Drop what DeepSpeed's ZeRO-3 keeps of a destroyed engine in process-wide state (DeepSpeed 0.19.8).

    Two globals keep the model, its hooks, the engine, the optimizer and every offloaded buffer alive for the life
    of the process (2 GB per run of GPT-2 124M with CPU offload, 10 GB for 774M): the model is pushed onto
    `parameter_offload.FWD_MODULE_STACK` when the engine is built and never taken off, and
    `PartitionedParameterCoordinator.__params_to_release` is an `lru_cache` on a method, whose class-wide cache
    keys hold the coordinator and the sub-modules. Clearing that cache only costs other live engines a recount.
    """
    import sys

    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if module is not None and isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    cls = getattr(coordinator, "PartitionedParameterCoordinator", None)
    method = getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None)
    for fn in [method, *(c.cell_contents for c in (getattr(method, "__closure__", None) or ()))]:
        if callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()


def release_host_memory() -> int:
    """Give freed CPU RAM back to the OS; returns the process RSS after (notebook 02, called by `teardown`).

    Two caches keep RAM after a run's tensors are gone: torch's host allocator keeps freed *pinned* blocks
    (DeepSpeed's offload and swap buffers) for reuse, and glibc keeps freed heap blocks. With offload on a
    12.7 GB Colab VM, a second run in the same kernel would otherwise start gigabytes above the first.
    """
    import psutil
    import torch

    gc.collect()
    if torch.cuda.is_available():
        empty_host = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
            or getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    return int(psutil.Process().memory_info().rss)


def _glibc() -> Any:
    """The C library if it is glibc (has mallopt / malloc_trim), else None."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def mmap_large_allocations(threshold_bytes: int = 1 << 20) -> bool:
    """Make glibc serve allocations above `threshold_bytes` with mmap, so RAM freed later goes back at once (notebook 02).

    By default glibc raises this threshold up to 32 MiB as the program runs; per-layer tensors below it come
    from the heap and, once freed (e.g. the copies of the parameters DeepSpeed's ZeRO-3 offload replaces with
    its own flat buffer), stay in the process's RSS. Returns False where there is no glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_mmap_threshold = -3  # <malloc.h> M_MMAP_THRESHOLD
    return bool(libc.mallopt(m_mmap_threshold, int(threshold_bytes)))
