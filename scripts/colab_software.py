"""Colab's software, emulated: its package versions, its install cell, its Hub branches, its clone (issue 21).

    python scripts/colab_software.py versions ipywidgets notebook      # Colab's pins of these, from the fixture
    python scripts/colab_software.py build-env build/colab-env [--torch local|colab]
    python scripts/colab_software.py report [--torch colab|local] [--notebooks 00 01 02] [--install-only]
    python scripts/colab_software.py refresh /path/to/googlecolab/backend-info    # a newer fixture

The fixture is Colab's own list, `pip-freeze.gpu.txt` and `os-info-gpu.txt` of the googlecolab/backend-info repository
(tests/data/colab/, with SOURCE.json naming the commit and its date). `build-env` makes a virtual environment holding
Colab's version of every package the course touches (COURSE_TOUCHES, and their dependencies at Colab's versions where
Colab lists them) and of the packages Colab ships beside them that the course's imports reach when present
(COLAB_BESIDE: torchvision, which transformers imports, and what datasets' formatters and transformers look for).
- `--torch colab` (the report): Colab's Python (3.13, pyenv's interpreter on this machine image) and Colab's torch
  release (2.11.0) from PyPI, the CUDA build (~3 GB with its nvidia packages; it runs on the CPU here), with COLAB_BESIDE
  at Colab's versions.
- `--torch local` (CI, which never downloads a CUDA torch): this machine's Python (3.11) and the CPU torch 2.13.0 on
  disk. No torchvision release installs beside that torch, so a stand-in `torchvision` package (every module imports,
  every name a placeholder, except `io.VideoReader`, which 0.26 lacks) is imported by the kernel first, as on Colab:
  datasets 4.0.0's tensor formatters then fail as on Colab (huggingface/datasets#8085, issue 38).

Every Python process of the emulated session (kernel, launched programs, fresh children) logs each top-level module
name and each distribution name it asks the import system or importlib.metadata for (`sitecustomize` on its path,
IMPORT_LOG_CODE). The report lists per notebook what was asked for that Colab ships and the environment lacked:
`beside_missing`, the guard of tests/test_colab_software.py.

`report` runs what a learner's first Colab session runs, in that environment, and writes reports/colab_software.json
and .md: the bootstrap cell of a notebook opened from GitHub (Colab's kernel has `google.colab` imported; the cell
clones the course from a local bare repository standing in for GitHub, then `helpers.start_notebook()` installs on
the first run, the real `install_on_colab`), with pip's view before and after (added / upgraded / downgraded / removed,
`pip check`) and the time; then notebooks top to bottom, smoke-sized on CPU, taking the Colab branches: the Hub model
and dataset come from a local Hugging Face cache built by scripts/local_hub.py with HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "colab"
FREEZE = FIXTURE / "pip-freeze.gpu.txt"
OS_INFO = FIXTURE / "os-info-gpu.txt"
SOURCE = FIXTURE / "SOURCE.json"
REPORT = ROOT / "reports" / "colab_software.json"

# What the course imports, in the kernel or in the programs it launches, and what Colab's kernel and frontend run
# on: each installed at Colab's version. Their own dependencies follow Colab's pins where Colab lists them.
COURSE_TOUCHES = (
    "transformers", "datasets", "accelerate", "huggingface_hub", "tokenizers", "safetensors", "hf-xet", "numpy",
    "pyarrow", "pandas", "matplotlib", "psutil", "tqdm", "pydantic", "einops", "msgpack", "py-cpuinfo", "packaging",
    "fsspec", "filelock", "requests", "httpx", "PyYAML", "regex", "sympy", "networkx", "Jinja2", "nvidia-ml-py",
    "ipykernel", "ipython", "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "jupyter_client",
    "jupyter_core", "traitlets", "notebook", "tornado", "nbformat", "nbclient", "nbconvert", "pyzmq", "comm",
    "setuptools", "wheel",
)
# Colab's frontend and kernel talk through these: the course's install must never change them (issue 21).
COLAB_FRONTEND = ("ipykernel", "ipython", "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "jupyter_client",
                  "jupyter_core", "jupyter_server", "notebook", "tornado", "traitlets", "pyzmq", "comm", "nbformat",
                  "nbclient", "nbconvert")


# Colab ships these beside the course's packages, and the course's imports reach them when present (issue 38): transformers
# imports torchvision (and its image stack) when it is installed, datasets' formatters look for torchvision, PIL and
# torchcodec in sys.modules, transformers' tokenizers and backbones for sentencepiece, tiktoken, protobuf and timm,
# accelerate and deepspeed for the rest. Found with the import log (the names the notebooks' processes asked for that
# Colab's list has). With --torch local only the ones that do not need Colab's torch are installed (STANDIN for
# torchvision).
COLAB_BESIDE = ("torchvision", "torchaudio", "torchcodec", "pillow", "timm", "sentencepiece", "tiktoken", "protobuf",
                "scipy", "scikit-learn", "triton", "torchao", "av", "soundfile", "librosa", "bitsandbytes", "peft")
# ... each needs Colab's torch release (their wheels pin it) or a GPU: not installed beside the CPU torch on disk
NEEDS_COLAB_TORCH = ("torchvision", "torchaudio", "torchcodec", "timm", "torchao", "triton", "bitsandbytes", "peft")
# module names that are not their distribution's name (for names the log saw that no installed distribution has)
MODULE_DISTRIBUTIONS = {"PIL": "pillow", "sklearn": "scikit-learn", "cv2": "opencv-python", "yaml": "pyyaml",
                        "google.protobuf": "protobuf", "attr": "attrs", "dateutil": "python-dateutil",
                        "bs4": "beautifulsoup4", "skimage": "scikit-image", "jwt": "pyjwt", "OpenSSL": "pyopenssl"}
PYENV_COLAB_PYTHON = Path.home() / ".pyenv" / "versions" / "3.13.0" / "bin" / "python3.13"

# torch 2.13.0 (the CPU build on this disk, --torch local) requires setuptools>=77.0.3; Colab's 75.2.0 is kept only with
# Colab's own torch (--torch colab)
LOCAL_TORCH_UNPINNED = ("setuptools",)


def normalize(name: str) -> str:
    """PEP 503's normalised project name (what pip compares)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def colab_pins(path: Path = FREEZE) -> dict[str, str]:
    """name (normalised) -> version from Colab's `pip freeze`; URL installs (`name @ ...`) are left out, and a local
    version label ('+cu128') is cut, so the version is the release on PyPI."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or " @ " in line or "==" not in line:
            continue
        name, version = line.split("==", 1)
        pins[normalize(name)] = version.split("+")[0]
    return pins


def fixture_source() -> dict:
    """Where the fixture came from (SOURCE.json) and what it says of the OS and Python."""
    source = json.loads(SOURCE.read_text())
    info = [ln.strip() for ln in OS_INFO.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    source["os"] = next((ln for ln in info if "Ubuntu" in ln or "Debian" in ln), "")
    source["python"] = next((ln.split()[1] for ln in info if ln.startswith("Python ")), "")
    return source


def refresh(backend_info: Path) -> None:
    """Copy a newer backend-info checkout's GPU files into the fixture and record its commit and date."""
    for name in ("pip-freeze.gpu.txt", "os-info-gpu.txt"):
        shutil.copyfile(backend_info / name, FIXTURE / name)
    git = ["git", "-C", str(backend_info), "log", "-1", "--format=%H %cI", "--", "pip-freeze.gpu.txt"]
    commit, date = subprocess.run(git, capture_output=True, text=True, check=True).stdout.split()
    SOURCE.write_text(json.dumps({"repository": "https://github.com/googlecolab/backend-info", "commit": commit,
                                  "date": date[:10], "files": ["pip-freeze.gpu.txt", "os-info-gpu.txt"]},
                                 indent=2) + "\n")
    print(f"fixture refreshed from {backend_info} at {commit[:10]} ({date[:10]})")


