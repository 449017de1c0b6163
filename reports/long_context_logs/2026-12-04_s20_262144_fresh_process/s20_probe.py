"""Session 20: DeepSpeed's cpu_checkpointing offload engine's pinned-buffer pool across two lengths, without and with
helpers.checkpoints_on_cpu dropping the engine (each in a fresh process: python s20_probe.py raw|helpers)."""
import sys

import torch

sys.path.insert(0, "tests")
import deepspeed  # noqa: E402
import test_long_context as t  # noqa: E402
from deepspeed.runtime.activation_checkpointing import checkpointing as ds  # noqa: E402

import helpers  # noqa: E402

mode = sys.argv[1]
model = t._model(torch.float16, checkpointing=True).cuda()
for layer_count in (len(model.model.layers),):
    pass
if mode == "raw":
    helpers.setup_single_process()
    deepspeed.init_distributed(verbose=False)
    ds.configure(None, checkpoint_in_cpu=True)
    for m in model.model.layers:
        m._gradient_checkpointing_func = ds.checkpoint
for n in (1280, 1536, 2048, 1280):
    ids = torch.randint(0, t.CONFIG["vocab_size"], (1, n), device="cuda")
    if mode == "raw":
        model(input_ids=ids, labels=ids).loss.backward()
    else:
        with helpers.checkpoints_on_cpu(model):
            model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    s = torch.cuda.host_memory_stats()
    print(f"{mode}: after {n} tokens: page-locked bytes owned {s['allocated_bytes.current']:,}, active "
          f"{s.get('active_bytes.current', 0):,}, layers {len(model.model.layers)}", flush=True)
