"""Text data for the fine-tuning notebooks (01 onwards): load, tokenize, pack into blocks.

On Colab a Hub corpus can be named (``"Salesforce/wikitext:wikitext-2-raw-v1"``); offline the default is the
Shakespeare corpus shipped in ``data/shakespeare`` (see its README for source and licence). Both go
through ``datasets.load_dataset``. A tokenizer is either loaded (``"gpt2"`` on Colab) or trained on
the corpus in a fraction of a second and saved, so it also loads through ``from_pretrained``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from helpers.atomic import needs_writing, write_atomically

__all__ = ["as_tensors", "block_loader", "load_text_dataset", "load_tokenizer", "pack_blocks", "train_tokenizer"]

ROOT = Path(__file__).resolve().parent.parent
LOCAL_CORPUS = ROOT / "data" / "shakespeare"
EOS = "<|endoftext|>"


def corpus_files(directory: str | Path = LOCAL_CORPUS) -> list[str]:
    """The .txt files of a local corpus, sorted."""
    files = sorted(str(p) for p in Path(directory).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {directory}: is this a full checkout of the course?")
    return files


def load_text_dataset(source: str = "local", *, val_fraction: float = 0.05, seed: int = 0) -> Any:
    """A DatasetDict with 'train' and 'validation' text splits (notebook 01).

    `source`: "local" (the shipped corpus), a folder of .txt files, or "hub_name[:config]". A Hub name that is
    neither in the local cache nor served by the Hub within helpers.hub.HUB_LOOKUP_TIMEOUT_S is refused with the fix
    before datasets retries (`helpers.hub.check_hub_name`); a cached one loads from the cache when the Hub does not
    answer.
    """
    from datasets import DatasetDict, load_dataset

    from helpers.hub import check_hub_name, datasets_cache, datasets_offline

    if not isinstance(source, str):
        raise ValueError(f"source must be 'local', a folder of .txt files or a Hub name 'name[:config]' (got "
                         f"{source!r}). Fix: source='local'.")
    where = check_hub_name(source, "dataset", variable="DATASET")
    if source == "local" or Path(source).is_dir():
        folder = LOCAL_CORPUS if source == "local" else Path(source)
        lines = load_dataset("text", data_files={"train": corpus_files(folder)}, sample_by="paragraph")["train"]
        split = lines.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
        return DatasetDict(train=split["train"], validation=split["test"])
    name, _, config = source.partition(":")
    if where == "cache":  # the Hub does not answer: the cache alone, where helpers.hub found it
        with datasets_offline():
            ds = load_dataset(name, config or None, cache_dir=str(datasets_cache()))
    else:
        ds = load_dataset(name, config or None)
    if "validation" not in ds:
        split = ds["train"].train_test_split(test_size=val_fraction, seed=seed)
        ds = DatasetDict(train=split["train"], validation=split["test"])
    return ds


# what PreTrainedTokenizerFast.save_pretrained writes (transformers 5: the first two; older versions more)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def tokenizer_folder_problem(path: str | Path) -> str | None:
    """What is missing or cut short in a saved tokenizer folder; None when tokenizer.json and
    tokenizer_config.json are both there and parse."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (Path(path) / name).is_file():
            return f"no {name}"
        try:
            json.loads((Path(path) / name).read_text())
        except ValueError:
            return f"{name} is cut short"
    return None


def train_tokenizer(texts: Any, directory: str | Path, vocab_size: int = 8192) -> Any:
    """Train a byte-level BPE tokenizer on `texts`, save it to `directory`, load it back with AutoTokenizer
    (notebook 01).

    A complete saved tokenizer is reused; the folder is written atomically, and a half-written one is rebuilt
    (notebooks 01-04).
    """
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = Path(directory)
    if needs_writing(directory, tokenizer_folder_problem, TOKENIZER_FILES, "tokenizer"):
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator((t for t in texts if t), vocab_size=vocab_size, min_frequency=2,
                                special_tokens=[EOS])
        fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS,
                                       pad_token=EOS)
        write_atomically(directory, lambda tmp: fast.save_pretrained(str(tmp)))
    return AutoTokenizer.from_pretrained(str(directory))


