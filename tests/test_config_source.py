"""configs/*.json are the source of the course's named configs (helpers.config: `_arguments_of`, `_file_source`).

tests/data/named_configs_snapshot.json holds what course_config / offload_config gave for every named config (no
runtime: the Colab T4 fp16 of configs/; a CPU runtime; the Colab T4 profile) when NAMED_CONFIGS' literal keyword
arguments were the source. It was written by `_snapshot` below from that code, before the files became the source,
and is compared, not regenerated: a change that alters any config the notebooks get fails here. Regenerate it
(`python tests/test_config_source.py`) only for a deliberate change of the course's configs, and say so.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import ROOT, fake_runtime
from helpers import colab_t4_profile
from helpers.config import NAMED_CONFIGS, OFFLOAD_KINDS, course_config, offload_config

SNAPSHOT = ROOT / "tests" / "data" / "named_configs_snapshot.json"
NVME = "<nvme>"  # the NVMe folder's path in the snapshot (a temporary folder when it is taken)
# GPT-2 124M: its largest tensor (the 50257 x 768 embedding) sizes NVMe parameter buffers; n_params only sizes the
# free-space check, not the config
LARGEST_PARAM, N_PARAMS = 38_597_376, 10_000_000


def _cpu():
    return fake_runtime(device="cpu", gpu_name=None, compute_capability=None, gpu_total_bytes=0,
                        vram_budget_bytes=0, ram_total_bytes=int(24e9), ram_budget_bytes=int(24e9),
                        gpu_count=0, is_colab=False, precision="fp32")


def _snapshot(nvme_dir: Path) -> dict[str, dict]:
    """{"<call>": the config it gives} for every named config and offload kind, `nvme_dir` written as NVME."""
    runtimes = {"cpu": _cpu(), "t4": colab_t4_profile()}
    out: dict[str, dict] = {}
    for name, named in NAMED_CONFIGS.items():
        path = {"nvme_path": "/nvme"} if named.uses_nvme and "nvme_path" not in named.kwargs else {}
        out[f"course_config({name!r})"] = course_config(name, **path)
        for label, runtime in runtimes.items():
            out[f"course_config({name!r}, {label})"] = course_config(name, runtime, **path)
    for label, runtime in runtimes.items():
        out[f"course_config('zero2', {label}, micro_batch_size=8, lr=3e-4)"] = course_config(
            "zero2", runtime, micro_batch_size=8, lr=3e-4)
        for kind in OFFLOAD_KINDS:
            out[f"offload_config({kind!r}, {label})"] = offload_config(
                kind, runtime, largest_param=LARGEST_PARAM, n_params=N_PARAMS, nvme_path=str(nvme_dir))
    return json.loads(json.dumps(out).replace(json.dumps(str(nvme_dir))[1:-1], NVME))


def test_every_named_config_is_what_it_was_before_the_files_became_the_source(tmp_path):
    """Byte for byte (key order and JSON types included) what the notebooks got from NAMED_CONFIGS' literals."""
    expected = json.loads(SNAPSHOT.read_text())
    got = _snapshot(tmp_path)
    assert list(got) == list(expected)
    for call, config in got.items():
        assert json.dumps(config, indent=2) == json.dumps(expected[call], indent=2), call


if __name__ == "__main__":  # regenerate the snapshot (a deliberate change of the course's configs only)
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as folder:
        SNAPSHOT.write_text(json.dumps(_snapshot(Path(folder)), indent=1) + "\n")
    print("wrote", SNAPSHOT)