# ---------------------------------------------------------------------------------------------- the environment

def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def pip(venv: Path, *args: str, check: bool = True, quiet: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(venv_python(venv)), "-m", "pip", "--disable-pip-version-check", *args]
    if quiet and args and args[0] == "install":
        cmd.insert(cmd.index("install") + 1, "-q")
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def installed(venv: Path) -> dict[str, str]:
    """name (normalised) -> version of every distribution in the venv (pip list)."""
    out = pip(venv, "list", "--format=json")
    return {normalize(d["name"]): d["version"] for d in json.loads(out.stdout)}


def pip_check(venv: Path) -> list[str]:
    """`pip check`'s complaints (empty when every requirement is met)."""
    out = pip(venv, "check", check=False)
    return [ln for ln in out.stdout.splitlines() if ln.strip() and not ln.startswith("No broken requirements")]


def torch_spec(mode: str, pins: dict[str, str]) -> str:
    """torch for the venv: Colab's release ('colab', PyPI's CUDA build) or the CPU build on this disk ('local')."""
    if mode == "colab":
        return f"torch=={pins['torch']}"
    if mode == "local":
        return f"torch=={os.environ.get('DS_COURSE_LOCAL_TORCH', '2.13.0')}"
    raise ValueError(f"--torch must be 'colab' or 'local' (got {mode!r})")


def default_python(torch: str) -> str:
    """Colab's Python (3.13, pyenv's) for the report with Colab's torch; this one for the CPU torch on disk (cp311)."""
    if torch == "colab" and PYENV_COLAB_PYTHON.exists():
        return str(PYENV_COLAB_PYTHON)
    return sys.executable


BESIDE_MODES = ("all", "listed", "none")


PYPI_SIMPLE = "https://pypi.org/simple"


