"""Fine-tune a causal LM with Trainer + DeepSpeed, one process per GPU (notebook 04 shows it and its commands).

    deepspeed --num_gpus 2 notebooks/programs/trainer_train.py --deepspeed configs/zero2_trainer.json --model gpt2 --out DIR
    accelerate launch --config_file accelerate.yaml notebooks/programs/trainer_train.py --deepspeed configs/zero2_trainer.json

The config file goes to TrainingArguments as it is. configs/<name>_trainer.json is configs/<name>.json with "auto"
wherever TrainingArguments owns the value (`python -m helpers.config` derives it from configs/<name>.json): Trainer
fills those from the arguments below, train_batch_size with GPUs x micro-batch x accumulation, so the file runs on any
number of GPUs and in fp16, bf16 or fp32 as the arguments say. A file with concrete values works too where every
value agrees with the arguments (Trainer refuses a mismatch when training starts). Each rank writes rank<r>.json to
--out (what it ran: world size, loss, engine, global batch).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from helpers import rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", required=True, help="DeepSpeed JSON config (configs/<name>_trainer.json)")
    p.add_argument("--model", required=True, help="a Hub id or a saved model folder")
    p.add_argument("--tokenizer", default="", help="default: the model's")
    p.add_argument("--data", default="local", help="a Hub corpus ('name:config') or 'local' (data/shakespeare)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=4, help="blocks per GPU per step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", type=Path, required=True, help="folder for Trainer's output and rank<r>.json")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    args = p.parse_args(argv)
    rank.choose_device(args.device)  # before DeepSpeed is imported
    import helpers

    from transformers import Trainer, TrainingArguments

    runtime = helpers.detect_runtime()  # fp16 on a T4, bf16 on Ampere or newer, fp32 on CPU
    tok = helpers.load_tokenizer(args.tokenizer or args.model)
    blocks = helpers.pack_blocks(helpers.load_text_dataset(args.data)["train"], tok, args.seq_len)
    targs = TrainingArguments(
        output_dir=str(args.out / "trainer"), deepspeed=str(args.deepspeed),  # the file as it is
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=1, max_steps=args.steps,
        learning_rate=args.lr, warmup_steps=max(1, args.steps // 10),
        fp16=runtime.precision == "fp16", bf16=runtime.precision == "bf16",
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True)
    model = helpers.fix_causal_lm_loss(helpers.load_causal_lm(args.model))  # after the arguments (ZeRO-3)
    trainer = Trainer(model=model, args=targs, train_dataset=blocks, data_collator=helpers.causal_lm_collator)
    out = trainer.train()
    engine = trainer.model_wrapped
    rank.write_rank_report(args.out, targs.process_index, {
        "rank": targs.process_index, "world_size": targs.world_size, "train_loss": out.training_loss,
        "engine": type(engine).__name__, "train_batch_size": engine.train_batch_size(),
        "filled": {k: engine.config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu")}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
