"""DeepSpeed inside a notebook: one process, no launcher; clean teardown between runs.

Notebook 00 shows these steps literally; later notebooks call them. DeepSpeed normally gets
MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE from its launcher; without them it
falls back to MPI discovery and fails (``ModuleNotFoundError: mpi4py``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["clean_slate", "free_port", "gpu_allocated_bytes", "mmap_large_allocations",
           "release_host_memory", "quiet_deepspeed", "require", "reset_peak_stats", "teardown",
           "hf_deepspeed_state", "reset_hf_deepspeed_state"]

DIST_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
# A world of one process needs one NCCL channel: NCCL's default (one per SM group) cost 0.74 GiB of GPU memory outside
# PyTorch's allocator on an H200, DeepSpeed's whole addition 0.990 -> 0.252 GiB with the one (reports/cuda_context.md,
# 2026-12-06); a one-rank all-reduce moves nothing between GPUs, so speed does not change. setup_single_process sets it
# unless the learner did (NCCL_CHANNELS_SET_BY_COURSE records that), and child_env takes it out again for launched
# ranks, which talk over several channels.
ONE_RANK_NCCL = {"NCCL_MAX_NCHANNELS": "1"}
NCCL_CHANNELS_SET_BY_COURSE = "DS_COURSE_SET_NCCL_MAX_NCHANNELS"


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) for a launched child: without the five distributed variables of this process's world
    of one (they would clash with the launcher's) and without the one-rank NCCL setting the course made (not one the
    learner made)."""
    env = dict(os.environ if env is None else env)
    drop = set(DIST_ENV_VARS)
    if env.pop(NCCL_CHANNELS_SET_BY_COURSE, None):
        drop |= set(ONE_RANK_NCCL)
    return {k: v for k, v in env.items() if k not in drop}


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (notebook 00)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def quiet_deepspeed(level: int = 30) -> Iterator[None]:
    """Lower DeepSpeed's logger to WARNING inside the block (MoE logs a line per layer, `initialize` and
    checkpointing.configure their settings: notebooks 03, 06)."""
    from deepspeed.utils import logger

    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


def setup_single_process(port: int | None = None) -> dict[str, str]:
    """Set the five distributed variables for a world of one process, on a free port, and one NCCL channel unless
    NCCL_MAX_NCHANNELS is already set (ONE_RANK_NCCL) (notebook 02).

    Once torch.distributed is initialised (a second run in the same kernel) the port is left as it
    is: DeepSpeed reuses the existing process group.
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    for key, value in ONE_RANK_NCCL.items():  # one NCCL channel for one rank (ONE_RANK_NCCL says why)
        if key not in os.environ:
            os.environ[key] = value
            os.environ[NCCL_CHANNELS_SET_BY_COURSE] = "1"
    if port is not None or not initialised or not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(port or free_port())
    return {k: os.environ[k] for k in DIST_ENV_VARS}


def gpu_allocated_bytes() -> int:
    """Bytes the CUDA caching allocator has handed out now (0 on CPU) (notebook 00)."""
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
    """Forget earlier peaks so the next measured run starts from the current allocation (notebook 00), and the
    allocator's retry count with them (`_forget_allocator_retries`)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        warm_up_cuda()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        _forget_allocator_retries()


def _forget_allocator_retries() -> None:
    """Zero PyTorch's accumulated allocator counters (`num_alloc_retries` among them) before the next engine.

    DeepSpeed 0.19.8's ZeRO-3 step warns of "allocator cache flushes" when `memory_stats()["num_alloc_retries"]`
    exceeds a count each new engine starts at 0 (stage3.py: `n_caching_allocator_flushes = 0`), while PyTorch counts
    retries over the whole process. One earlier out-of-memory error in the kernel (notebook 02's wall: the allocator
    frees its cache and retries before it raises) made every later ZeRO-3 engine warn once at its first step, under
    no memory pressure (notebook 02's checkpoint section printed it three times for a 124M model)."""
    import torch

    torch.cuda.reset_accumulated_memory_stats()