def wheel_or_sdist(venv: Path, specs: list[str]) -> dict[str, str]:
    """For each `name==version`, what PyPI has of that release for the venv's Python and platform: 'wheel', 'sdist'
    or 'none' (PyPI's simple JSON index, fetched in parallel; 'unknown' where the index could not be read)."""
    import concurrent.futures
    import urllib.request

    code = "import json; from packaging import tags; print(json.dumps([str(t) for t in tags.sys_tags()]))"
    supported = set(json.loads(subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True,
                                              check=True).stdout))
    from packaging.utils import parse_sdist_filename, parse_wheel_filename
    from packaging.version import Version

    def look(spec: str) -> tuple[str, str]:
        name, version = spec.split("==")
        req = urllib.request.Request(f"{PYPI_SIMPLE}/{normalize(name)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                files = json.load(r)["files"]
        except Exception:  # noqa: BLE001 (no index: pip decides)
            return spec, "unknown"
        kind = "none"
        for f in files:
            fn = f["filename"]
            try:
                if fn.endswith(".whl"):
                    _, v, _, tags_ = parse_wheel_filename(fn)
                    if v == Version(version) and any(str(t) in supported for t in tags_):
                        return spec, "wheel"
                elif fn.endswith((".tar.gz", ".zip")):
                    if parse_sdist_filename(fn)[1] == Version(version):
                        kind = "sdist"
            except Exception:  # noqa: BLE001 (a file name the standard does not parse)
                continue
        return spec, kind

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        return dict(pool.map(look, specs))


def install_all_you_can(venv: Path, specs: list[str]) -> dict[str, str]:
    """Install Colab's exact versions `specs` without their dependencies (Colab's list holds them): every one with a
    wheel for this Python and platform, in one pip call. Returns name -> why it was not installed."""
    found = wheel_or_sdist(venv, specs)
    failed = {s.split("==")[0]: "PyPI has no file of Colab's version for this Python and platform"
              for s, k in found.items() if k == "none"}
    todo = [s for s, k in found.items() if k in ("wheel", "unknown")]
    while todo:  # a wheel the index listed that pip still refuses: drop it with pip's reason, install the rest
        out = pip(venv, "install", "--no-deps", "--only-binary=:all:", *todo, check=False)
        if out.returncode == 0:
            break
        bad = re.search(r"(?:No matching distribution found for|satisfies the requirement) ([A-Za-z0-9_.\-]+)",
                        out.stderr)
        name = normalize(bad.group(1)) if bad else ""
        if not any(normalize(t.split("==")[0]) == name for t in todo):
            last = (out.stderr.strip().splitlines() or ["failed"])[-1][:300]
            failed.update({t.split("==")[0]: "pip: " + last for t in todo})
            break
        failed[name] = "pip: " + (out.stderr.strip().splitlines() or ["failed"])[-1][:300]
        todo = [t for t in todo if normalize(t.split("==")[0]) != name]
    failed.update({s.split("==")[0]: "PyPI has only its source for this Python (Colab's image built it; not built here: "
                                     "dlib, gdal, rpy2 and others need system libraries or minutes of compiling)"
                   for s, k in found.items() if k == "sdist"})
    return failed


def build_env(venv: Path, torch: str = "local", python: str | None = None, beside: str = "listed") -> dict:
    """A fresh venv at `venv` with Colab's versions of COURSE_TOUCHES (and their dependencies where Colab pins them),
    torch per `torch_spec`, and beside them (`beside`): 'listed', the COLAB_BESIDE packages this torch allows; 'all',
    every package of Colab's list that has a wheel for this Python (with Colab's torch only: ~700, the CUDA packages
    aside, which PyPI's torch brings in its own versions); 'none'. Returns what was made (versions, what could not be
    installed and why, seconds)."""
    if beside not in BESIDE_MODES or (beside == "all" and torch != "colab"):
        raise ValueError(f"beside={beside!r} with torch={torch!r}: one of {BESIDE_MODES}; 'all' needs torch='colab' "
                         "(Colab's other packages pin its torch)")
    pins = colab_pins()
    python = python or default_python(torch)
    if torch == "local":  # the CPU torch on disk (2.13) needs a newer setuptools than Colab's (75.2): pip's choice
        pins = {n: v for n, v in pins.items() if n not in LOCAL_TORCH_UNPINNED}
    # Colab's torch is the cu128 build with CUDA 12 packages; PyPI's torch of that release is a CUDA 13 build with its
    # own: torch chooses its CUDA packages (they are not what the course touches, and there is no GPU here)
    pins = {n: v for n, v in pins.items() if not (n.startswith(("nvidia-", "cuda-")) and n != "nvidia-ml-py")}
    start = time.perf_counter()
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([python or sys.executable, "-m", "venv", str(venv)], check=True)
    venv.mkdir(parents=True, exist_ok=True)
    constraints = venv / "colab-constraints.txt"  # Colab's pins of everything it lists, torch aside
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items()) if n not in ("torch", "pip")))
    pip(venv, "install", f"pip=={pins.get('pip', '24.1.2')}")
    pip(venv, "install", f"numpy=={pins['numpy']}")  # before torch, which warns when it starts without numpy
    pip(venv, "install", torch_spec(torch, pins), "-c", str(constraints))
    wanted = [f"{n}=={pins[normalize(n)]}" for n in COURSE_TOUCHES if normalize(n) in pins]
    missing = [n for n in COURSE_TOUCHES if normalize(n) not in colab_pins()]
    pip(venv, "install", *wanted, "-c", str(constraints))
    not_installed: dict[str, str] = {}
    beside_names = list(COLAB_BESIDE)
    if beside == "all":
        done = {normalize(n) for n in ("torch", "pip", "numpy", *COURSE_TOUCHES)}
        excluded = sorted(n for n in colab_pins() if n not in pins)  # the CUDA packages
        not_installed.update({n: "a CUDA package: PyPI's torch brings its own CUDA 13 build's" for n in excluded})
        rest = sorted(n for n in pins if n not in done)
        not_installed.update(install_all_you_can(venv, [f"{n}=={pins[n]}" for n in rest]))
        beside_names = [n for n in rest if n not in not_installed]
    elif beside == "listed":
        for name in COLAB_BESIDE:
            if normalize(name) not in pins:
                not_installed[name] = "not in Colab's list"
            elif torch != "colab" and name in NEEDS_COLAB_TORCH:
                not_installed[name] = (f"needs Colab's torch {pins['torch']} (its wheels pin it); the CPU torch on disk "
                                       "is another release" + ("; a stand-in is imported instead (STANDIN)"
                                                               if name in STANDIN else ""))
            else:
                out = pip(venv, "install", f"{name}=={pins[normalize(name)]}", "-c", str(constraints), check=False)
                if out.returncode != 0:
                    not_installed[name] = "pip: " + (out.stderr.strip().splitlines() or ["failed"])[-1][:300]
    have = installed(venv)
    colab = colab_pins()
    off = {n: {"here": have[n], "colab": colab[n]} for n in have if n in colab and have[n] != colab[n]}
    return {"venv": str(venv), "python": subprocess.run([str(venv_python(venv)), "-c",
                                                          "import platform; print(platform.python_version())"],
                                                         capture_output=True, text=True).stdout.strip(),
            "torch": have.get("torch"), "torch_mode": torch, "packages": len(have),
            "not_in_colab": sorted(n for n in have if n not in colab),
            "beside": beside,
            "beside_installed": {n: have[normalize(n)] for n in beside_names if normalize(n) in have},
            "beside_not_installed": not_installed,
            "course_packages_colab_lacks": missing, "differs_from_colab": off,
            "seconds": round(time.perf_counter() - start, 1)}


# What the GPU emulation installs at Colab's versions over the GPU machine's image. The image already has Colab's torch
# release (2.11) and torchvision 0.26.0, sentencepiece 0.2.2, tiktoken 0.14.0, safetensors 0.8.0 (Colab's too), pillow,
# torchaudio and the rest of COLAB_BESIDE, but newer transformers, accelerate, datasets and huggingface_hub: those, and
# what pins them, travel as wheels (the bundle's 64 MiB limit rules out carrying the rest). scripts/gpu_evidence.sh
# prints the versions it ran with.
GPU_COLAB_NAMES = ("transformers", "datasets", "accelerate", "huggingface_hub", "tokenizers", "hf-xet", "fsspec", "dill",
                   "multiprocess", "xxhash", "timm", "protobuf")


