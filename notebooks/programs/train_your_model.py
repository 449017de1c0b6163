"""Fine-tune a Hugging Face causal language model with DeepSpeed on one GPU (or CPU): notebook 07's train.py.

    python train.py --model gpt2-medium --deepspeed ds_config.json --data Salesforce/wikitext:wikitext-2-raw-v1 \\
        --seq-len 512 --steps 50 --out run

It imports only torch, transformers, datasets and deepspeed (never the course's helpers): copy it and the JSON beside it
into any project. What it does, in order:
1. reads the DeepSpeed JSON (the micro-batch, precision, optimizer, scheduler, ZeRO stage and offload all live there);
2. for ZeRO stage 3, creates `HfDeepSpeedConfig(config)` BEFORE `from_pretrained` and keeps it alive: transformers then
   builds the model under `deepspeed.zero.Init`, each parameter partitioned (and offloaded) as it is created, so the
   whole fp32 model never sits in CPU RAM at once;
3. loads the model and tokenizer with `from_pretrained`, and switches on activation checkpointing;
4. loads a `datasets` corpus (a Hub name "name:config", or a folder of .txt files), tokenizes it, ends each text with
   the end-of-text token and packs the stream into blocks of --seq-len tokens (no padding);
5. trains: `deepspeed.initialize`, then forward, `engine.backward(loss)`, `engine.step()`; one JSON line per optimizer
   step goes to OUT/loss.jsonl (step, loss, seconds, peak GPU memory so far);
6. saves with `engine.save_checkpoint(OUT/checkpoint)` (DeepSpeed's format: partitioned states, resumable with
   `engine.load_checkpoint`), and with --consolidate writes one fp32 state dict with zero_to_fp32 (OUT/fp32/).
Run it as `python train.py ...` (one process) or `deepspeed train.py ...` (the launcher sets the same variables).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face Hub id (e.g. gpt2-medium) or a saved model folder")
    p.add_argument("--deepspeed", required=True, type=Path, help="the DeepSpeed JSON config")
    p.add_argument("--data", required=True, help="a Hub dataset 'name:config' (its 'text' column) or a folder of .txt")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training block")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps")
    p.add_argument("--out", type=Path, required=True, help="folder for loss.jsonl, checkpoint/ and fp32/")
    p.add_argument("--no-checkpointing", action="store_true", help="keep activations instead of recomputing them")
    p.add_argument("--consolidate", action="store_true", help="also write one fp32 state dict with zero_to_fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher
    return p.parse_args(argv)


def say(text: str) -> None:
    print(text, flush=True)


def port_taken(port: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(port)))
        except OSError:
            return True
    return False


def single_process_env() -> None:
    """The variables torch.distributed reads, for a run without a launcher (the deepspeed launcher sets them). A
    single process whose inherited MASTER_PORT is taken (a notebook kernel's own process group, when started with
    `!python train.py`) gets a free port instead."""
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ or (os.environ["WORLD_SIZE"] == "1" and port_taken(os.environ["MASTER_PORT"])):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if os.environ["WORLD_SIZE"] == "1":
        # one rank needs one NCCL channel; NCCL's default set cost 0.74 GiB of GPU memory on an H200
        os.environ.setdefault("NCCL_MAX_NCHANNELS", "1")


def load_text(data: str):
    """The training split of a text corpus through `datasets.load_dataset`."""
    from datasets import load_dataset

    if Path(data).is_dir():
        files = sorted(str(p) for p in Path(data).glob("*.txt"))
        return load_dataset("text", data_files={"train": files}, sample_by="paragraph")["train"]
    name, _, config = data.partition(":")
    return load_dataset(name, config or None, split="train")


def pack(dataset, tokenizer, seq_len: int):
    """Tokenize each row, end each text with EOS, join everything and cut it into seq_len-token blocks."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        texts = [t for t in batch["text"] if t and not t.isspace()]  # blank rows add nothing
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return {"input_ids": [x + [eos] for x in ids]}

    def group(batch):
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // seq_len * seq_len
        return {"input_ids": [flat[i:i + seq_len] for i in range(0, n, seq_len)]}

    tokens = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    return tokens.map(group, batched=True, batch_size=1000)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = json.loads(args.deepspeed.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (gloo), before importing it
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations import HfDeepSpeedConfig

    single_process_env()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(args.seed)
    zero_stage = config.get("zero_optimization", {}).get("stage", 0)

    say("loading the tokenizer and the data")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    blocks = pack(load_text(args.data), tokenizer, args.seq_len)
    if len(blocks) == 0:
        raise SystemExit(f"the corpus has fewer than {args.seq_len} tokens: use a shorter --seq-len or more text")
    say(f"{len(blocks):,} blocks of {args.seq_len} tokens")

    say("loading the model")
    if zero_stage == 3:
        dschf = HfDeepSpeedConfig(config)  # noqa: F841  keep it alive: from_pretrained then builds under zero.Init
    model = AutoModelForCausalLM.from_pretrained(args.model)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable()  # recompute activations in backward instead of storing them
    model.config.use_cache = False

    say("deepspeed.initialize")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()  # from_pretrained returns eval mode: no dropout and no activation checkpointing there
    loader = torch.utils.data.DataLoader(
        blocks, batch_size=engine.train_micro_batch_size_per_gpu(), shuffle=True, drop_last=True,
        collate_fn=lambda rows: torch.tensor([r["input_ids"] for r in rows]))
    accumulation = engine.gradient_accumulation_steps()

    def batches():
        while True:  # start over when the data runs out
            yield from loader

    stream = batches()
    with open(args.out / "loss.jsonl", "w") as log:
        for step in range(1, args.steps + 1):
            started, losses = time.perf_counter(), []
            for _ in range(accumulation):  # micro-batches of one optimizer step
                ids = next(stream).to(engine.device)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()  # steps the optimizer at the last micro-batch of each accumulation
                losses.append(loss.item())
            record = {"step": step, "loss": sum(losses) / len(losses), "seconds": time.perf_counter() - started,
                      "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0}
            log.write(json.dumps(record) + "\n")
            log.flush()
            say(f"step {step}/{args.steps} loss {record['loss']:.3f}")

    say("engine.save_checkpoint")
    engine.save_checkpoint(str(args.out / "checkpoint"), tag="final")
    if args.consolidate:
        say("zero_to_fp32")
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        # pytorch_model.bin: safetensors refuses GPT-2's tied input and output embeddings (one tensor, two names)
        convert_zero_checkpoint_to_fp32_state_dict(str(args.out / "checkpoint"), str(args.out / "fp32"), tag="final")
        tokenizer.save_pretrained(args.out / "fp32")
        model.config.save_pretrained(args.out / "fp32")  # with the config: from_pretrained(OUT/fp32) loads it
    say("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