def load_tokenizer(name_or_path: str) -> Any:
    """AutoTokenizer.from_pretrained, with the pad token set to EOS as GPT-2 needs (notebook 01). A Hub name that is
    neither cached nor served by the Hub within helpers.hub.HUB_LOOKUP_TIMEOUT_S is refused with the fix before
    transformers retries (`helpers.hub.check_hub_name`); a cached one loads from the cache when the Hub does not
    answer."""
    from transformers import AutoTokenizer

    from helpers.hub import check_hub_name, hub_cache

    kwargs: dict[str, Any] = {}
    if check_hub_name(name_or_path, "tokenizer", variable="MODEL") == "cache":
        kwargs = dict(local_files_only=True, cache_dir=str(hub_cache()))
    tok = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def as_tensors(batch: dict[str, list]) -> dict[str, Any]:
    """datasets' rows (Python lists) as torch tensors: the transform `pack_blocks` sets with `Dataset.with_transform`
    (notebook 03).

    Not `with_format("torch")`: datasets 4.0.0 (Colab's, 2026-08) imports `torchvision.io.VideoReader` in its torch and
    numpy formatters whenever torchvision has been imported, and torchvision 0.26 (Colab's) no longer has it, so the
    first batch raises ImportError once transformers has loaded torchvision (huggingface/datasets#8085, fixed in a
    later datasets). A transform runs on datasets' Python formatter, which never looks at torchvision."""
    import torch

    return {name: torch.as_tensor(values) for name, values in batch.items()}


def pack_blocks(dataset: Any, tokenizer: Any, block_size: int, max_blocks: int | None = None) -> Any:
    """Tokenize, end every row that has text with EOS, and cut the joined stream into `block_size`-token blocks
    (notebook 01).

    The cut is run_clm's `group_texts` (Hugging Face's examples), which concatenates rows without a separator; the
    end-of-text token between texts is GPT-2's own pretraining habit (its documents were joined with
    <|endoftext|>). Empty and whitespace-only rows (WikiText's blank lines) add nothing: no token, no EOS. Indexing
    the result gives torch tensors (`as_tensors`), as `with_format("torch")` would, on Colab's datasets too."""
    eos = tokenizer.eos_token_id

    def tokenize(batch: dict[str, list[str]]) -> dict[str, Any]:
        texts = batch["text"]
        kept = [i for i, t in enumerate(texts) if t and not t.isspace()]
        ids = tokenizer([texts[i] for i in kept], add_special_tokens=False)["input_ids"] if kept else []
        rows: list[list[int]] = [[] for _ in texts]
        for i, x in zip(kept, ids):
            rows[i] = x + [eos]
        return {"input_ids": rows}

    def group(batch: dict[str, list[list[int]]]) -> dict[str, Any]:
        flat = [t for ids in batch["input_ids"] for t in ids]
        n = len(flat) // block_size * block_size
        return {"input_ids": [flat[i:i + block_size] for i in range(0, n, block_size)]}

    cols = dataset.column_names
    tokens = dataset.map(tokenize, batched=True, remove_columns=cols, desc="tokenize")
    blocks = tokens.map(group, batched=True, batch_size=1000, desc=f"pack into {block_size}-token blocks")
    if max_blocks is not None and len(blocks) > max_blocks:
        blocks = blocks.select(range(max_blocks))
    return blocks.with_transform(as_tensors)


def block_loader(blocks: Any, batch_size: int, seed: int = 0, shuffle: bool = True) -> Any:
    """A torch DataLoader over packed blocks that never runs dry (cycles with a new order each pass) (notebook 01)."""
    import torch

    def forever():
        epoch = 0
        while True:
            gen = torch.Generator().manual_seed(seed + epoch)
            loader = torch.utils.data.DataLoader(blocks, batch_size=batch_size, shuffle=shuffle, generator=gen,
                                                 drop_last=True)
            yield from loader
            epoch += 1

    if len(blocks) < batch_size:
        raise ValueError(f"only {len(blocks)} blocks for a batch of {batch_size}: lower the batch or block size")
    return forever()


def token_stream(dataset: Any, tokenizer: Any, n_tokens: int) -> Any:
    """The texts of `dataset` tokenized and joined with EOS into one LongTensor of `n_tokens` ids, the corpus repeated
    when it is shorter (one long training sequence, notebook 06)."""
    import torch

    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive whole number, got {n_tokens!r}")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    for start in range(0, len(dataset), 1000):
        for row in tokenizer(dataset[start:start + 1000]["text"], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(eos)
        if len(ids) >= n_tokens:
            break
    if not ids:
        raise ValueError("the dataset has no text to tokenize")
    stream = torch.tensor(ids, dtype=torch.long)
    if len(stream) < n_tokens:
        stream = stream.repeat(-(-n_tokens // len(stream)))
    return stream[:n_tokens].clone()