def gpu_wheels(folder: Path, python_version: str = "3.12") -> dict[str, str]:
    """Download Colab's versions of GPU_COLAB_NAMES as wheels for the GPU machine's Python into `folder` (the GPU bundle,
    .gpu-bundle/whl), replacing any other version of them there; returns name -> version."""
    pins, done = colab_pins(), {}
    platforms = [a for p in ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64",
                             "manylinux_2_34_x86_64", "manylinux_2_27_x86_64") for a in ("--platform", p)]
    for name in GPU_COLAB_NAMES:
        stem = normalize(name).replace("-", "_")
        for old in folder.glob("*.whl"):
            if normalize(old.name.split("-")[0]).replace("-", "_") == stem:
                old.unlink()
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python_version, "--implementation", "cp", *platforms, "-d", str(folder), f"{name}=={pins[normalize(name)]}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        done[name] = pins[normalize(name)]
    return done


# ------------------------------------------------------------------ a learner's first Colab session, emulated

# Colab's kernel has google.colab imported from its start; the bootstrap cell looks for it to decide to clone. This
# IPython startup file puts a stand-in there (nothing of its API: the course uses none).
COLAB_STARTUP = """import importlib.machinery, sys, types
try:
    import google
except ImportError:
    google = types.ModuleType("google")
    google.__path__ = []
    google.__spec__ = importlib.machinery.ModuleSpec("google", None, is_package=True)
    sys.modules["google"] = google
_colab = types.ModuleType("google.colab")
_colab.__spec__ = importlib.machinery.ModuleSpec("google.colab", None)  # importlib.util.find_spec reads it
sys.modules["google.colab"] = _colab
google.colab = _colab
"""
# A stand-in for torchvision 0.26 where no real one installs (--torch local, CI). On Colab transformers imports
# torchvision.io, .transforms, .transforms.functional and .transforms.v2 when pillow and torchvision are present (image
# utilities, loaded with the loss functions of any model), so every torchvision.* module imports here and every name in
# it is a placeholder; the one name 0.26 no longer has is missing, as on Colab: torchvision.io.VideoReader, which
# datasets 4.0.0's tensor formatters import once torchvision is imported (huggingface/datasets#8085, issue 38).
STANDIN_TORCHVISION = '''"""A stand-in for torchvision 0.26 (scripts/colab_software.py, CI only): every module imports, every name is a
placeholder that refuses to be called, except torchvision.io.VideoReader, which 0.26 no longer has (pytorch/vision#9373)."""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.26.0"  # transformers parses it where the distribution has no metadata
ABSENT = {"torchvision.io": {"VideoReader"}}


class Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = Placeholder(f"{cls.__name__}.{name}", (), {"__module__": cls.__module__})
        setattr(cls, name, value)  # the same object every time: enum members compare and hash
        return value

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"{cls.__module__}.{cls.__name__} is a placeholder of the torchvision stand-in "
                                  "(scripts/colab_software.py): the course calls no torchvision code")


class StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") or name in ABSENT.get(self.__name__, ()):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        if name in SUBMODULES:  # `from torchvision import io` imports the module, as the real package's does
            return importlib.import_module(f"{self.__name__}.{name}")
        value = Placeholder(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


SUBMODULES = {"io", "transforms", "functional", "v2", "models", "ops", "datasets", "utils", "tv_tensors", "extension"}


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        parts = name.split(".")
        if parts[0] == __name__ and len(parts) > 1 and set(parts[1:]) <= SUBMODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandInModule(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, Finder())
sys.modules[__name__].__class__ = StandInModule
'''
STANDIN = {"torchvision": {"__init__.py": STANDIN_TORCHVISION}}
# sitecustomize for every Python process of the session: logs each top-level module and distribution name asked for
IMPORT_LOG_CODE = """import os, sys
_log_dir = os.environ.get("DS_COURSE_IMPORT_LOG")
if _log_dir:
    class _AskedFor:
        seen = set()

        def _note(self, name):
            if name and name not in self.seen:
                self.seen.add(name)
                try:
                    with open(os.path.join(_log_dir, f"{os.getpid()}.txt"), "a") as f:
                        f.write(name + "\\n")
                except OSError:
                    pass

        def find_spec(self, name, path=None, target=None):
            self._note(name.split(".")[0])
            return None

        def find_distributions(self, context=None):
            if getattr(context, "name", None):
                self._note("dist:" + context.name)
            return iter(())

        def invalidate_caches(self):
            pass

    sys.meta_path.insert(0, _AskedFor())
"""
PROBE_MODULES = ("import json, sys\n"
                 "print('IMPORTED=' + json.dumps(sorted({m.split('.')[0] for m in list(sys.modules)})))")
PROBE_END = ("import json, sys\n"
             "print('MODULES=' + json.dumps(sorted({m.split('.')[0] for m in list(sys.modules)})))")
PROBE_AFTER = ("import json, helpers, deepspeed, transformers, datasets, accelerate, torch\n"
               "print('LOADED=' + json.dumps({'helpers': str(helpers.bootstrap.course_root()),\n"
               "    'deepspeed': deepspeed.__version__,\n"
               "    'transformers': transformers.__version__, 'datasets': datasets.__version__,\n"
               "    'accelerate': accelerate.__version__, 'torch': torch.__version__}))")


def emulated_bootstrap(repo_url: str, content: Path) -> str:
    """The notebooks' bootstrap cell with the course's address and Colab's /content pointed at a local bare repository
    and a folder of the test's: the two values the cell writes once, replaced only here."""
    sys.path.insert(0, str(ROOT))
    from helpers.bootstrap import BOOTSTRAP_CELL

    address = re.search(r'^COURSE_REPO = "([^"]+)"', BOOTSTRAP_CELL, flags=re.M).group(1)
    cell = BOOTSTRAP_CELL
    for old, new in ((f'COURSE_REPO = "{address}"', f'COURSE_REPO = "{repo_url}"'),
                     ('pathlib.Path("/content/deepspeed-course")', f'pathlib.Path("{content}/deepspeed-course")')):
        if cell.count(old) != 1:
            raise RuntimeError(f"the bootstrap cell no longer holds {old!r} once: update emulated_bootstrap")
        cell = cell.replace(old, new)
    return cell


