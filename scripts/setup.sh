#!/usr/bin/env bash
# Set up .venv for the course on a fresh Linux machine (idempotent; Colab needs none of this: open the notebooks there).
#  - numpy first: anything that imports torch before numpy is installed prints "Failed to initialize NumPy".
#  - torch ($TORCH_VERSION, default 2.13.0, on GPU machines too): kept if the Python already has it; else a CUDA build
#    where an NVIDIA GPU answers (PyPI's default build; TORCH_INDEX=https://download.pytorch.org/whl/cu<version>, a
#    CUDA index that matches an older driver), else the CPU build from $TORCH_INDEX, default
#    https://download.pytorch.org/whl/cpu (PyPI's Linux wheel is the CUDA one, several GB); if that index cannot be
#    reached, from pip's configured index. A torch that was kept is never replaced, so on Colab (where a venv sees the
#    system site-packages) Colab's own torch stays.
#  - everything else from requirements.txt, with torch pinned so nothing replaces it.
#  - helpers itself, editable (pip install -e .), so scripts, benchmarks, tests and launched programs import it.
#  - libaio (NVMe offload) through apt-get when run as root; otherwise the command to run is printed.
# Prerequisites it only checks (README "Prerequisites"): python3-venv, a C++ compiler and the Python headers, with
# which DeepSpeed compiles its C++ ops (cpu_adam, async_io) the first time a notebook needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=https://download.pytorch.org/whl/cpu
if [ ! -x "$VENV/bin/python" ]; then
  # on Colab the venv sees Colab's own packages, so its torch is kept rather than a second one installed
  "$PY" -m venv ${COLAB_RELEASE_TAG:+--system-site-packages} "$VENV" || {
    echo "could not create $VENV: install python3-venv (Debian/Ubuntu: sudo apt-get install python3-venv)" >&2
    exit 1
  }
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
pip_install() {  # pip install -q, its output shown less pip-config noise ("WARNING: Location ..."); stops on failure
  local out rc=0
  out=$("${PIP[@]}" install -q "$@" 2>&1) || rc=$?
  [ -z "$out" ] || grep -v "^WARNING: Location" <<<"$out" || true
  return $rc
}

if ! "$VENV/bin/python" -c "import numpy" >/dev/null 2>&1; then
  echo "== installing numpy (before torch, which warns when it starts without numpy)"
  pip_install numpy
fi

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    echo "== installing torch $TORCH_VERSION (CUDA build: an NVIDIA GPU is present)${TORCH_INDEX:+ from $TORCH_INDEX}"
    pip_install "torch==$TORCH_VERSION" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
  else
    INDEX=${TORCH_INDEX:-$CPU_INDEX}
    if [ -z "${TORCH_INDEX:-}" ] && ! "$VENV/bin/python" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1] + '/torch/', timeout=10)" "$CPU_INDEX" >/dev/null 2>&1; then
      echo "note: $CPU_INDEX cannot be reached: torch comes from pip's configured index (set TORCH_INDEX to choose)"
      INDEX=""
    fi
    echo "== installing torch $TORCH_VERSION, CPU build (no GPU found)${INDEX:+ from $INDEX}"
    pip_install "torch==$TORCH_VERSION" ${INDEX:+--index-url "$INDEX"}
    if "$VENV/bin/python" -c "from importlib.metadata import requires; import sys; sys.exit(not any(r.startswith('nvidia') for r in requires('torch') or []))"; then
      echo "note: this torch is a CUDA build (several GB) on a machine without a GPU; for the CPU build:" \
           "rm -rf $VENV and run again with TORCH_INDEX=$CPU_INDEX"
    fi
  fi
fi
# read the version without importing torch (cheaper, and nothing for it to print)
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
# DeepSpeed compiles its C++ ops (cpu_adam, async_io) the first time a notebook needs them: a compiler and Python.h
if ! command -v "${CXX:-c++}" >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then
  echo "note: no C++ compiler: DeepSpeed cannot build its ops (CPU Adam, NVMe offload): sudo apt-get install build-essential"
fi
if ! "$VENV/bin/python" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  echo "note: no Python headers (Python.h): DeepSpeed cannot build its ops: sudo apt-get install python3-dev"
fi

# The versions go out on file descriptor 3, alone: DeepSpeed's accelerator message (stdout) and any warning (stderr)
# are silenced and sent elsewhere, so nothing can land inside the line.
READY=$("$VENV/bin/python" -c '
import logging, os, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
import torch, deepspeed
line = f"torch {torch.__version__} | deepspeed {deepspeed.__version__} | cuda {torch.cuda.is_available()}"
os.write(3, line.encode())
' 3>&1 >/dev/null 2>&1) || READY="(torch and deepspeed did not import: run $VENV/bin/python -c 'import deepspeed')"
echo "== ready: $READY"
