#!/usr/bin/env bash
# Set up and run the tests: unit tests of helpers, and every notebook under nbmake (once) and twice in one kernel.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest --nbmake --nbmake-timeout=1200 tests notebooks "$@"
