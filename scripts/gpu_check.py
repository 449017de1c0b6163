"""Run notebooks full-sized on a GPU in T4 budget mode and write reports/gpu_check.json.

    DS_COURSE_T4_BUDGET=1 python scripts/gpu_check.py notebooks/00_setup_and_ds_report.ipynb

Per notebook: passed, wall seconds and the figures it recorded with helpers.record_figure.
Entries for notebooks not run this time are kept from the existing report.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_notebooks import ROOT, execute  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--report", type=Path, default=ROOT / "reports" / "gpu_check.json")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "build" / "gpu_check")
    parser.add_argument("--full-gpu", action="store_true", help="do not cap to the T4 budget")
    args = parser.parse_args(argv)
    os.environ["DS_COURSE_T4_BUDGET"] = "0" if args.full_gpu else "1"

    import deepspeed
    import torch

    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU; this machine has none.", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from helpers.hardware import detect_runtime

    label = detect_runtime().label  # e.g. "H200 capped to T4 budget"
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    report = json.loads(args.report.read_text()) if args.report.exists() else {"notebooks": {}}
    for path in paths:
        with tempfile.TemporaryDirectory() as tmp:
            figures_file = Path(tmp) / "figures.json"
            result = execute(path, out_dir=args.out_dir, figures_file=figures_file)
            figures = json.loads(figures_file.read_text()) if figures_file.exists() else {}
        entry = {"passed": result["passed"], "wall_seconds": result["seconds"], "runtime": label,
                 "figures": figures}
        if result["error"]:
            entry["error"] = result["error"][-1500:]
        report["notebooks"][path.name] = entry
        print(f"{path.name}: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s", flush=True)
        if result["error"]:
            print(result["error"], file=sys.stderr)
    props = torch.cuda.get_device_properties(0)
    report.update({
        "runtime": label,
        "gpu": props.name,
        "t4_budget": not args.full_gpu,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "date": dt.date.today().isoformat(),
    })
    report["notebooks"] = dict(sorted(report["notebooks"].items()))
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.report}")
    return 0 if all(report["notebooks"][p.name]["passed"] for p in paths) else 1


if __name__ == "__main__":
    sys.exit(main())
