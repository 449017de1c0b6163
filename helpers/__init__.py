"""Helpers for the DeepSpeed course notebooks: `import helpers`, then `helpers.<name>` for every public name.

Each module lists its public names in `__all__` (what the notebooks call; the rest is imported from its module) and
is imported here whole. None of them imports torch, deepspeed, transformers or matplotlib at import time (they do
inside the functions that need them), so ``import helpers`` is quick and works without them. helpers.gpt (the course
GPT, torch at import) is imported on its own: ``from helpers.gpt import ...``. docs/architecture.md says which module
is for what.
"""
from __future__ import annotations

# each module's floor (what it may import) is in docs/architecture.md, checked by tests/test_import.py
from helpers.atomic import *  # noqa: F403
from helpers.checks import *  # noqa: F403
from helpers.hardware import *  # noqa: F403
from helpers.runtime import *  # noqa: F403
from helpers.records import *  # noqa: F403
from helpers.progress import *  # noqa: F403
from helpers.overflow_check import *  # noqa: F403
from helpers.memory import *  # noqa: F403
from helpers.host_buffers import *  # noqa: F403
from helpers.host_trace import *  # noqa: F403
from helpers.config import *  # noqa: F403
from helpers.data import *  # noqa: F403
from helpers.models import *  # noqa: F403
from helpers.hub import *  # noqa: F403
from helpers.health import *  # noqa: F403
from helpers.limits import *  # noqa: F403
from helpers.step_time import *  # noqa: F403
from helpers.long_context import *  # noqa: F403
from helpers.planner import *  # noqa: F403
from helpers.bootstrap import *  # noqa: F403
from helpers.train import *  # noqa: F403
from helpers.fresh_process import *  # noqa: F403
from helpers.plots import *  # noqa: F403
from helpers.planner_ui import *  # noqa: F403
from helpers.checkpoints import *  # noqa: F403
from helpers.moe import *  # noqa: F403
from helpers.integrations import *  # noqa: F403
from helpers.launch import *  # noqa: F403
from helpers.rank import *  # noqa: F403
from helpers.scale_out import *  # noqa: F403
from helpers.capstone import *  # noqa: F403
from helpers.workarounds import *  # noqa: F403

MODULES = ("atomic", "checks", "hardware", "runtime", "records", "progress", "overflow_check", "memory", "host_buffers", "host_trace", "config", "data", "models", "hub", "health",
           "limits", "step_time", "long_context", "planner", "bootstrap", "train", "fresh_process", "plots", "planner_ui", "checkpoints", "moe", "integrations", "launch",
           "rank", "scale_out", "capstone", "workarounds")


def _public_names() -> list[str]:
    import sys

    return sorted({n for m in MODULES for n in getattr(sys.modules[f"helpers.{m}"], "__all__", ())})


__all__ = _public_names()
