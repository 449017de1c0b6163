#!/usr/bin/env bash
# Set up and run the tests: lint (ruff), unit tests of helpers, and every notebook as a learner runs it
# (tests/test_notebooks_twice.py: top to bottom with each heavy cell interrupted and re-run, then a second pass).
# A plain single run of one notebook, for a quick look: .venv/bin/python -m pytest --nbmake notebooks/0N_*.ipynb
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== installing requirements-dev.txt (pytest, nbmake, ruff)"
.venv/bin/python -m pip --disable-pip-version-check install -q -r requirements-dev.txt
LINTED=(helpers benchmarks scripts tests notebooks/programs)
.venv/bin/ruff check "${LINTED[@]}"  # rules: pyproject.toml [tool.ruff.lint]
# Two workers by default: much of a notebook's run is waiting (kernel start, imports, launched processes), so two
# overlap well even on 2 cores. Tests that use cgroups share one worker (xdist_group "cgroup").
.venv/bin/python -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
