#!/usr/bin/env bash
# Set up and run the course: execute every notebook top to bottom, outputs saved in build/notebooks/.
# Smoke-sized on a CPU-only machine, full-sized on a GPU (DS_COURSE_T4_BUDGET=1 emulates a Colab T4).
# Prerequisites and run times: README.md, "On your own machine".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== running the notebooks into build/notebooks/ (the first run also compiles DeepSpeed's C++ ops cpu_adam and"
echo "   async_io, a few minutes on a small machine; later runs with this .venv reuse them)"
.venv/bin/python scripts/run_notebooks.py "$@"
