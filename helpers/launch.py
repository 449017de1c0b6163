"""Launching N processes: the commands of the `deepspeed` launcher, `torchrun` and `accelerate launch`, built one
way, and running them (notebooks 04 and 05, benchmarks/scale_out.py).

A launched program is a real file in notebooks/programs/ (the notebook shows its code and launches it). Every
command comes from `launch_argv`: a list for subprocess in the ``python -m`` form of each launcher, so the
launcher of this environment runs; `shown` turns it into what one types. `run_ranks` starts the ranks and reads
the rank<r>.json each wrote; `launch_commands` lists the same start for each launcher, to read or copy.
Several machines: `hostfile_text` / `parse_hostfile` and `multi_node_commands` (written, not run).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from helpers.runtime import child_env, free_port

__all__ = ["PROGRAMS", "launch_commands", "run_ranks", "function_source", "accelerate_config_yaml"]

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "notebooks" / "programs"  # the lesson programs the notebooks launch
# launcher -> its `python -m` module
LAUNCHERS: dict[str, str] = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run",
                             "accelerate": "accelerate.commands.launch"}
_TYPED = {"deepspeed": ["deepspeed"], "torchrun": ["torchrun"], "accelerate": ["accelerate", "launch"]}


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of processes must be a positive integer (got {n!r}). Fix: the GPUs on this "
                         "machine, e.g. torch.cuda.device_count().")


def launch_argv(program: str | Path, n: int, *, launcher: str = "deepspeed", device: str = "cuda",
                port: int | None = None, args: Sequence[str] = (),
                accelerate_config: str | Path | None = None) -> list[str]:
    """The command that starts `n` processes of `program` with `launcher`, as a list for subprocess.

    `deepspeed` counts GPUs with --num_gpus and CPU processes with --num_accelerators; `torchrun` takes
    --nproc_per_node; `accelerate` hands the processes to torchrun (--multi_gpu), or reads them from an
    `accelerate_config` file (`accelerate_config_yaml`). `port`: where rank 0 waits (default: a free one).
    """
    _check_count(n)
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)} (got {launcher!r})")
    port = port or free_port()
    head = [sys.executable, "-m", LAUNCHERS[launcher]]
    if launcher == "deepspeed":
        head += ["--num_gpus" if device == "cuda" else "--num_accelerators", str(n), "--master_port", str(port)]
    elif launcher == "torchrun":
        head += ["--nproc_per_node", str(n), "--master_port", str(port)]
    elif accelerate_config is not None:
        head += ["--config_file", str(accelerate_config), "--main_process_port", str(port)]
    else:
        head += ["--multi_gpu", "--num_processes", str(n), "--main_process_port", str(port)]
    return head + [str(program), *map(str, args)]


def shown(argv: Sequence[str]) -> str:
    """`launch_argv` as one would type it (`deepspeed ...`, `torchrun ...`, `accelerate launch ...`), paths
    relative to the course."""
    words = list(argv)
    for launcher, module in LAUNCHERS.items():
        if words[1:3] == ["-m", module]:
            words = _TYPED[launcher] + words[3:]
    root = str(ROOT) + os.sep
    return shlex.join(w.replace(root, "") for w in words)


def launch_commands(program: str | Path, n: int, *, device: str = "cuda", args: Sequence[str] = (),
                    accelerate_config: str | Path | None = None, port: int = 29500) -> dict[str, str]:
    """The same start of `n` processes of `program` with each launcher, as typed (notebooks 04 and 05).

    `accelerate launch --multi_gpu` starts one process per GPU through torchrun; without GPUs it runs a single
    process, whatever --num_processes says. With `accelerate_config` the start from that file is listed too.
    """
    cmds = {name: shown(launch_argv(program, n, launcher=name, device=device, port=port, args=args))
            for name in LAUNCHERS}
    if accelerate_config is not None:
        cmds["accelerate (config file)"] = shown(launch_argv(program, n, launcher="accelerate", port=port, args=args,
                                                             accelerate_config=accelerate_config))
    return cmds


def run_ranks(program: str | Path, n: int, out: Path, *, device: str = "cpu", launcher: str = "deepspeed",
              args: Sequence[str] = (), accelerate_config: str | Path | None = None,
              timeout: int = 600) -> list[dict[str, Any]]:
    """Launch `n` ranks of `program` with --out `out` --device `device`; return what each wrote (rank<r>.json),
    rank 0 first, with the command and the seconds it took (notebook 03).

    The five variables a launcher sets, and the one-rank NCCL setting the course made, are removed from the
    children's environment (a notebook's own single-process values would clash); on CPU the GPUs are hidden from
    them. PYTHONPATH names the course, so the ranks import helpers even where the course is not pip-installed (a
    fresh Colab runtime).
    """
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    argv = launch_argv(program, n, launcher=launcher, device=device, accelerate_config=accelerate_config, port=port,
                       args=[*args, "--out", str(out), "--device", device])
    env = child_env()  # without this process's world-of-one variables
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    from helpers.fresh_process import run_process_group

    try:
        proc = run_process_group(argv, cwd=ROOT, env=env, timeout=timeout)  # an interrupt stops every rank
    finally:
        remove_shm_buffers(port)
    if proc.returncode != 0:
        raise RuntimeError(f"{shown(argv)} failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    for r in reports:
        r["launch_seconds"] = round(time.perf_counter() - start, 1)
        r["command"] = shown(argv)
    return reports


def remove_shm_buffers(port: int) -> list[str]:
    """Remove the shared-memory files that DeepSpeed's CPU all-reduce left for the ranks launched on `port`.

    On CPU, DeepSpeed 0.19.8 (ops/csrc/cpu/comm/shm.cpp) gives every rank a /dev/shm file of 69 MB,
    `deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`, and never unlinks it: each 2-rank launch kept
    138 MB of RAM (tmpfs) until reboot (15 GB after a few days of course runs on one machine). `run_ranks` calls
    this once its ranks have exited. Returns the names removed.
    """
    shm = Path("/dev/shm")
    removed = []
    for f in shm.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*") if shm.is_dir() else []:
        try:
            f.unlink()
            removed.append(f.name)
        except OSError:
            pass
    return removed


def function_source(path: str | Path, name: str) -> str:
    """The source text of function `name` in the file `path` (to show a program's core in a notebook) (notebook 04)."""
    import ast

    text = Path(path).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return "\n".join(text.splitlines()[node.lineno - 1:node.end_lineno])
    raise ValueError(f"no function {name!r} in {path}")


def accelerate_config_yaml(ds_config_path: str | Path, n_gpus: int) -> str:
    """An `accelerate launch --config_file` YAML that points at the DeepSpeed JSON file (notebook 04).

    Precision, accumulation and clipping come from the JSON alone: with `deepspeed_config_file` set, Accelerate
    refuses the same settings in its own file (e.g. a `mixed_precision` line).
    """
    _check_count(n_gpus)
    return "\n".join([
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: DEEPSPEED",
        "deepspeed_config:",
        f"  deepspeed_config_file: {ds_config_path}",
        f"  zero3_init_flag: {'true' if _zero_stage_of(ds_config_path) == 3 else 'false'}",
        "machine_rank: 0",
        "num_machines: 1",
        f"num_processes: {n_gpus}",
        "main_training_function: main",
        "rdzv_backend: static",
        "same_network: true",
        "use_cpu: false",
        "",
    ])


def _zero_stage_of(ds_config_path: str | Path) -> int | None:
    try:
        return int(json.loads(Path(ds_config_path).read_text())["zero_optimization"]["stage"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- several machines (written, not run)


def hostfile_text(hosts: dict[str, int]) -> str:
    """A DeepSpeed hostfile: one `hostname slots=<GPUs>` line per node (the launcher reaches them over ssh)
    (notebook 05)."""
    for host, slots in hosts.items():
        if not host or any(c.isspace() for c in host) or int(slots) < 1:
            raise ValueError(f"bad host entry {host!r}: {slots!r} (a hostname and at least 1 slot)")
    return "".join(f"{host} slots={int(slots)}\n" for host, slots in hosts.items())


def parse_hostfile(text: str) -> dict[str, int]:
    """{host: slots} from hostfile text, as DeepSpeed's launcher reads it (comments and blank lines skipped)
    (notebook 05)."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host, slots = line.split()
            key, value = slots.split("=")
            if key != "slots":
                raise ValueError
            slots = int(value)
        except ValueError:
            raise ValueError(f"hostfile line {number} {raw!r}: expected 'hostname slots=N'") from None
        if host in hosts:
            raise ValueError(f"hostfile line {number}: host {host!r} is listed twice")
        hosts[host] = slots
    return hosts


def multi_node_commands(program: str, config: str, hosts: dict[str, int], master: str | None = None,
                        port: int = 29500) -> dict[str, str]:
    """The commands that start `program` on every GPU of `hosts` (not run here: they need the machines and ssh)
    (notebook 05)."""
    nodes, gpus = len(hosts), min(hosts.values())
    master = master or next(iter(hosts))
    return {
        "deepspeed launcher (hostfile, ssh to each node)":
            f"deepspeed --hostfile hostfile --num_nodes {nodes} --num_gpus {gpus} --master_addr {master} "
            f"--master_port {port} {program} --deepspeed_config {config}",
        f"torchrun (run on every node, NODE_RANK 0 ... {nodes - 1})":
            f"torchrun --nnodes {nodes} --nproc_per_node {gpus} --node_rank $NODE_RANK --master_addr {master} "
            f"--master_port {port} {program} --deepspeed_config {config}",
        "accelerate launch (run on every node)":
            f"accelerate launch --multi_gpu --num_machines {nodes} --num_processes {nodes * gpus} "
            f"--machine_rank $NODE_RANK --main_process_ip {master} --main_process_port {port} "
            f"{program} --deepspeed_config {config}",
    }
