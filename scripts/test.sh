#!/usr/bin/env bash
# Set up and run the tests: lint (ruff), unit tests of helpers, and every notebook as a learner runs it
# (tests/test_notebooks_twice.py: top to bottom with each heavy cell interrupted and re-run, then a second pass).
# Then every numbered notebook once more through nbmake (`pytest --nbmake`), the runner the course names: its own pass,
# smoke-sized on CPU, in the saved-run environment the other runners set (text progress bars).
# A single notebook: DS_COURSE_SAVED_RUN=1 .venv/bin/python -m pytest --nbmake notebooks/0N_*.ipynb
# Time is printed: pytest's 30 slowest tests, and each phase's seconds at the end (and when a phase fails).
set -euo pipefail
cd "$(dirname "$0")/.."
PHASES=()
phase_start=$(date +%s)
phase() {  # phase NAME: close the running phase under NAME
  local now
  now=$(date +%s)
  PHASES+=("$1 $((now - phase_start)) s")
  phase_start=$now
}
report() {
  local rc=$?
  echo "== time per phase (seconds)"
  printf '   %s\n' "${PHASES[@]}"
  [ "$rc" = 0 ] || echo "   (stopped with exit code $rc in the phase after the last one listed)"
}
trap report EXIT
bash scripts/setup.sh
echo "== installing requirements-dev.txt (pytest, nbmake, ruff)"
.venv/bin/python -m pip --disable-pip-version-check install -q -r requirements-dev.txt
phase "install"
LINTED=(helpers benchmarks scripts tests notebooks/programs)
.venv/bin/ruff check "${LINTED[@]}"  # rules: pyproject.toml [tool.ruff.lint]
phase "lint"
.venv/bin/python -m pytest tests --durations=30 "$@"
phase "unit tests and notebooks as a learner runs them (pytest tests)"
echo "== every notebook through nbmake (pytest --nbmake notebooks/), one pass each"
DS_COURSE_SAVED_RUN=1 .venv/bin/python -m pytest --nbmake --nbmake-timeout=1800 -p no:cacheprovider --durations=0 "$@" \
  notebooks/[0-9][0-9]_*.ipynb
phase "nbmake"