def teardown(namespace: dict[str, Any], *names: str) -> int:
    """Destroy and forget the objects that `names` point to in `namespace`, then free their memory (notebook 00).

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
        _forget_allocator_retries()  # the next engine counts its own
    return gpu_allocated_bytes()


def destroy_engine(engine: Any) -> None:
    """`engine.destroy()`, then free what ZeRO-3 keeps of it for the life of the process: the NVMe parameter swap
    buffers (`release_nvme_swappers`), the module-level references (`release_zero3_globals`), DeepSpeed's hooks
    left on the model by an engine whose construction was interrupted (`remove_deepspeed_hooks`) and its NVMe swap
    files (`remove_swap_files`: DeepSpeed never deletes them, and names them by parameter ids that grow with every
    model built in the process, so each run added its own set to the folder)."""
    module = getattr(engine, "module", None)
    swap_files = nvme_swap_paths(engine)  # read before destroy() (the optimizer's swapper lives on the optimizer)
    engine.destroy()
    release_nvme_swappers(module)
    release_zero3_globals(module)
    remove_deepspeed_hooks(module)
    remove_swap_files(swap_files)


def _from_deepspeed(hook: Any) -> bool:
    """True for a hook function (or bound method, or partial) that DeepSpeed's code made."""
    fn = getattr(hook, "func", hook)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # bound method
    return str(getattr(fn, "__module__", "") or "").startswith("deepspeed")


def remove_deepspeed_hooks(module: Any = None) -> int:
    """Take every hook DeepSpeed registered off `module`, its sub-modules and its parameters; returns how many.

    `engine.destroy()` removes the hooks through the handles the engine and its optimizer kept. An interrupted
    `deepspeed.initialize` (a learner pressing stop in the ZeRO-3 optimizer's constructor) leaves hooks whose handles
    were never stored: the half-built optimizer is then held by each parameter's gradient hooks, and the engine by
    the module's forward hooks, through references the garbage collector cannot see through (DeepSpeed 0.19.8:
    `create_reduce_and_remove_grad_hooks`). A destroyed engine's model has no use for them; hooks of your own stay.
    """
    if module is None or not callable(getattr(module, "modules", None)):
        return 0
    module_hooks = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
    param_hooks = ("_post_accumulate_grad_hooks", "_backward_hooks")
    owners = [(sub, module_hooks) for sub in module.modules()] + [(p, param_hooks) for p in module.parameters()]
    removed = 0
    for owner, attrs in owners:
        for hooks in (getattr(owner, attr, None) for attr in attrs):
            if isinstance(hooks, dict):
                for key in [k for k, fn in hooks.items() if _from_deepspeed(fn)]:
                    del hooks[key]
                    removed += 1
    return removed


def release_nvme_swappers(module: Any = None) -> int:
    """Free the page-locked swap buffers of a destroyed ZeRO-3 model's NVMe parameter swapper (DeepSpeed 0.19.8).

    With `offload_param.device = "nvme"`, zero.Init gives every parameter an `nvme_swapper`
    (`AsyncPartitionedParameterSwapper`) whose `buffers` (buffer_count x buffer_size elements, 2 bytes each in
    fp16/bf16) and `partitioned_swap_buffer` (made when the optimizer is built) come from the aio handle's
    `new_cpu_locked_tensor`. That memory belongs to DeepNVMe's process-wide page-locked allocator (a C++ singleton
    never destroyed), not to the tensors: dropping the swapper frees nothing, and unlike the optimizer's
    SwapBufferManager (which frees its buffers in `__del__`) the parameter swapper has no cleanup, and
    `engine.destroy()` does not touch it. So each run kept buffer_count x buffer_size x 2 bytes plus the largest
    optimizer sub-group x 2 bytes with no Python object left to free them (GPT-2 124M, 8 x 40.5M: 0.85 GB). Only
    this model's swappers are freed (each zero.Init makes its own, so other engines keep theirs); its partitions
    are pointed at DeepSpeed's invalid buffer first, so nothing reads freed memory. No-op without NVMe parameter
    offload. Returns the bytes freed.
    """
    import torch

    swappers: dict[int, tuple[Any, list[Any]]] = {}
    for p in module.parameters() if callable(getattr(module, "parameters", None)) else ():
        swapper = getattr(p, "nvme_swapper", None)
        if swapper is not None:
            swappers.setdefault(id(swapper), (swapper, []))[1].append(p)
    freed = 0
    for swapper, params in swappers.values():
        swapper.synchronize_reads()  # no aio read or write may still target the buffers
        swapper.synchronize_writes()
        swapper.remove_partition_and_release_buffers(params)  # ds_tensor -> invalid_buffer, not into `buffers`
        for attr, handle in (("buffers", swapper.aio_read_handle),
                             ("partitioned_swap_buffer", swapper.aio_write_handle)):
            buf = getattr(swapper, attr, None)
            if not isinstance(buf, torch.Tensor) or buf.numel() == 0:
                continue
            if buf.device.type != "cpu":  # GPUDirect Storage: a torch tensor registered with cuFile
                if callable(getattr(handle, "unpin_device_tensor", None)):
                    handle.unpin_device_tensor(buf)
            elif handle.free_cpu_locked_tensor(buf):
                freed += buf.nbytes
        swapper.buffers = torch.empty(0, dtype=swapper.dtype)
        swapper.partitioned_swap_buffer = swapper.partitioned_swap_pool = None
        # a later swap-in fails with DeepSpeed's own "not enough swap buffers" rather than writing to freed memory
        swapper.available_buffer_ids, swapper.reserved_buffer_ids = [], []
    return freed


