"""Run notebooks full-sized on a GPU in Colab T4 emulation and write reports/gpu_check.json.

    python scripts/gpu_check.py notebooks/00_setup_and_ds_report.ipynb --out-dir reports/executed
    python scripts/gpu_check.py --no-emulation ...          # the older T4 budget mode: VRAM capped, RAM not enforced
    python scripts/gpu_check.py --merge part1.json part2.json --report reports/gpu_check.json

By default every notebook's kernel, and each process it starts, runs inside scripts/colab_emulation.py's limits:
PyTorch's allocator capped at what a T4 leaves it (helpers.T4_VRAM_GIB) and fp16, Colab's RAM less what Colab itself uses (a cgroup), 2 CPUs, the NVMe folder held to 60 GB.
Per notebook: passed, wall seconds, peak memory of the whole group, out-of-memory kills, GPU-busy seconds, a T4 time
estimate, and the figures it recorded with helpers.record_figure. Entries for notebooks not run are kept.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from colab_emulation import ColabLimits, probe, run_notebook  # scripts/ (this file's folder) is on sys.path
from run_notebooks import ROOT, execute

# How many times a T4's work each GPU does per second, from the datasheets: (fp16 tensor throughput, memory bandwidth).
# A T4 computes fp16 at ~65 TFLOP/s and reads memory at 320 GB/s; an H200 ~990 TFLOP/s (dense) and 4.8 TB/s (both
# ~15x); an H100 SXM ~990 TFLOP/s and 3.35 TB/s (15x compute, 10.5x bandwidth). A T4 estimate takes the lower ratio
# for its low end and the higher for its high end.
GPU_OVER_T4 = {"H200": (15.0, 15.0), "H100": (15.2, 10.5)}
# Colab's 2 vCPUs are two hyper-threads of one ~2.2 GHz Xeon core: CPU-bound work there is up to ~2x slower than on
# two cores of the GPU machine.
COLAB_CPU_SLOWDOWN = 2.0


# the libraries whose versions a run records: Colab's are in tests/data/colab/pip-freeze.gpu.txt (issue 38: the GPU
# runs use Colab's versions of these, from the bundle's wheels, scripts/colab_software.py gpu-wheels)
LIBRARIES = ("transformers", "datasets", "accelerate", "huggingface_hub", "tokenizers", "torchvision", "timm", "pillow",
             "numpy", "pyarrow", "fsspec")


def machine_facts() -> dict:
    """GPU, torch, CUDA and deepspeed versions, read in a child process (this one stays free of CUDA)."""
    code = ("import json, torch, deepspeed, importlib.metadata as m; p = torch.cuda.get_device_properties(0)\n"
            "def v(n):\n    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({'gpu': p.name, 'torch': torch.__version__, 'torch_cuda': torch.version.cuda, "
            "'deepspeed': deepspeed.__version__, 'cuda': torch.cuda.is_available(), "
            "'packages': {n: v(n) for n in LIBRARIES}}))").replace("LIBRARIES", repr(LIBRARIES))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if out.returncode == 0 and lines else {"cuda": False, "error": out.stderr[-500:]}


def gpu_over_t4(gpu: str) -> tuple[float, float]:
    """(lower, higher) of GPU_OVER_T4's two ratios for the GPU named `gpu` (e.g. 'NVIDIA H100 80GB HBM3')."""
    key = next((k for k in GPU_OVER_T4 if k in gpu), None)
    if key is None:
        raise ValueError(f"no T4 ratio for GPU {gpu!r}; known: {', '.join(GPU_OVER_T4)}. Fix: add its datasheet fp16 "
                         "throughput and memory bandwidth over a T4's to GPU_OVER_T4 in scripts/gpu_check.py.")
    return min(GPU_OVER_T4[key]), max(GPU_OVER_T4[key])