class ColabSession:
    """A kernel of `venv` that looks like Colab's to the course: google.colab imported, COLAB_RELEASE_TAG set, cwd a
    'content' folder without the course, the NVMe folder and the Hugging Face cache the test's. Notebooks run from
    copies in that folder with the emulated bootstrap cell."""

    def __init__(self, venv: Path, work: Path, hf_env: dict[str, str], standins: tuple[str, ...] = ()):
        self.venv, self.work = venv.resolve(), work.resolve()
        if any((d / "helpers" / "__init__.py").is_file() for d in [self.work, *self.work.parents]):
            raise ValueError(f"{work} is inside a checkout of the course: the bootstrap cell would find that checkout "
                             "instead of cloning. Fix: a work folder outside it, e.g. under /tmp")
        self.content = self.work / "content"
        self.content.mkdir(parents=True, exist_ok=True)
        bare = self.work / "github" / "deepspeed-course.git"  # stands in for GitHub: the committed course
        if not bare.exists():
            subprocess.run(["git", "clone", "-q", "--bare", str(ROOT), str(bare)], check=True)
        self.repo_url = f"file://{bare}"
        startup = self.work / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True, exist_ok=True)
        (startup / "00-google-colab.py").write_text(COLAB_STARTUP)
        site = self.work / "site"  # sitecustomize (the import log) and the stand-ins, on every process's path
        for name in standins:
            for rel, text in STANDIN[name].items():
                (site / name / rel).parent.mkdir(parents=True, exist_ok=True)
                (site / name / rel).write_text(text)
        site.mkdir(parents=True, exist_ok=True)
        (site / "sitecustomize.py").write_text(IMPORT_LOG_CODE)
        if standins:  # imported first, as transformers imports torchvision on Colab before any data is read
            (startup / "01-import-standins.py").write_text("".join(f"import {n}\n" for n in standins))
        self.import_log = self.work / "import-log"
        self.import_log.mkdir(exist_ok=True)
        spec = self.work / "jupyter" / "kernels" / "colab-emulated"
        spec.mkdir(parents=True, exist_ok=True)
        env = {"COLAB_RELEASE_TAG": "emulated-by-scripts-colab_software", "IPYTHONDIR": str(self.work / "ipython"),
               "DS_COURSE_NVME_DIR": str(self.work / "nvme"), "DS_COURSE_SAVED_RUN": "1",
               "TORCH_EXTENSIONS_DIR": str(self.work / "torch_extensions"), "PYTHONNOUSERSITE": "1",
               "PYTHONPATH": str(site), "DS_COURSE_IMPORT_LOG": str(self.import_log), **hf_env}
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [str(venv_python(self.venv)), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (Colab software, emulated)", "language": "python", "env": env}))
        self.bootstrap = emulated_bootstrap(self.repo_url, self.content)

    def run(self, cells: list[str], name: str, timeout_s: int = 3600) -> dict:
        """Run `cells` as a notebook `name` in a fresh kernel; seconds per cell, outputs' text, the error if any."""
        import nbformat

        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        return self._execute(nb, name, timeout_s)

    def run_notebook(self, path: Path, timeout_s: int = 3600) -> dict:
        """A course notebook as opened from GitHub in Colab: a copy in 'content', the emulated bootstrap."""
        import nbformat

        from helpers.bootstrap import BOOTSTRAP_CELL

        nb = nbformat.read(path, as_version=4)
        boot = [c for c in nb.cells if c.cell_type == "code" and c.source == BOOTSTRAP_CELL]
        if len(boot) != 1:
            raise RuntimeError(f"{path.name} has {len(boot)} bootstrap cells (helpers.bootstrap.BOOTSTRAP_CELL): "
                               "run scripts/apply_bootstrap.py")
        boot[0].source = self.bootstrap
        nb.cells.append(nbformat.v4.new_code_cell(PROBE_END))  # the kernel's modules at the end (after a pass)
        for old in self.import_log.glob("*.txt"):  # the log is this notebook's processes' only
            old.unlink()
        result = self._execute(nb, path.name, timeout_s)
        result["modules"] = _tagged(result["text"], "MODULES") or []
        result["asked"] = sorted({ln.strip() for f in self.import_log.glob("*.txt") for ln in f.read_text().split()})
        return result

    def _execute(self, nb, name: str, timeout_s: int) -> dict:
        import nbformat
        from nbclient import NotebookClient

        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(self.work / "jupyter"),
                                                                   os.environ.get("JUPYTER_PATH")]))
        client = NotebookClient(nb, timeout=timeout_s, kernel_name="colab-emulated",
                                resources={"metadata": {"path": str(self.content)}},
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
        seconds: list[float] = []
        error, start = "", time.perf_counter()
        try:
            with client.setup_kernel():
                for index, cell in enumerate(nb.cells):
                    if cell.cell_type == "code":
                        t = time.perf_counter()
                        client.execute_cell(cell, index)
                        seconds.append(round(time.perf_counter() - t, 1))
        except Exception as exc:  # CellExecutionError carries the traceback
            error = f"{type(exc).__name__}: {exc}"[-4000:]
        out_dir = self.work / "executed"
        out_dir.mkdir(exist_ok=True)
        nbformat.write(nb, out_dir / (name if name.endswith(".ipynb") else f"{name}.ipynb"))
        text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                         for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
        return {"passed": not error, "seconds": round(time.perf_counter() - start, 1), "cell_seconds": seconds,
                "error": error, "text": text}


def _tagged(text: str, tag: str) -> object:
    line = next((ln for ln in text.splitlines() if ln.startswith(tag + "=")), None)
    return json.loads(line[len(tag) + 1:]) if line else None


def venv_modules(venv: Path) -> dict[str, list[str]]:
    """top-level module -> distributions providing it, in `venv` (importlib.metadata.packages_distributions), plus the
    standard library's modules (mapped to [])."""
    code = ("import json, sys, importlib.metadata as m; d = {k: v for k, v in m.packages_distributions().items()}; "
            "d.update({n: [] for n in sys.stdlib_module_names if n not in d}); print(json.dumps(d))")
    out = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def beside_missing(asked: list[str], modules: dict[str, list[str]], have: dict[str, str],
                   colab: dict[str, str]) -> dict[str, str]:
    """What a notebook's processes asked for (module names, and 'dist:NAME' for importlib.metadata look-ups) that Colab's
    list has and the environment lacks: distribution -> Colab's version. On Colab these would be found, and imported."""
    missing = {}
    for entry in asked:
        if entry.startswith("dist:"):
            dist = normalize(entry[5:])
            if dist not in have and dist in colab:
                missing[dist] = colab[dist]
        elif entry not in modules and not entry.startswith("_"):
            dist = normalize(MODULE_DISTRIBUTIONS.get(entry, entry))
            if dist not in have and dist in colab:
                missing[dist] = colab[dist]
    return dict(sorted(missing.items()))


def diff_packages(before: dict[str, str], after: dict[str, str]) -> dict:
    """added / removed / upgraded / downgraded between two `installed` views."""
    from packaging.version import InvalidVersion, Version

    def newer(a: str, b: str) -> bool:
        try:
            return Version(a) > Version(b)
        except InvalidVersion:
            return a > b

    changed = {n: (before[n], after[n]) for n in before.keys() & after.keys() if before[n] != after[n]}
    return {"added": {n: after[n] for n in sorted(after.keys() - before.keys())},
            "removed": {n: before[n] for n in sorted(before.keys() - after.keys())},
            "upgraded": {n: {"from": a, "to": b} for n, (a, b) in sorted(changed.items()) if newer(b, a)},
            "downgraded": {n: {"from": a, "to": b} for n, (a, b) in sorted(changed.items()) if not newer(b, a)}}


def restart_needed(changes: dict, imported: list[str], venv: Path) -> list[str]:
    """Distributions the install changed whose modules the kernel had imported before it: Colab keeps running the
    old code until "Runtime > Restart session"."""
    code = ("import json, importlib.metadata as m; print(json.dumps({k: v for k, v in "
            "m.packages_distributions().items()}))")
    out = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True, check=True)
    modules_of: dict[str, set[str]] = {}
    for mod, dists in json.loads(out.stdout).items():
        for d in dists:
            modules_of.setdefault(normalize(d), set()).add(mod)
    touched = set(changes["upgraded"]) | set(changes["downgraded"]) | set(changes["removed"])
    return sorted(n for n in touched if modules_of.get(n, set()) & set(imported))


