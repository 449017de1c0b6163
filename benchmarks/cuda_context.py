"""Benchmark: what a course process holds on the GPU outside PyTorch's caching allocator (issue 51).

    python benchmarks/cuda_context.py                    # GPU, otherwise idle: writes reports/cuda_context.json, .md
    python benchmarks/cuda_context.py --out build/cuda_context.json --size gpt2-medium

The course's T4 budget, helpers.T4_VRAM_GIB, is what a T4 leaves PyTorch's allocator: the card's memory less what sits
outside the allocator, the CUDA context (helpers.hardware.T4_CUDA_CONTEXT_GIB, from real T4s' out-of-memory messages)
and what DeepSpeed adds (helpers.hardware.T4_DEEPSPEED_ALLOWANCE_GIB, set from this script's --nccl-variants run). Each stage runs in a
fresh child process and takes the ones before it, measuring after each:
  context    the CUDA context alone (one small tensor)
  matmul     + a cuBLAS fp16 matmul (cuBLAS's handle and workspace, its kernels loaded)
  deepspeed  + one ZeRO-2 fp16 step of a GPT-2 (the course's zero2 config, T4 budget mode) through
             deepspeed.initialize, in a world of one process with the five distributed variables set as helpers
             do (NCCL's communicator, DeepSpeed's kernels, more CUDA modules loaded lazily)
--nccl-variants: the deepspeed stage again in fresh children, one per NCCL setting (VARIANTS: NCCL's own channel count
against the course's one, NCCL's cuMem allocations off, CUDA's eager module loading), side by side, measured by NVML per process
(process less reserved); which of DeepSpeed's ~1 GiB (H100, 2026-12-06) is NCCL's buffers, which is code.
Outside the allocator = total - free - reserved (torch.cuda.mem_get_info, torch.cuda.memory_reserved): total - free
counts every process on the GPU, so the GPU must be otherwise idle; NVML's per-process figure is recorded beside it
when pynvml is importable (it also names other processes on the GPU). Without a GPU it refuses.

The figures are this GPU's. The context's local-memory reservation scales with SMs x resident threads per SM (T4:
40 x 1024; H100: 132 x 2048), so an H100's or H200's context is no T4 figure (the report names the ratio); what
DeepSpeed adds (the deepspeed stage less the matmul stage, in one process) is mostly code and NCCL's buffers, the
figure to check T4_DEEPSPEED_ALLOWANCE_GIB against.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
STAGES = ("context", "matmul", "deepspeed")
WHAT = {"context": "CUDA context (one small tensor)", "matmul": "+ cuBLAS fp16 matmul (4096 x 4096)",
        "deepspeed": "+ one ZeRO-2 fp16 step through deepspeed.initialize"}
# the deepspeed stage again under each of these (--nccl-variants): what NCCL's settings and lazy loading change
VARIANTS: dict[str, dict[str, str]] = {
    "as the course runs": {},  # helpers.runtime.setup_single_process: NCCL_MAX_NCHANNELS=1 since 2026-12-06
    "NCCL_MAX_NCHANNELS=64 (NCCL's own count)": {"NCCL_MAX_NCHANNELS": "64"},
    "NCCL_MAX_NCHANNELS=1": {"NCCL_MAX_NCHANNELS": "1"},
    "NCCL_CUMEM_ENABLE=0": {"NCCL_CUMEM_ENABLE": "0"},
    "CUDA_MODULE_LOADING=EAGER": {"CUDA_MODULE_LOADING": "EAGER"},
}
T4_SMS, T4_THREADS_PER_SM = 40, 1024  # deviceQuery on a Tesla T4 (helpers.hardware's T4_TOTAL_BYTES comment)
NO_GPU = ("benchmarks/cuda_context.py measures GPU memory outside PyTorch's allocator and needs a CUDA GPU; this "
          "machine has none (torch.cuda.is_available() is False): run it on the GPU machine")


def _nvml(pid: int) -> dict[str, Any] | None:
    """NVML's view of GPU 0 (by UUID, so CUDA_VISIBLE_DEVICES does not matter): this process's used bytes and the
    other compute processes on it; None without pynvml or where NVML cannot say."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        procs = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    except Exception:  # no pynvml, no NVML in this container, an older driver: the torch figures stand alone
        return None
    mine = [used for p, used in procs if p == pid]
    return {"process_bytes": mine[0] if mine else None, "processes": [list(p) for p in procs],
            "others": [p for p, _ in procs if p != pid] if mine else None}


