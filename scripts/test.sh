#!/usr/bin/env bash
# Set up and run the tests: lint (ruff), unit tests of helpers, and every notebook under nbmake (once) and as a
# learner runs it (tests/test_notebooks_twice.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== installing requirements-dev.txt (pytest, nbmake, ruff)"
.venv/bin/python -m pip --disable-pip-version-check install -q -r requirements-dev.txt
LINTED=(helpers benchmarks scripts tests notebooks/programs)
.venv/bin/ruff check "${LINTED[@]}"  # rules: pyproject.toml [tool.ruff.lint]
.venv/bin/python -m pytest --nbmake --nbmake-timeout=1200 tests notebooks "$@"