# DeepSpeed 0.19.8 (runtime/swap_tensor): ZeRO-3 writes every swap file under <nvme_path>/zero_stage_3/:
#   <dtype>params/rank<r>/<ds_id>_param.tensor.swp        parameters (AsyncPartitionedParameterSwapper, one per
#                                                          zero.Init; it empties its rank folder when it is made)
#   optimizer/rank<r>/<first>_<last>.tensor.swp            fp32 master weights of one sub-group (OptimizerSwapper)
#   optimizer/rank<r>/<state>-<first>_<last>.tensor.swp    its Adam states (exp_avg-..., exp_avg_sq-...)
#   optimizer/rank<r>/<first>_<last>_gradient_<offset>_<length>.tensor.swp   gradients swapped out mid-step
# <first>/<last> are parameter ids (`ds_id`, a process-wide counter: a second model gets new ones, hence new names).
SWAP_ROOT = "zero_stage_3"
SWAP_SUFFIX = ".tensor.swp"


def nvme_swap_paths(engine: Any = None, module: Any = None) -> list[str]:
    """The NVMe swap files DeepSpeed made for one engine (its optimizer's swapper) and one model (the parameter
    swappers its zero.Init made; `module` defaults to the engine's). Empty without NVMe offload."""
    paths: list[str] = []
    swapper = getattr(getattr(engine, "optimizer", None), "optimizer_swapper", None)
    for info in list((getattr(swapper, "swap_params_info", None) or {}).values()):
        paths += [t.swap_path for t in getattr(info, "tensors", ()) if getattr(t, "swap_path", None)]
        paths += [g.path for g in (getattr(info, "swapped_gradients", None) or {}).values() if getattr(g, "path", None)]
    module = module if module is not None else getattr(engine, "module", None)
    seen: set[int] = set()
    for p in module.parameters() if callable(getattr(module, "parameters", None)) else ():
        param_swapper = getattr(p, "nvme_swapper", None)
        if param_swapper is not None and id(param_swapper) not in seen:
            seen.add(id(param_swapper))
            paths += list((getattr(param_swapper, "id_to_path", None) or {}).values())
    return paths


def remove_swap_files(paths: Any) -> int:
    """Delete DeepSpeed swap files (`*.tensor.swp` only; other names are left alone); returns the bytes freed."""
    freed = 0
    for path in paths:
        if not str(path).endswith(SWAP_SUFFIX):
            continue
        try:
            freed += os.stat(path).st_blocks * 512
            os.unlink(path)
        except OSError:
            pass
    return freed


