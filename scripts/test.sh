#!/usr/bin/env bash
# Set up and run the tests (the README's second command; CI runs it on a fresh clone):
#   bash scripts/test.sh          lint (ruff), then one pytest run over every core (pytest-xdist): every test in
#                                 tests/ and every notebook (notebooks/drafts/ too) through nbmake as a learner runs it
#                                 (tests/learner_habits.py: heavy cells interrupted and run again, a second pass in the
#                                 same kernel).
#   bash scripts/test.sh --quick  lint and the fast unit tests of helpers (not marked `slow`): no notebook, no
#                                 DeepSpeed engine, no op build, no Colab venv. For contributors, between full runs.
# A single notebook as CI runs it: DS_COURSE_SAVED_RUN=1 .venv/bin/python -m pytest --nbmake -p tests.learner_habits \
#   notebooks/0N_*.ipynb   (without `-p tests.learner_habits`: plain nbmake, one pass)
# Time is printed: pytest's 30 slowest tests, the seconds spent in tests and in notebooks, each phase's seconds.
# Other arguments go to pytest (e.g. -q, -x, -k NAME).
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
# DeepSpeed's JIT ops in this checkout's own cache: ~/.cache/torch_extensions is shared by every checkout and venv of
# one Python on the machine, and a library another venv compiled there is compiled again on first use, wherever that
# is (inside a notebook's 3 GB memory group, where g++ is killed: a fresh-clone run beside a local one, 2026-12-07)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
echo "== installing requirements-dev.txt (pytest, nbmake, ruff)"
.venv/bin/python -m pip --disable-pip-version-check install -q -r requirements-dev.txt
phase "install"
LINTED=(helpers benchmarks scripts tests notebooks/programs)
.venv/bin/ruff check "${LINTED[@]}"  # rules: pyproject.toml [tool.ruff.lint]
phase "lint"
QUICK=0
ARGS=()
for a in "$@"; do
  if [ "$a" = "--quick" ]; then QUICK=1; else ARGS+=("$a"); fi
done
WORKERS=(-n "${DS_COURSE_TEST_WORKERS:-auto}" --dist worksteal)  # a worker per core; an idle one takes queued tests
if [ "$QUICK" = 1 ]; then
  .venv/bin/python -m pytest tests -m "not slow" "${WORKERS[@]}" --durations=10 "${ARGS[@]}"
  phase "quick tier: unit tests not marked slow (pytest -m 'not slow')"
  exit 0
fi
echo "== the tests and every notebook through nbmake as a learner runs it (tests/learner_habits.py), one pytest run"
shopt -s nullglob
NOTEBOOKS=(notebooks/[0-9][0-9]_*.ipynb notebooks/drafts/[0-9][0-9]_*.ipynb)  # drafts: edited, awaiting their GPU run
shopt -u nullglob
.venv/bin/python -m pytest --nbmake --nbmake-timeout=1800 -p tests.learner_habits "${WORKERS[@]}" --durations=30 \
  "${ARGS[@]}" "${NOTEBOOKS[@]}" tests
phase "tests and notebooks (one pytest run; its summary splits the time between them)"