def install_step(venv: Path, session: ColabSession) -> dict:
    """The first notebook's bootstrap cell on a fresh 'VM': clone, install (helpers.bootstrap.install_on_colab),
    import; pip's view before and after."""
    before, check_before = installed(venv), pip_check(venv)
    result = session.run([PROBE_MODULES, session.bootstrap, PROBE_AFTER], "install")
    after, check_after = installed(venv), pip_check(venv)
    changes = diff_packages(before, after)
    imported = _tagged(result["text"], "IMPORTED") or []
    frontend = {normalize(n) for n in COLAB_FRONTEND}
    touched = {**changes["upgraded"], **changes["downgraded"], **changes["removed"]}
    colab = colab_pins()
    majors = {n: c for n, c in {**changes["upgraded"], **changes["downgraded"]}.items()
              if n in colab and c["from"].split(".")[0] != c["to"].split(".")[0]}
    return {"passed": result["passed"], "error": result["error"][-2000:],
            "bootstrap_seconds": result["cell_seconds"][1] if len(result["cell_seconds"]) > 1 else None,
            "loaded": _tagged(result["text"], "LOADED"), "changes": changes,
            "counts": {k: len(v) for k, v in changes.items()},
            "frontend_packages_changed": sorted(n for n in touched if n in frontend),
            "major_versions_changed": majors, "restart_needed_for": restart_needed(changes, imported, venv),
            "pip_check_before": check_before, "pip_check_after": check_after,
            "printed": [ln for ln in result["text"].splitlines() if ln.strip() and not ln.startswith(("IMPORTED=",
                                                                                                  "LOADED="))][:40]}


def report(torch: str, notebooks: list[str], work: Path, install_only: bool = False, label: str = "",
           python: str | None = None, beside: str = "listed") -> dict:
    """Build the environment, run the install step and the notebooks; returns the report's entry for this run."""
    import local_hub  # scripts/

    work.mkdir(parents=True, exist_ok=True)
    venv = work / "venv"
    env_info = build_env(venv, torch, python=python, beside=beside)
    hub_home = work / "hf-home"
    hub_info = subprocess.run([str(venv_python(venv)), str(ROOT / "scripts" / "local_hub.py"), str(hub_home),
                               "--model-size", "gpt2-tiny"], capture_output=True, text=True, cwd=ROOT)
    if hub_info.returncode != 0:
        raise RuntimeError(f"local_hub.py failed:\n{hub_info.stderr[-3000:]}")
    standins = tuple(n for n in STANDIN if n in env_info["beside_not_installed"]) if beside == "listed" else ()
    session = ColabSession(venv, work, local_hub.environment(hub_home), standins=standins)
    env_info["standins"] = list(standins)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    entry = {"label": label or f"torch {torch}", "date": dt.date.today().isoformat(), "course_commit": commit.strip(),
             "environment": env_info, "install": install_step(venv, session), "notebooks": {}}
    print(json.dumps({k: entry["install"][k] for k in ("passed", "bootstrap_seconds", "counts",
                                                         "frontend_packages_changed", "restart_needed_for",
                                                         "pip_check_after")}, indent=1), flush=True)
    if install_only or not entry["install"]["passed"]:
        return entry
    modules = venv_modules(venv)
    for nn in notebooks:
        path = next(p for folder in ("notebooks", "notebooks/drafts")  # a draft (a lesson before its GPU run) too
                    for p in sorted((ROOT / folder).glob(f"{nn}_*.ipynb")))
        result = session.run_notebook(path)
        have, colab = installed(venv), colab_pins()
        entry["notebooks"][path.name] = {"passed": result["passed"], "seconds": result["seconds"],
                                         "error": result["error"][-2000:],
                                         "kernel_modules": len(result["modules"]),
                                         "beside_imported": sorted(
                                             n for n in COLAB_BESIDE if normalize(n) in have and any(
                                                 normalize(d) == normalize(n) for m in result["modules"]
                                                 for d in modules.get(m, []))),
                                         "beside_missing": beside_missing(result["asked"], modules, have, colab),
                                         "branch": next((ln for ln in result["text"].splitlines()
                                                         if ln.startswith(("Colab's branch", "no Hugging Face Hub"))),
                                                        "")}
        print(f"{path.name}: {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s", flush=True)
        if result["error"]:
            print(result["error"][-3000:], flush=True)
    return entry