def _stack_bytes() -> int | None:
    """The context's per-thread stack (local memory) size, cuCtxGetLimit(CU_LIMIT_STACK_SIZE): the driver reserves it
    for every thread the GPU can hold at once (SMs x threads per SM), and raises it when a loaded kernel needs more."""
    import ctypes

    try:
        value = ctypes.c_size_t()
        return value.value if ctypes.CDLL("libcuda.so.1").cuCtxGetLimit(ctypes.byref(value), 0) == 0 else None
    except OSError:
        return None


def _snapshot(stage: str) -> dict[str, Any]:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    props = torch.cuda.get_device_properties(0)
    stack = _stack_bytes()
    row = {"stage": stage, "total": total, "free": free, "reserved": reserved, "allocated": allocated,
           "outside": total - free - reserved, "stack_bytes_per_thread": stack,
           "local_memory_reserved": stack * props.multi_processor_count * props.max_threads_per_multi_processor
           if stack is not None else None}
    nvml = _nvml(os.getpid())
    if nvml is not None:
        row["nvml"] = nvml
        if nvml["process_bytes"] is not None:
            row["nvml_outside"] = nvml["process_bytes"] - reserved
    return row


def _deepspeed_step(size: str, seq_len: int, snapshots: list[dict[str, Any]]) -> None:
    """One ZeRO-2 fp16 step of `size` as a course process takes it (T4 budget mode, the course's zero2 config), with
    a snapshot after each part: NCCL's communicator, deepspeed.initialize, forward + backward (the last one, after
    engine.step(), is the caller's)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    import helpers

    helpers.runtime.setup_single_process()
    runtime = helpers.detect_runtime(t4_budget=True)  # fp16 and the T4's attention kernels, as the emulation
    cfg = helpers.course_config("zero2", runtime, micro_batch_size=2, warmup_steps=1)
    model = GPT2LMHeadModel(helpers.gpt2_config(size, vocab_size=8192))
    deepspeed.init_distributed(dist_backend="nccl")
    flag = torch.ones(1, device="cuda")
    dist.all_reduce(flag)  # NCCL makes its communicator at the first collective
    snapshots.append(_snapshot("deepspeed: NCCL communicator"))
    with helpers.quiet_deepspeed():
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    snapshots.append(_snapshot("deepspeed: initialize"))
    ids = torch.randint(0, 8192, (2, seq_len), device=engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    snapshots.append(_snapshot("deepspeed: forward + backward"))
    engine.step()


def child(stage: str, size: str, seq_len: int) -> int:
    """The stages up to `stage` in this fresh process; one JSON line of snapshots after each."""
    import torch

    props = torch.cuda.get_device_properties(0)
    info = {"gpu": props.name, "sms": props.multi_processor_count,
            "threads_per_sm": getattr(props, "max_threads_per_multi_processor", None),
            "total_memory": props.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda}
    snapshots = []
    torch.ones(1, device="cuda")
    snapshots.append(_snapshot("context"))
    if STAGES.index(stage) >= 1:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
        (a @ a).sum().item()
        del a
        snapshots.append(_snapshot("matmul"))
    if STAGES.index(stage) >= 2:
        _deepspeed_step(size, seq_len, snapshots)
        snapshots.append(_snapshot("deepspeed"))
    print(json.dumps({**info, "snapshots": snapshots}))
    return 0


def _start_child(stage: str, size: str, seq_len: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """This file's `--child stage` in a fresh process, with `env`'s settings added to this process's environment."""
    return subprocess.Popen([sys.executable, __file__, "--child", stage, "--size", size, "--seq-len", str(seq_len)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})


