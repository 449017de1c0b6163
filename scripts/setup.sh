#!/usr/bin/env bash
# Set up .venv for the course on a fresh Linux machine (idempotent; Colab needs none of this).
#  - torch: kept if the Python already has it; else a CUDA build where an NVIDIA GPU answers, else the
#    CPU build torch==2.13.0 (set TORCH_INDEX=https://download.pytorch.org/whl/cpu to force the small CPU
#    wheel where PyPI would hand you a CUDA one).
#  - everything else from requirements.txt, with torch pinned so nothing replaces it.
#  - helpers itself, editable (pip install -e .), so scripts, benchmarks, tests and launched programs import it.
#  - libaio (NVMe offload) through apt-get when run as root; otherwise the command to run is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "== installing torch (CUDA build: an NVIDIA GPU is present)"
    "${PIP[@]}" install -q torch
  else
    echo "== installing torch ${TORCH_VERSION:-2.13.0} (no GPU found)"
    "${PIP[@]}" install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
  fi
fi
# read the version without importing torch (before numpy is installed torch warns "Failed to initialize NumPy")
TORCH_INSTALLED=$("$VENV/bin/python" -c "from importlib.metadata import version; print(version('torch').split('+')[0])")
mkdir -p build
echo "torch==$TORCH_INSTALLED" > build/torch-constraint.txt
echo "== installing requirements.txt (torch pinned to $TORCH_INSTALLED)"
"${PIP[@]}" install -q -r requirements.txt -c build/torch-constraint.txt 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import deepspeed, transformers, datasets" >/dev/null 2>&1 \
  || { echo "requirements did not install; see the pip output above" >&2; exit 1; }
echo "== installing helpers (editable)"
# with setuptools in the venv, no isolated build environment to download
NO_ISOLATION=$("$VENV/bin/python" -c "import setuptools" >/dev/null 2>&1 && echo --no-build-isolation || true)
"${PIP[@]}" install -q --no-deps $NO_ISOLATION -e .

if ! ldconfig -p 2>/dev/null | grep -q "libaio.so "; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing libaio-dev (NVMe offload)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null 2>&1 \
      || echo "could not install libaio-dev: NVMe offload will be skipped (the notebooks say so)"
  else
    echo "note: NVMe offload needs libaio: sudo apt-get install libaio-dev"
  fi
fi
READY=$("$VENV/bin/python" -c 'import torch, deepspeed; print("torch", torch.__version__, "| deepspeed", deepspeed.__version__, "| cuda", torch.cuda.is_available())' 2>/dev/null | tail -1)
echo "== ready: $READY"
