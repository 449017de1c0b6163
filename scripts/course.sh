#!/usr/bin/env bash
# Set up and run the course: execute every notebook top to bottom, outputs saved in build/notebooks/.
# Smoke-sized on a CPU-only machine, full-sized on a GPU (DS_COURSE_T4_BUDGET=1 emulates a Colab T4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/run_notebooks.py "$@"
