"""How many NVMe parameter swap buffers does ZeRO-3 need? (backs `helpers.config.check_nvme_buffers`; issue 13)

Trains a small model whose 10 weight tensors are all swapped to NVMe (each >= 1 MiB in bf16) for 3 steps with
parameters on NVMe, one process on CPU, for each setting in the grid; prints OK or DeepSpeed's assertion.
    python benchmarks/nvme_buffers.py --nvme-path /tmp/nvme   (~12 s a setting; needs libaio)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# (buffer_count, buffer_size, prefetch_bucket_size, max_live_parameters, max_reuse_distance)
GRID = [(0, 5_000_000, 10**7, 3 * 10**7, 0), (1, 100_000, 10**7, 3 * 10**7, 0), (1, 5_000_000, 10**7, 3 * 10**7, 0),
        (1, 5_000_000, 10**8, 10**9, 0), (2, 5_000_000, 10**7, 3 * 10**7, 10**7),
        (9, 5_000_000, 10**7, 3 * 10**7, 3 * 10**7), (10, 5_000_000, 10**7, 3 * 10**7, 3 * 10**7),
        (8, 5_000_000, 10**7, 3 * 10**7, 10**8)]

CHILD = r'''
import torch
from helpers.runtime import setup_single_process
setup_single_process()
import deepspeed
from helpers.config import ConfigSettings, build_ds_config

count, size, prefetch, live, reuse = {setting}


class Net(torch.nn.Module):  # swapped: embedding 4.2M, 8 x linear 1M, head 4.2M elements
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4096, 1024)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(1024, 1024) for _ in range(8)])
        self.head = torch.nn.Linear(1024, 4096)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return torch.nn.functional.cross_entropy(self.head(h).float().view(-1, 4096), x.view(-1))


cfg = build_ds_config(3, precision="bf16", offload_param="nvme", nvme_path={nvme!r}, settings=ConfigSettings(
    check_paths=False, nvme_buffer_count=max(count, 1), nvme_buffer_size=max(size, 600_000),
    prefetch_bucket_size=prefetch, max_live_parameters=live, scheduler=None))
# the settings the builder refuses go in by hand: this measures DeepSpeed itself
cfg["zero_optimization"]["offload_param"].update(buffer_count=count, buffer_size=size)
cfg["zero_optimization"].update(stage3_max_reuse_distance=reuse, stage3_param_persistence_threshold=0)
with deepspeed.zero.Init(config_dict_or_path=cfg):
    net = Net()
engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
x = torch.randint(0, 4096, (2, 16))
for _ in range(3):
    loss = engine(x)
    engine.backward(loss)
    engine.step()
print("RESULT OK")
'''


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    from helpers.checks import ConfigError
    from helpers.config import _nvme_folder_to_make

    try:  # a file (or a path under one) is refused before any setting runs (issue 41: a raw NotADirectoryError)
        args.nvme_path = str(_nvme_folder_to_make(args.nvme_path, "--nvme-path"))
    except ConfigError as exc:
        p.error(str(exc))
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    print("count  buffer_size  prefetch  max_live  reuse_distance  result")
    for setting in GRID:
        with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
            out = subprocess.run([sys.executable, "-c", CHILD.format(setting=setting, nvme=nvme)],
                                 capture_output=True, text=True, env={"DS_ACCELERATOR": "cpu",
                                                                      **__import__("os").environ})
        lines = (out.stdout + out.stderr).splitlines()
        result = next((ln.split("]: ", 1)[-1] for ln in lines if "AssertionError" in ln),
                      "OK" if "RESULT OK" in out.stdout else f"exit {out.returncode}")
        print(f"{setting[0]:>5}  {setting[1]:>11,}  {setting[2]:>8.0e}  {setting[3]:>8.0e}  {setting[4]:>14.0e}  {result}")


if __name__ == "__main__":
    main()