def t4_estimate(wall_s: float, gpu_busy_s: float | None, gpu: str = "NVIDIA H200") -> dict | None:
    """Seconds a T4 might take: GPU-busy time x the GPU's ratios over a T4 (gpu_over_t4), the rest x
    1-COLAB_CPU_SLOWDOWN."""
    if gpu_busy_s is None:
        return None
    low, high = gpu_over_t4(gpu)
    rest = max(wall_s - gpu_busy_s, 0.0)
    short = gpu.replace("NVIDIA ", "").split()[0]
    ratio = f"{low:g}" if low == high else f"{low:g}-{high:g}"
    return {"low_s": round(gpu_busy_s * low + rest), "high_s": round(gpu_busy_s * high + rest * COLAB_CPU_SLOWDOWN),
            "how": f"GPU-busy seconds (nvidia-smi utilisation) x {ratio} ({short}/T4 fp16 throughput and memory "
                   f"bandwidth) + the other seconds x 1-{COLAB_CPU_SLOWDOWN:g} (Colab's 2 vCPUs are one core's two "
                   "hyper-threads); disk and PCIe speed not modelled"}


def merge(report: dict, parts: list[dict]) -> dict:
    """Fold partial reports (one per notebook run in parallel) into `report`. An entry kept from an earlier run keeps
    the card and date it ran on (the report's own, before the parts replace them)."""
    for entry in report.get("notebooks", {}).values():
        for key in ("gpu", "date"):
            if key in report:
                entry.setdefault(key, report[key])
    for part in parts:
        report.setdefault("notebooks", {}).update(part.get("notebooks", {}))
        for k, v in part.items():
            if k != "notebooks":
                report[k] = v
    report["notebooks"] = dict(sorted(report["notebooks"].items()))
    return report


def printed_runtime(executed: Path, gpu: str) -> str:
    """The runtime label an executed notebook printed for `gpu` (``H100 80GB HBM3 in Colab T4 emulation (14.34 GiB
    VRAM, ...)``) under this budget, for a notebook that recorded none with record_figure("runtime", ...); else
    "not recorded". A notebook may also quote other runs' labels (06 quotes its report's): the budget picks its own."""
    from helpers.hardware import T4_VRAM_GIB

    card = re.escape(gpu.replace("NVIDIA ", ""))
    text = executed.read_text() if executed.exists() else ""
    labels = re.finditer(card + r" in Colab T4 emulation \(([\d.]+) GiB VRAM[^)]*\)", text)  # Runtime.label's form
    return next((m.group(0) for m in labels if abs(float(m.group(1)) - T4_VRAM_GIB) < 0.005), "not recorded")