def swap_leftovers(nvme_path: str | os.PathLike[str] | None) -> list[str]:
    """DeepSpeed swap files under `nvme_path` that no live engine of this process uses: what an earlier run left
    (a kernel that died or was restarted mid-run, a copy of the course before issue 23), taking disk for nothing."""
    if not nvme_path or not os.path.isdir(os.path.join(nvme_path, SWAP_ROOT)):
        return []
    in_use = {os.path.realpath(p) for e in live_engines() for p in nvme_swap_paths(e)}
    found = []
    for root, _dirs, files in os.walk(os.path.join(nvme_path, SWAP_ROOT)):
        found += [os.path.join(root, f) for f in files
                  if f.endswith(SWAP_SUFFIX) and os.path.realpath(os.path.join(root, f)) not in in_use]
    return sorted(found)


def remove_nvme_leftovers(nvme_path: str | os.PathLike[str]) -> int:
    """Delete the swap files earlier runs left in the NVMe folder `nvme_path` (`swap_leftovers`: a live engine's
    files are kept); returns the bytes freed and prints one line. Notebook 02, or when a run is refused for space."""
    freed = remove_swap_files(swap_leftovers(nvme_path))
    print(f"removed {freed / 1e6:.1f} MB of DeepSpeed swap files left by earlier runs in "
          f"{os.path.join(nvme_path, SWAP_ROOT)}")
    return freed


# Two kernels of one checkout (two browser tabs, a notebook and a script) share the course's NVMe folder: each swapped
# into <folder>/zero_stage_3/.../rank0 under the same names, DeepSpeed's parameter swapper empties its rank folder
# when made, and each run removed the files new since it started: they deleted each other's (issue 41 item 7). Each
# process now swaps under <folder>/pid-<its pid>/ (its child processes inside it too).
_PROCESS_NVME_PREFIX = "pid-"
_OWN_NVME_FOLDERS: set[str] = set()


def _remove_folder(path: str | os.PathLike[str]) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _own_nvme_folder(base: str | os.PathLike[str], *, make: bool = True) -> Path:
    """This process's NVMe folder under the shared one `base`: <base>/pid-<pid> (issue 41 item 7).

    With `make`: created; the pid-<n> folders of processes that are gone (a kernel killed or restarted mid-run) are
    removed with what they hold; and this one is removed when the process exits. The pid is this machine's: a
    checkout shared between machines or containers with their own pid numbers would need a folder each."""
    import psutil

    base = Path(os.path.expanduser(os.fspath(base)))
    own = base / f"{_PROCESS_NVME_PREFIX}{os.getpid()}"
    if not make:
        return own
    own.mkdir(parents=True, exist_ok=True)
    for other in base.glob(f"{_PROCESS_NVME_PREFIX}*"):
        pid = other.name[len(_PROCESS_NVME_PREFIX):]
        if other != own and other.is_dir() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            _remove_folder(other)
    if str(own) not in _OWN_NVME_FOLDERS:
        import atexit

        _OWN_NVME_FOLDERS.add(str(own))
        atexit.register(_remove_folder, own)
    return own


def release_zero3_globals(module: Any = None) -> None:
    """Drop what DeepSpeed's ZeRO-3 keeps of a destroyed engine in process-wide state (DeepSpeed 0.19.8).

    Two globals keep the model, its hooks, the engine, the optimizer and every offloaded buffer alive for the life
    of the process (2 GB per run of GPT-2 124M with CPU offload, 10 GB for 774M): the model is pushed onto
    `parameter_offload.FWD_MODULE_STACK` when the engine is built and never taken off (and each sub-module whose
    forward pass was interrupted stays on it too: an interrupted cell), and
    `PartitionedParameterCoordinator.__params_to_release` is an `lru_cache` on a method, whose class-wide cache
    keys hold the coordinator and the sub-modules. Clearing that cache only costs other live engines a recount.
    """
    import sys

    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    stack = getattr(offload, "FWD_MODULE_STACK", None)
    if module is not None and isinstance(stack, list):
        # the model itself, and the sub-modules a forward pass pushed and an interrupt kept from popping
        mine = {id(m) for m in module.modules()} if callable(getattr(module, "modules", None)) else {id(module)}
        stack[:] = [m for m in stack if id(m) not in mine]
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