def _child_result(proc: subprocess.Popen[str], timeout_s: float | None = None,
                  tail: int = 3000) -> tuple[dict[str, Any] | None, str]:
    """(the last JSON line `proc` printed, ""), or (None, its exit code and the last `tail` characters of its stderr)
    where it failed or printed none; a child still running after `timeout_s` is killed."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [x for x in stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, f"exit {proc.returncode}: {stderr[-tail:]}"
    return json.loads(lines[-1]), ""


def nccl_variants(size: str, seq_len: int, timeout_s: float = 240) -> dict[str, Any]:
    """The deepspeed stage under each of VARIANTS' settings, in fresh children side by side; per part, what the child
    holds outside the allocator by NVML (its used memory less reserved), and the parts' differences. A child whose
    NVML figure is missing (no pynvml) is reported without numbers."""
    procs = {name: _start_child("deepspeed", size, seq_len, env) for name, env in VARIANTS.items()}
    out: dict[str, Any] = {}
    for name, proc in procs.items():
        result, error = _child_result(proc, timeout_s, tail=600)
        if result is None:
            out[name] = {"env": VARIANTS[name], "error": error}
            continue
        parts = {r["stage"]: r.get("nvml_outside") for r in result["snapshots"]}
        gib = {k: None if v is None else round(v / GiB, 3) for k, v in parts.items()}
        adds = (None if None in (parts.get("deepspeed"), parts.get("matmul"))
                else round((parts["deepspeed"] - parts["matmul"]) / GiB, 3))
        out[name] = {"env": VARIANTS[name], "outside_gib": gib, "deepspeed_adds_gib": adds}
    return out


def variants_markdown(variants: dict[str, Any]) -> list[str]:
    """The --nccl-variants table: after each part of the deepspeed stage, outside the allocator (NVML), per setting."""
    parts = ["context", "matmul", "deepspeed: NCCL communicator", "deepspeed: initialize", "deepspeed"]
    lines = ["", "The deepspeed stage under NCCL's and CUDA's settings (fresh children side by side; NVML: the process's "
             "used memory less reserved, GiB):", "",
             "| setting | " + " | ".join(WHAT.get(p, p) for p in parts) + " | DeepSpeed adds |",
             "|---|" + "---|" * (len(parts) + 1)]
    for name, v in variants.items():
        if "error" in v:
            lines.append(f"| {name} | failed: {v['error'][:120]!r} |")
            continue
        cells = ["-" if v["outside_gib"].get(p) is None else f"{v['outside_gib'][p]:.3f}" for p in parts]
        adds = "-" if v["deepspeed_adds_gib"] is None else f"{v['deepspeed_adds_gib']:.3f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {adds} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# What a course process holds outside PyTorch's allocator ({report['gpu']}, {report['date']})", "",
             f"torch {report['torch']} (CUDA {report['cuda']}), deepspeed {report['deepspeed']}, "
             f"CUDA_MODULE_LOADING={report['cuda_module_loading'] or 'unset (lazy)'}; {report['sms']} SMs x "
             f"{report['threads_per_sm']} threads, {report['context_scale_to_t4']}x a T4's {T4_SMS} x "
             f"{T4_THREADS_PER_SM}. Each stage in a fresh process, with the ones before it. "
             "Outside = total - free - reserved (torch.cuda.mem_get_info).", "",
             "| stage | outside the allocator (GiB) | NVML, process less reserved (GiB) | reserved (GiB) | allocated (GiB) |",
             "|---|---|---|---|---|"]
    for r in report["rows"]:
        nvml = f"{r['nvml_outside'] / GiB:.3f}" if r.get("nvml_outside") is not None else "-"
        lines.append(f"| {WHAT[r['stage']]} | {r['outside'] / GiB:.3f} | {nvml} | {r['reserved'] / GiB:.3f} | "
                     f"{r['allocated'] / GiB:.3f} |")
    lines += ["", "The deepspeed stage's process, part by part (local memory = the per-thread stack limit x SMs x threads "
              "per SM, which the driver reserves for a full GPU; what is outside the allocator beyond it is code, "
              "NCCL's buffers and the driver's own):", "",
              "| after | outside the allocator (GiB) | stack per thread (bytes) | local memory reserved (GiB) |",
              "|---|---|---|---|"]
    for r in report["runs"]["deepspeed"]["snapshots"]:
        local, stack = r.get("local_memory_reserved"), r.get("stack_bytes_per_thread")
        lines.append(f"| {WHAT.get(r['stage'], r['stage'])} | {r['outside'] / GiB:.3f} | "
                     f"{'-' if stack is None else stack} | {'-' if local is None else f'{local / GiB:.3f}'} |")
    c = report["compare"]
    if c.get("t4_estimate_gib") is not None:
        lines += ["", f"On a T4 (local memory scaled to {T4_SMS} x {T4_THREADS_PER_SM} threads, the rest as measured "
                  f"here): the context after the matmul ~{c['t4_context_estimate_gib']:.3f} GiB, DeepSpeed's addition "
                  f"~{c['t4_deepspeed_estimate_gib']:.3f} GiB, together ~{c['t4_estimate_gib']:.3f} GiB against "
                  f"T4_CUDA_CONTEXT_GIB + T4_DEEPSPEED_ALLOWANCE_GIB = "
                  f"{c['T4_CUDA_CONTEXT_GIB'] + c['T4_DEEPSPEED_ALLOWANCE_GIB']:.2f} GiB. An estimate: for the "
                  "context it overstates a T4's (real T4s show 0.12-0.15 GiB: the driver's own share is smaller on a "
                  "smaller card); DeepSpeed's addition, code and NCCL's buffers beside its local memory, is the "
                  "figure that transfers, to check T4_DEEPSPEED_ALLOWANCE_GIB against."]
    if c.get("deepspeed_adds_gib") is not None:
        lines += ["", f"DeepSpeed adds {c['deepspeed_adds_gib']:.3f} GiB outside the allocator (deepspeed stage less "
                  f"the matmul stage, one process); helpers.hardware.T4_DEEPSPEED_ALLOWANCE_GIB = "
                  f"{c['T4_DEEPSPEED_ALLOWANCE_GIB']}: {'holds' if c['allowance_holds'] else 'too small'}."]
    lines += [f"This GPU's context after the matmul: {c['context_gib']:.3f} GiB; "
              f"helpers.hardware.T4_CUDA_CONTEXT_GIB = "
              f"{c['T4_CUDA_CONTEXT_GIB']} is a T4's (real T4s' out-of-memory messages), not this GPU's.",
              *(["", *(f"Not idle: {n}" for n in report["not_idle"])] if report["not_idle"] else []),
              *(variants_markdown(report["nccl_variants"]) if report.get("nccl_variants") else [])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "cuda_context.json")
    p.add_argument("--size", default="gpt2", help="the GPT-2 of the deepspeed stage (default gpt2, 124M)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--nccl-variants", action="store_true",
                   help="also the deepspeed stage under each NCCL/CUDA setting of VARIANTS (side by side, by NVML)")
    p.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():  # no context made here: the parent never touches the GPU
        print(NO_GPU, file=sys.stderr)
        return 2
    if args.child:
        return child(args.child, args.size, args.seq_len)
    import deepspeed

    from helpers.hardware import T4_CUDA_CONTEXT_GIB, T4_DEEPSPEED_ALLOWANCE_GIB

    runs = {}
    for stage in STAGES:  # one at a time: each measures an otherwise idle GPU
        result, error = _child_result(_start_child(stage, args.size, args.seq_len))
        if result is None:
            raise RuntimeError(f"{stage}: {error}")
        runs[stage] = result
    first = runs["context"]
    rows = [runs[s]["snapshots"][-1] for s in STAGES]
    ds = {r["stage"]: r for r in runs["deepspeed"]["snapshots"]}
    adds = (ds["deepspeed"]["outside"] - ds["matmul"]["outside"]) / GiB
    t4_share = T4_SMS * T4_THREADS_PER_SM / (first["sms"] * (first["threads_per_sm"] or 1))

    def on_t4(row: dict[str, Any]) -> float | None:
        """`row`'s outside-the-allocator bytes with its local memory scaled to a T4's threads (GiB)."""
        local = row.get("local_memory_reserved")
        return None if local is None else (row["outside"] - local + local * t4_share) / GiB

    t4 = {k: on_t4(ds[k]) for k in ("matmul", "deepspeed")}
    not_idle = [f"{s}: other processes on the GPU {r['nvml']['others']}" for s, run in runs.items()
                for r in run["snapshots"] if (r.get("nvml") or {}).get("others")]
    report = {"gpu": first["gpu"], "date": dt.date.today().isoformat(), "torch": first["torch"], "cuda": first["cuda"],
              "deepspeed": deepspeed.__version__, "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", ""),
              "sms": first["sms"], "threads_per_sm": first["threads_per_sm"],
              "context_scale_to_t4": round(first["sms"] * (first["threads_per_sm"] or 0) / (T4_SMS * T4_THREADS_PER_SM),
                                           2),
              "size": args.size, "seq_len": args.seq_len, "rows": rows, "runs": runs, "not_idle": not_idle,
              "compare": {"context_gib": round(rows[1]["outside"] / GiB, 3), "T4_CUDA_CONTEXT_GIB": T4_CUDA_CONTEXT_GIB,
                          "deepspeed_adds_gib": round(adds, 3), "T4_DEEPSPEED_ALLOWANCE_GIB": T4_DEEPSPEED_ALLOWANCE_GIB,
                          "allowance_holds": adds <= T4_DEEPSPEED_ALLOWANCE_GIB,
                          **({"t4_context_estimate_gib": round(t4["matmul"], 3),
                              "t4_deepspeed_estimate_gib": round(t4["deepspeed"] - t4["matmul"], 3),
                              "t4_estimate_gib": round(t4["deepspeed"], 3)} if None not in t4.values() else {})},
              "how": "each stage in a fresh child process with the stages before it; outside = total - free - reserved "
                     "after torch.cuda.synchronize(); nvml_outside = NVML's used memory of this process less reserved"}
    if args.nccl_variants:  # after the idle-GPU stages: these children share the GPU, measured per process
        report["nccl_variants"] = nccl_variants(args.size, args.seq_len)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