def browser_results() -> dict[str, str]:
    """scripts/browser_test.py in classic Notebook 6.5.7 on Colab's widget versions (its venv is built first when
    missing) and in JupyterLab 4 / Notebook 7 on this checkout's: passed or failed, seconds, date."""
    env = ROOT / "build" / "colab-widgets-env"
    if not venv_python(env).exists():
        build_env(env, "local")
        pip(env, "install", "deepspeed==0.19.8", "-c", str(env / "colab-constraints.txt"))
        pip(env, "install", "--no-deps", "--no-build-isolation", "-e", str(ROOT))
    results = {}
    for label, extra in (("classic Notebook 6.5.7, ipywidgets 7.7.1 (Colab's kernel-side versions)", ["--classic"]),
                         ("JupyterLab 4 and Notebook 7, ipywidgets 8 (this checkout's .venv)", [])):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "browser_test.py"), *extra],
                             capture_output=True, text=True, cwd=ROOT)
        seconds = time.perf_counter() - start
        tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or [""]
        results[label] = (f"{'passed' if out.returncode == 0 else 'FAILED'} in {seconds:.0f} s on "
                          f"{dt.date.today().isoformat()}" + ("" if out.returncode == 0 else f": {tail[0][:300]}"))
    return results


NOT_EMULATED = [
    "Python's patch release: Colab runs {python}; the report's runs with Colab's torch use pyenv's 3.13.0 on this "
    "machine image (CI's run: 3.11, beside the CPU torch on disk)",
    "Colab's ~700 packages in full: the full run (colab_full) holds every package of Colab's list with a wheel for "
    "its Python, at Colab's versions; not the CUDA packages (PyPI's torch brings its CUDA 13 set, Colab's is cu128) "
    "nor those PyPI has only as source (dlib, gdal, rpy2, ...; the run lists them). CI's run holds Colab's versions "
    "of what the course touches and of COLAB_BESIDE that install beside the CPU torch, with a stand-in torchvision",
    "Colab's own frontend (its output frames, its widget manager, its file browser): the browser test runs classic "
    "Notebook 6.5.7 with Colab's ipywidgets 7.7.1 and widgetsnbextension 3.6.10 instead",
    "the GPU and CUDA: the notebooks run smoke-sized on the CPU (the GPU emulation, reports/gpu_check.json, runs "
    "Colab's transformers, datasets, accelerate, huggingface_hub, tokenizers and timm beside the GPU image's torch "
    "2.11 and torchvision 0.26)",
    "the network: GitHub is a local bare repository of the committed course, the Hugging Face Hub a local cache "
    "(scripts/local_hub.py) read with HF_HUB_OFFLINE=1, and PyPI is the real one",
]