def remove_stale_build_lock(folder: str | os.PathLike[str], idle_s: float = 600.0) -> bool:
    """Remove torch's build lock in an op's build folder when it was left by a killed build; True if removed.

    torch.utils.cpp_extension guards a build with a `lock` file (FileBaton) that only the building process removes.
    A build killed outright (a kernel restarted or a runner's time limit mid-compile) leaves it, and every later load
    of that op, cached or not, waits for it forever without a word (a CI run here sat 18 min on one). The lock is
    taken as stale when nothing in the folder changed for `idle_s` (a compile writes its objects and logs there).
    """
    import time

    folder = Path(folder)
    lock = folder / "lock"
    try:
        newest = max(f.stat().st_mtime for f in folder.iterdir())
        if not lock.exists() or time.time() - newest < idle_s:
            return False
        lock.unlink()
    except (OSError, ValueError):
        return False
    print(f"removed a stale build lock left by a killed build of DeepSpeed's {folder.name} op ({lock})", flush=True)
    return True


# ops compiled in this process by `announce_op_builds`'s wrapper (a fresh child's record: helpers.fresh_process)
COMPILED_OPS: list[str] = []
ON_OP_BUILD: Callable[[str], None] | None = None  # called with the op's name before it compiles
# the course's names for DeepSpeed's JIT ops -> their builder classes (deepspeed.ops.op_builder)
OP_BUILDERS: dict[str, str] = {"cpu_adam": "CPUAdamBuilder", "async_io": "AsyncIOBuilder",
                               "fused_adam": "FusedAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder",
                               "pin_memory": "PinMemoryBuilder"}
# On a CPU-only machine DeepSpeed also compiles its shared-memory all-reduce (every engine) and its pinned-memory op
# (NVMe swapping) on first use: `build_ops` builds them with the others there (in a 3 GB group g++ was OOM-killed).
CPU_COMPANION_OPS = ("deepspeed_shm_comm", "pin_memory")
_BUILD_CODE = """
import sys, time
from deepspeed.accelerator import get_accelerator
for cls in sys.argv[1:]:
    try:
        b = get_accelerator().create_op_builder(cls)
    except Exception:  # not an op of this accelerator
        b = None
    if b is None or not b.is_compatible(verbose=False):
        print("SKIP", cls, flush=True)
        continue
    t = time.perf_counter()
    b.load(verbose=False)
    print("BUILT", cls, round(time.perf_counter() - t, 1), flush=True)
"""


