"""Fine-tune a causal LM with Trainer + DeepSpeed, one process per GPU (notebook 04 shows it and its commands).

    deepspeed --num_gpus 2 notebooks/programs/trainer_train.py --deepspeed configs/zero2.json --model gpt2 --out DIR
    accelerate launch --config_file accelerate.yaml notebooks/programs/trainer_train.py --deepspeed configs/zero2.json

The config file is the one every driver reads; `helpers.training_arguments` hands it to Trainer with "auto" where
TrainingArguments owns a value, so the same file works on any number of GPUs (train_batch_size = GPUs x micro-batch
x accumulation). Each rank writes rank<r>.json to --out (what it ran: world size, loss, engine, global batch).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from helpers import rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config (as in configs/)")
    p.add_argument("--model", required=True, help="a Hub id or a saved model folder")
    p.add_argument("--tokenizer", default="", help="default: the model's")
    p.add_argument("--data", default="local", help="a Hub corpus ('name:config') or 'local' (data/shakespeare)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, required=True, help="folder for Trainer's output and rank<r>.json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = p.parse_args(argv)
    rank.choose_device(args.device)  # before DeepSpeed is imported
    import helpers

    runtime = helpers.detect_runtime()
    cfg = json.loads(Path(args.deepspeed).read_text())
    if runtime.precision == "fp32":  # CPU: DeepSpeed refuses fp16 there
        cfg.pop("fp16", None)
    tok = helpers.load_tokenizer(args.tokenizer or args.model)
    blocks = helpers.pack_blocks(helpers.load_text_dataset(args.data)["train"], tok, args.seq_len)
    targs = helpers.training_arguments(args.out / "trainer", cfg, runtime, steps=args.steps, progress=False,
                                       train_sampling_strategy="random")
    model = helpers.fix_causal_lm_loss(helpers.load_causal_lm(args.model))  # after the arguments (ZeRO-3)
    from transformers import Trainer

    trainer = Trainer(model=model, args=targs, train_dataset=blocks, data_collator=helpers.causal_lm_collator)
    out = trainer.train()
    rank.write_rank_report(args.out, targs.process_index, {
        "rank": targs.process_index, "world_size": targs.world_size, "train_loss": out.training_loss,
        "engine": type(trainer.model_wrapped).__name__,
        "train_batch_size": trainer.model_wrapped.config["train_batch_size"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