def readme_rows(readme: str, report: dict) -> str:
    """The README's notebook table with its last two columns (T4 minutes; GPU time, peak RAM and card) taken from
    `report`, the other columns kept (tests/test_readme.py holds the table to the report)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from course_shape import t4_minutes

    out = []
    for line in readme.splitlines(keepends=True):
        m = re.match(r"\| \d\d \| \[.*?\(notebooks/(\d\d_[^)]+\.ipynb)\)", line)
        entry = report["notebooks"].get(m.group(1)) if m else None
        if entry:
            cells = line.rstrip("\n").split(" | ")
            low, high = t4_minutes(entry["t4_estimate"])
            card = entry.get("gpu", report.get("gpu", "")).replace("NVIDIA ", "").split()[0]
            rest = re.sub(r"^\d+-\d+ min", "", cells[-2])
            extra = re.sub(r"^\[.*?\]\(.*?\) on an? \S+", "", cells[-1]).rstrip(" |")
            cells[-2] = f"{low}-{high} min{rest}"
            cells[-1] = (f"[{entry['wall_seconds']:.0f} s, peak RAM {entry['peak_ram_gb']:.1f} GB]"
                         f"(reports/executed/{m.group(1)}) on an {card}{extra} |")
            line = " | ".join(cells) + "\n"
        out.append(line)
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--report", type=Path, default=ROOT / "reports" / "gpu_check.json")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "build" / "gpu_check")
    parser.add_argument("--no-emulation", action="store_true", help="VRAM cap only (T4 budget mode), RAM not enforced")
    parser.add_argument("--full-gpu", action="store_true", help="neither emulation nor T4 budget: the whole GPU")
    parser.add_argument("--cpus", default="", help="the two cores for the emulated runtime, e.g. 2,3")
    parser.add_argument("--concurrent", type=int, default=0,
                        help="how many notebooks ran at the same time on this GPU (recorded in each entry)")
    parser.add_argument("--beside", default="",
                        help="other GPU work running at the same time (benchmarks), recorded in each entry")
    parser.add_argument("--runner", choices=("nbmake", "nbclient"), default="nbmake",
                        help="who runs each notebook inside the emulation: `pytest --nbmake` (default) or nbclient")
    parser.add_argument("--merge", nargs="+", type=Path, help="merge these partial reports into --report and stop")
    parser.add_argument("--readme", type=Path, help="with --merge: also rewrite this README's table from the report")
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text()) if args.report.exists() else {"notebooks": {}}
    if args.merge:
        merge(report, [json.loads(p.read_text()) for p in args.merge])
        args.report.write_text(json.dumps(report, indent=2) + "\n")
        print(f"merged {len(args.merge)} reports into {args.report}")
        if args.readme:
            args.readme.write_text(readme_rows(args.readme.read_text(), report))
            print(f"the notebook table of {args.readme} rewritten from it")
        return 0 if all(e.get("passed") for e in report["notebooks"].values()) else 1

    emulate = not (args.no_emulation or args.full_gpu)
    os.environ["DS_COURSE_T4_BUDGET"] = "0" if args.full_gpu else "1"
    facts = machine_facts()
    if not facts.get("cuda"):
        print(f"gpu_check needs a CUDA GPU; this machine has none. {facts.get('error', '')}", file=sys.stderr)
        return 2
    mechanism = probe()[0] if emulate else None
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            figures_file = Path(tmp) / "figures.json"
            if emulate:
                result = run_notebook(path, out_dir=args.out_dir, figures_file=figures_file, cpus=cpus,
                                      mechanism=mechanism, runner=args.runner)
            else:
                result = execute(path, out_dir=args.out_dir, figures_file=figures_file)
            figures = json.loads(figures_file.read_text()) if figures_file.exists() else {}
        entry = {"passed": result["passed"], "runner": result.get("runner", "nbclient"), "wall_seconds": result["seconds"],
                 "runtime": figures.get("runtime") or printed_runtime(args.out_dir / path.name, facts["gpu"]),
                 "gpu": facts["gpu"], "date": dt.date.today().isoformat(),
                 "figures": figures}
        if emulate:
            enc = result["enclosure"]
            entry.update(peak_ram_gb=enc["peak_ram_gb"], peak_anon_gb=enc["peak_anon_gb"], oom_kills=enc["oom_kills"],
                         mechanism=enc["mechanism"], peak_nvme_folder_gb=enc["peak_nvme_folder_gb"])
            if enc.get("gpu_busy_seconds") is not None:
                entry["gpu_busy_seconds"] = enc["gpu_busy_seconds"]
                entry["gpu_busy_source"] = enc.get("gpu_busy_source", "")
                alone = args.concurrent <= 1 and not args.beside
                if not entry["gpu_busy_source"].startswith("whole GPU") or alone:
                    entry["t4_estimate"] = t4_estimate(result["seconds"], enc["gpu_busy_seconds"], facts["gpu"])
            if enc.get("notes"):
                entry["notes"] = enc["notes"]
        beside = ([f"{args.concurrent - 1} other notebook(s)"] if args.concurrent > 1 else []) + (
            [args.beside] if args.beside else [])
        if args.concurrent or args.beside:
            entry["ran_beside"] = (" and ".join(beside) or "no other notebook") + " on the same GPU and disk"
        if result["error"]:
            entry["error"] = result["error"][-1500:]
        report.setdefault("notebooks", {})[path.name] = entry
        print(f"{path.name}: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s"
              + (f", peak RAM {entry['peak_ram_gb']} GB, OOM kills {entry['oom_kills']}" if emulate else ""), flush=True)
        if result["error"]:
            print(result["error"], file=sys.stderr)
    report.update({
        "runtime": next((e["runtime"] for e in report["notebooks"].values() if e.get("runtime")), ""),
        "gpu": facts["gpu"], "t4_budget": not args.full_gpu, "torch": facts["torch"],
        "torch_cuda": facts["torch_cuda"], "deepspeed": facts["deepspeed"], "date": dt.date.today().isoformat(),
        "packages": facts.get("packages", {}),
    })
    if emulate:
        report["emulation"] = ColabLimits().as_report(mechanism)
    else:
        report.pop("emulation", None)
    report["notebooks"] = dict(sorted(report["notebooks"].items()))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.report}")
    return 0 if all(report["notebooks"][p.name]["passed"] for p in paths) else 1


if __name__ == "__main__":
    sys.exit(main())