def _remove_stale_op_lock(name: str) -> None:
    """`remove_stale_build_lock` on op `name`'s folder in torch's extension cache, where there is one."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        remove_stale_build_lock(_get_build_directory(name, verbose=False))
    except (OSError, ImportError):
        pass


def _op_cached(name: str) -> bool:
    """True when torch's extension cache holds op `name`'s library compiled by this installation.

    A library that another checkout or virtual environment compiled into the same cache (`~/.cache/torch_extensions`
    is shared by every Python of one version on the machine) is not: its build.ninja names the other installation's
    torch and deepspeed, so the first process here that loads the op recompiles it, silently and wherever it runs
    (a CI run's 3 GB memory group OOM-killed that g++ 16 times). Such a cache counts as not built. So does a library
    older than its inputs (the op's sources named in build.ninja, torch's extension header): a venv made again at the
    same path leaves build.ninja naming this installation, but its freshly installed sources are newer, and torch's
    loader (ninja, by file times) recompiles (a fresh-clone run here compiled the ops inside notebook 02's 3 GB group)."""
    try:
        from importlib.util import find_spec

        from torch.utils.cpp_extension import _get_build_directory, include_paths

        folder = _get_build_directory(name, verbose=False)
        if not any(f.endswith(".so") for f in os.listdir(folder)):
            return False
        ninja = Path(folder, "build.ninja").read_text()
        deepspeed_dir = (find_spec("deepspeed").submodule_search_locations or [""])[0]  # type: ignore[union-attr]
        return include_paths()[0] in ninja and str(deepspeed_dir) in ninja and _built_after_its_inputs(folder, ninja)
    except (OSError, ImportError, AttributeError, IndexError):
        return False


def _built_after_its_inputs(folder: str, ninja: str) -> bool:
    """Whether the op library in `folder` is newer than every source its build.ninja (`ninja`) compiles and than
    torch's extension header: what ninja's file-time check needs for it to rebuild nothing."""
    import re

    from torch.utils.cpp_extension import include_paths

    library = max(Path(folder, f).stat().st_mtime for f in os.listdir(folder) if f.endswith(".so"))
    inputs = [Path(m) for m in re.findall(r"^build \S+\.o: \w+ (\S+)", ninja, flags=re.MULTILINE)]
    inputs.append(Path(include_paths()[0]) / "torch" / "extension.h")
    return all(library >= p.stat().st_mtime for p in inputs if p.exists())


def _build_results(lines: list[str]) -> dict[str, str]:
    """{op: "built in N s" | "not available here"} from the build child's "BUILT <Builder> <s>" / "SKIP <Builder>"
    lines; every other line (the compiler's, blank ones: a fresh-clone run crashed on one, 2026-12-07) is skipped."""
    by_class = {v: k for k, v in OP_BUILDERS.items()}
    out = {}
    for line in lines:
        word, *rest = line.split() or [""]
        if word == "BUILT" and len(rest) >= 2 and rest[0] in by_class:
            out[by_class[rest[0]]] = f"built in {float(rest[1]):.0f} s"
        elif word == "SKIP" and rest and rest[0] in by_class:
            out[by_class[rest[0]]] = "not available here"
    return out


def build_ops(*names: str, timeout_s: float = 1800.0) -> dict[str, str]:
    """Compile DeepSpeed's JIT ops `names` now, in a fresh Python, before any measured run (notebook 02).

    DeepSpeed compiles `cpu_adam` (CPU offload) and `async_io` (NVMe) with g++ the first time a process needs them:
    1-4 min on 2 CPU cores, and inside a measured child process the compiler's RAM is counted as the config's
    (issue 22: a config measured 4.87 GB against 0.84 GB once the op was cached). Built once here, every later process
    loads them from torch's extension cache. Returns {name: "cached" | "built in N s" | "not available here"};
    prints one line per op it builds, with a progress bar from the first second.
    """
    import subprocess
    import sys
    import threading
    import time

    unknown = [n for n in names if n not in OP_BUILDERS]
    if unknown:
        raise ValueError(f"unknown DeepSpeed op {unknown[0]!r}. Fix: one of {', '.join(OP_BUILDERS)}.")
    import torch

    if names and not torch.cuda.is_available():
        names = tuple(names) + tuple(n for n in CPU_COMPANION_OPS if n not in names)
    out = {n: "cached" for n in names if _op_cached(n)}
    todo = [n for n in names if n not in out]
    if not todo:
        return out
    from helpers.progress import progress_bar

    print(f"compiling DeepSpeed's {', '.join(todo)} op{'s' if len(todo) > 1 else ''} now, before the measured runs "
          "(first use on this runtime; 1-4 min each on 2 CPU cores, then cached)", flush=True)
    for name in todo:
        _remove_stale_op_lock(name)
    proc = subprocess.Popen([sys.executable, "-c", _BUILD_CODE, *(OP_BUILDERS[n] for n in todo)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    start = time.perf_counter()
    bar = progress_bar(total=len(todo), desc="compiling DeepSpeed ops")
    try:
        while proc.poll() is None:
            done = sum(line.startswith(("BUILT", "SKIP")) for line in lines)
            if done != bar.n:
                bar.update(done - bar.n)
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                break
            time.sleep(0.5)
    except BaseException:  # an interrupt: no compiler left running (its lock is removed on the next call)
        proc.kill()
        proc.wait()
        bar.close()
        raise
    proc.wait()
    reader.join(timeout=5)
    done = sum(line.startswith(("BUILT", "SKIP")) for line in lines)
    bar.update(done - bar.n)
    bar.close()
    out.update(_build_results(lines))
    missing = [n for n in todo if n not in out]
    if missing:
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"compiling DeepSpeed's {', '.join(missing)} failed (exit code {proc.returncode}):\n{tail}\n"
                           "Fix: run `ds_report` (notebook 00) to see which op cannot build here; a CUDA mismatch "
                           "between torch and the system's nvcc is the usual cause.")
    print("; ".join(f"{n}: {v}" for n, v in out.items()), flush=True)
    return out


def announce_op_builds() -> bool:
    """Print one line before DeepSpeed compiles a C++ op on first use, and one after (every notebook's bootstrap).

    DeepSpeed builds cpu_adam, async_io and others with g++ the first time a process needs them: 40-230 s each on
    2 cores, in silence (a cell of notebook 02 spent 486 s without a word). Wraps `OpBuilder.jit_load`, which also
    loads an op already in torch's extension cache (then it says nothing). Returns False if DeepSpeed's builder
    is not where 0.19.8 has it.
    """
    import time

    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:
        return False
    if getattr(OpBuilder.jit_load, "_announces", False):
        return True
    jit_load = OpBuilder.jit_load

    def announced_jit_load(self: Any, verbose: bool = True) -> Any:
        name = getattr(self, "name", "?")
        if name in OpBuilder._loaded_ops:
            return jit_load(self, verbose)
        _remove_stale_op_lock(name)
        if _op_cached(name):
            return jit_load(self, verbose)
        print(f"compiling DeepSpeed's {name} op (first use on this machine; 1-4 min on 2 CPU cores, then cached) ...",
              flush=True)
        COMPILED_OPS.append(name)
        if ON_OP_BUILD is not None:
            ON_OP_BUILD(name)
        start = time.perf_counter()
        module = announced_jit_load._original(self, verbose)  # type: ignore[attr-defined]
        print(f"compiled {name} in {time.perf_counter() - start:.0f} s", flush=True)
        return module

    announced_jit_load._announces = True  # type: ignore[attr-defined]
    announced_jit_load._original = jit_load  # type: ignore[attr-defined]
    OpBuilder.jit_load = announced_jit_load
    return True


def warm_up_deepspeed() -> float:
    """Import now what the first `deepspeed.initialize` imports, with a throwaway engine; returns the seconds it took.

    The first engine of a process pulls in torch.compile's machinery (torch._dynamo, torch._inductor, sympy, networkx:
    ~1500 modules, seconds on a small CPU). Interrupting a training cell during that import leaves modules half
    imported (``module 'torch._dynamo.convert_frame' has no attribute 'convert_frame'`` until the kernel restarts);
    done in the imports cell, a later interrupt cannot. Every notebook's imports cell calls it.
    """
    import contextlib
    import io
    import time

    import deepspeed
    import torch

    start = time.perf_counter()
    setup_single_process()
    model = torch.nn.Linear(8, 8)
    config = {"train_batch_size": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        loss = engine(torch.ones(1, 8, device=engine.device)).sum()
        engine.backward(loss)
        engine.step()
    destroy_engine(engine)
    del engine, model, loss, _
    release_host_memory()
    return time.perf_counter() - start


def live_engines() -> list[Any]:
    """Every DeepSpeed engine object still alive in this process (after a garbage collection)."""
    import sys

    if "deepspeed" not in sys.modules:
        return []
    gc.collect()
    return [o for o in gc.get_objects() if type(o).__name__.endswith("Engine")
            and type(o).__module__.startswith("deepspeed.") and callable(getattr(o, "destroy", None))]


def clean_slate(namespace: dict[str, Any], *names: str, hf: bool = False, needs: tuple[str, ...] = (),
                where: str = "the cells above", single_process: bool = False) -> list[str]:
    """Start a training cell from nothing, whatever ran (or was interrupted) before it; returns what it cleaned
    (notebook 00).

    From a notebook: ``helpers.clean_slate(globals(), "engine", "optimizer", "model", "losses")`` as the first line of
    a cell that trains. It forgets `names` (the cell's own results from an earlier run: a re-run never continues a
    half-trained model, and a later cell cannot read a stale result), drops the traceback of the last error (an
    interrupted cell's frames keep its engine and model alive, and their GPU memory with them), destroys every
    DeepSpeed engine that nothing in `namespace` uses any more, clears transformers' global ZeRO-3 config, and gives
    the memory back (peak counters reset); `hf=True` also resets transformers' and Accelerate's global state (notebook
    04). `needs`: names the cell reads, checked first (`require`, naming `where` they come from) so nothing is dropped
    when the cell cannot run; `single_process=True` also sets the five distributed variables for a world of one
    process (`setup_single_process`, written out in notebook 00). Prints one line when it found something to clean.
    """
    import sys

    if needs:
        require(namespace, *needs, where=where)
    if single_process:
        setup_single_process()
    cleaned: list[str] = []
    if _drop_last_traceback():
        cleaned.append("the last error's traceback")
    forgotten = [n for n in names if n in namespace]
    if forgotten:
        teardown(namespace, *forgotten)
        cleaned.append("the names " + ", ".join(forgotten))
    in_use = {id(v) for v in namespace.values()}
    orphans = [e for e in live_engines() if id(e) not in in_use]
    n_orphans = len(orphans)
    while orphans:
        destroy_engine(orphans.pop())
    if n_orphans:
        cleaned.append(f"{n_orphans} DeepSpeed engine(s) no variable names "
                       "(from an earlier cell or an interrupted run)")
    hf_integration = sys.modules.get("transformers.integrations.deepspeed")
    ref = getattr(hf_integration, "_hf_deepspeed_config_weak_ref", None)
    if ref is not None and ref() is not None and id(ref()) not in in_use:
        hf_integration.unset_hf_deepspeed_config()
        cleaned.append("transformers' ZeRO-3 config")
    if hf:

        before = reset_hf_deepspeed_state()
        if any(v not in ("none", "unset") for v in before.values()):
            cleaned.append("Accelerate's and transformers' global state")
    rss = release_host_memory()
    reset_peak_stats()
    if cleaned:
        print(f"clean slate: dropped {'; '.join(cleaned)} (this kernel now holds {rss / 1e9:.2f} GB of RAM)")
    return cleaned


def _drop_last_traceback() -> bool:
    """Forget the last error's traceback wherever Python and IPython keep it; True if there was one.

    Its frames hold the locals of every function the error passed through: after an interrupted training cell,
    the engine, the model and the optimizer. Python keeps it in sys.last_*, IPython's traceback printer in its `tb`,
    and the last execution result in `error_in_exec`.
    """
    import sys

    found = False
    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, attr, None) is not None:
            setattr(sys, attr, None)
            found = True
    shell = None
    if "IPython" in sys.modules:
        shell = sys.modules["IPython"].get_ipython()
    if shell is not None:
        for printer in (getattr(shell, "InteractiveTB", None), getattr(shell, "SyntaxTB", None)):
            if getattr(printer, "tb", None) is not None:
                printer.tb = None
                found = True
        last = getattr(shell, "last_execution_result", None)
        if getattr(last, "error_in_exec", None) is not None:
            last.error_in_exec = None
            found = True
    return found


def require(namespace: dict[str, Any], *names: str, where: str) -> None:
    """Raise NameError naming the cell to run first when one of `names` is missing (notebooks 00-05)."""
    missing = [n for n in names if n not in namespace]
    if missing:
        raise NameError(f"{', '.join(missing)} not defined: this cell reads what {where} made. Fix: run {where} "
                        "first (it builds everything it needs).")


def hf_deepspeed_state() -> dict[str, str]:
    """What global DeepSpeed state transformers and Accelerate hold right now (notebook 04)."""
    from accelerate.state import AcceleratorState, PartialState
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    if deepspeed_config() is None:
        hf = "none"
    else:
        hf = "ZeRO-3: from_pretrained builds models partitioned" if is_deepspeed_zero3_enabled() else "set (not ZeRO-3)"
    acc = "none"
    if AcceleratorState._shared_state:
        acc = str(AcceleratorState._shared_state.get("distributed_type", "set"))
    elif PartialState._shared_state:
        acc = "PartialState only"
    return {"transformers HfDeepSpeedConfig": hf, "Accelerate state": acc,
            "ACCELERATE_USE_DEEPSPEED": os.environ.get("ACCELERATE_USE_DEEPSPEED", "unset")}


def reset_hf_deepspeed_state() -> dict[str, str]:
    """Forget transformers' global DeepSpeed config and Accelerate's state; returns what was there before (notebook 04).

    Without it a ZeRO-3 run leaves later models built partitioned, and a second Accelerator with a
    deepspeed_plugin is refused ("You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`").
    The torch.distributed process group stays (DeepSpeed reuses it).
    """
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    before = hf_deepspeed_state()
    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    return before