def markdown(data: dict) -> str:
    """reports/colab_software.md from the JSON."""
    fx = data["fixture"]
    lines = ["# The course under Colab's software (issues 21 and 38)", "",
             f"Colab's package list: `{'`, `'.join(fx['files'])}` of {fx['repository']} at commit "
             f"`{fx['commit'][:10]}` ({fx['date']}): {fx['os']}, Python {fx['python']}. Made by "
             "`python scripts/colab_software.py report` (see its docstring); the JSON beside this file has every "
             "package.", ""]
    for key, run in data.get("runs", {}).items():
        env, ins = run["environment"], run["install"]
        lines += [f"## {key} ({run['date']}, course commit `{run['course_commit'][:10]}`)", "",
                  f"Environment: {env['packages']} packages at Colab's versions in {env['seconds']:.0f} s, Python "
                  f"{env['python']}, torch {env['torch']} ({'Colab' if env['torch_mode'] == 'colab' else 'not Colab'}"
                  f"'s release{'; PyPI build, CUDA 13, on the CPU' if env['torch_mode'] == 'colab' else ''}). "
                  "Differs from Colab's list: " + (", ".join(f"{n} {d['here']} (Colab {d['colab']})"
                                                            for n, d in env["differs_from_colab"].items()) or "nothing")
                  + ".", ""]
        if env.get("beside") == "all":
            why: dict[str, list[str]] = {}
            for n, reason in env["beside_not_installed"].items():
                why.setdefault(reason, []).append(n)
            lines += [f"Beside the course's packages: every other package of Colab's list that has a wheel for Python "
                      f"{env['python']}, at Colab's versions, without their dependencies (Colab's list holds them): "
                      f"{len(env['beside_installed'])} installed, among them "
                      + ", ".join(f"{n} {env['beside_installed'][n]}" for n in COLAB_BESIDE
                                  if n in env["beside_installed"]) + ". Not installed:", ""]
            lines += [f"- {reason}: {', '.join(sorted(names))}" for reason, names in why.items()] + [""]
        elif env.get("beside_installed") is not None:
            lines += ["Beside the course's packages (what its imports reach on Colab when present), at Colab's versions: "
                      + (", ".join(f"{n} {v}" for n, v in env["beside_installed"].items()) or "none") + ". Not installed: "
                      + ("; ".join(f"{n} ({why})" for n, why in env["beside_not_installed"].items()) or "none")
                      + "." + (f" Stand-ins imported first by the kernel: {', '.join(env['standins'])}."
                               if env.get("standins") else ""), ""]
        counts = ins["counts"]
        lines += [f"Install (the bootstrap cell on a fresh VM: clone, `install_on_colab`, import): "
                  f"{'passed' if ins['passed'] else 'FAILED'}, {ins['bootstrap_seconds']} s. Added {counts['added']}, "
                  f"upgraded {counts['upgraded']}, downgraded {counts['downgraded']}, removed {counts['removed']}.", ""]
        ch = ins["changes"]
        if ch["added"]:
            lines.append("- added: " + ", ".join(f"{n} {v}" for n, v in ch["added"].items()))
        for kind in ("upgraded", "downgraded"):
            if ch[kind]:
                lines.append(f"- {kind}: " + ", ".join(f"{n} {c['from']} -> {c['to']}" for n, c in ch[kind].items()))
        if ch["removed"]:
            lines.append("- removed: " + ", ".join(f"{n} {v}" for n, v in ch["removed"].items()))
        lines += [f"- Colab frontend packages changed: {', '.join(ins['frontend_packages_changed']) or 'none'}",
                  "- major versions of Colab's packages changed: " + (", ".join(
                      f"{n} {c['from']} -> {c['to']}" for n, c in ins["major_versions_changed"].items()) or "none"),
                  "- restart needed (changed packages the kernel had imported before the install): "
                  + (", ".join(ins["restart_needed_for"]) or "no"),
                  f"- `pip check` before: {'; '.join(ins['pip_check_before']) or 'no broken requirements'}",
                  f"- `pip check` after: {'; '.join(ins['pip_check_after']) or 'no broken requirements'}", ""]
        if ins.get("loaded"):
            lines += ["Imported after the install: " + ", ".join(f"{k} {v}" for k, v in ins["loaded"].items()
                                                                  if k != "helpers") + ".", ""]
        if run["notebooks"]:
            lines += ["| notebook | result | seconds (CPU, smoke-sized) | branch | COLAB_BESIDE packages "
                      "it imported | asked for, Colab has, missing here |", "|---|---|---|---|---|---|"]
            lines += [f"| {n} | {'passed' if e['passed'] else 'FAILED'} | {e['seconds']:.0f} | {e['branch'] or '-'} | "
                      f"{', '.join(e.get('beside_imported', [])) or '-'} | "
                      f"{', '.join(f'{d} {v}' for d, v in e.get('beside_missing', {}).items()) or '-'} |"
                      for n, e in run["notebooks"].items()]
            lines.append("")
            failed = {n: e["error"] for n, e in run["notebooks"].items() if not e["passed"]}
            for n, err in failed.items():
                last = [ln for ln in err.splitlines() if ln.strip()][-1:] or [""]
                lines += [f"- {n} failed: `{last[0][:300]}`"]
            if failed:
                lines.append("")
    if data.get("browser_test"):
        lines += ["## Widgets in a browser", ""] + [f"- {k}: {v}" for k, v in data["browser_test"].items()] + [""]
    lines += ["## Not emulated", ""] + [f"- {n.format(python=fx['python'])}" for n in NOT_EMULATED] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("versions", help="Colab's pins of the named packages")
    v.add_argument("names", nargs="*")
    b = sub.add_parser("build-env", help="a venv with Colab's versions")
    b.add_argument("venv", type=Path)
    b.add_argument("--torch", default="local", choices=["local", "colab"])
    r = sub.add_parser("refresh", help="copy a newer googlecolab/backend-info checkout into the fixture")
    r.add_argument("backend_info", type=Path)
    rep = sub.add_parser("report", help="the emulated first Colab session; writes reports/colab_software.json")
    rep.add_argument("--torch", default="colab", choices=["local", "colab"])
    rep.add_argument("--notebooks", nargs="*", default=sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    rep.add_argument("--install-only", action="store_true")
    rep.add_argument("--python", default=None, help="the venv's interpreter (default: pyenv's 3.13.0 with --torch "
                                                    "colab, else this Python)")
    rep.add_argument("--beside", choices=BESIDE_MODES, default=None,
                     help="what else of Colab's list: 'all' (default with --torch colab: every package with a wheel), "
                          "'listed' (COLAB_BESIDE; default with --torch local), 'none' (issue 21's environment)")
    rep.add_argument("--work", type=Path, default=None,
                     help="folder for the venv and the session, outside the checkout (default: a new one in /tmp)")
    rep.add_argument("--key", default="after_fix", help="the report's entry to write (e.g. before_fix)")
    rep.add_argument("--out", type=Path, default=REPORT)
    g = sub.add_parser("gpu-wheels", help="Colab's versions of GPU_COLAB_NAMES as wheels for the GPU bundle")
    g.add_argument("folder", type=Path, nargs="?", default=ROOT / ".gpu-bundle" / "whl")
    br = sub.add_parser("browser", help="run scripts/browser_test.py in both modes and record the result")
    br.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args(argv)
    if args.command == "versions":
        pins = colab_pins()
        for name in args.names or sorted(pins):
            print(f"{name}=={pins[normalize(name)]}" if normalize(name) in pins else f"# {name}: not in Colab's list")
    elif args.command == "build-env":
        print(json.dumps(build_env(args.venv, args.torch), indent=2))
    elif args.command == "gpu-wheels":
        print(json.dumps(gpu_wheels(args.folder)))
    elif args.command == "refresh":
        refresh(args.backend_info)
    elif args.command == "browser":
        data = json.loads(args.out.read_text())
        data["browser_test"] = browser_results()
        args.out.write_text(json.dumps(data, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(data))
        print(json.dumps(data["browser_test"], indent=1))
        return 0 if all(r.startswith("passed") for r in data["browser_test"].values()) else 1
    elif args.command == "report":
        work = args.work or Path(tempfile.mkdtemp(prefix="colab-software-"))
        entry = report(args.torch, args.notebooks, work, args.install_only, label=args.key, python=args.python,
                       beside=args.beside or ("all" if args.torch == "colab" else "listed"))
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        data["fixture"] = fixture_source()
        data.setdefault("runs", {})[args.key] = entry
        args.out.parent.mkdir(parents=True, exist_ok=True)
        data["not_emulated"] = [n.format(python=data["fixture"]["python"]) for n in NOT_EMULATED]
        args.out.write_text(json.dumps(data, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(data))
        print(f"wrote {args.out} and .md ({args.key}); work folder {work}")
        ok = entry["install"]["passed"] and all(n["passed"] for n in entry["notebooks"].values())
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
