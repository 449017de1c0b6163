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


def reset_peak_stats() -> None:
    """Forget earlier peaks so the next measured run starts from the current allocation."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def teardown(*objects: Any, namespace: dict[str, Any] | None = None, names: tuple[str, ...] = ()) -> int:
    """Destroy DeepSpeed engines among `objects`, drop `names` from `namespace`, free memory.

    Pass the engine, optimizer, model ... and, from a notebook, ``namespace=globals()`` with the
    variable names that still point at them (a reference left in a global keeps GPU memory alive).
    Returns the CUDA bytes still allocated afterwards, to compare with the baseline taken before.
    """
    import torch

    for obj in objects:
        destroy = getattr(obj, "destroy", None)
        if callable(destroy) and type(obj).__name__.endswith("Engine"):
            destroy()
        optimizer = getattr(obj, "optimizer", None)
        if optimizer is not None and hasattr(optimizer, "state"):
            try:
                optimizer.state.clear()
            except (AttributeError, TypeError):
                pass
    if namespace is not None:
        for name in names:
            namespace.pop(name, None)
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return gpu_allocated_bytes()
