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
.venv/bin/python -m pytest tests "$@"
