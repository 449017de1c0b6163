"""A local Hugging Face cache laid out as a real download leaves it, built from what the course ships (issue 21), so
the notebooks' Colab branches (`load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1")`,
`from_pretrained("gpt2")`) run offline through the real library code.

    python scripts/local_hub.py build/hf-home [--model-size gpt2] [--env-file hub.env]   # then: source hub.env

What it writes under HF_HOME (the folder given):
- hub/models--gpt2/: blobs, refs/main and a snapshot of config.json, generation_config.json and model.safetensors (GPT-2's
  architecture at `--model-size`, a helpers.models.GPT2_LADDER rung, with course-initialised weights: torch's seed 0, the
  same `from_config` initialisation the offline branch uses) and the course's tokenizer (tokenizer.json,
  tokenizer_config.json: a byte-level BPE of 8,192 tokens trained on data/shakespeare; GPT-2's own 50,257-token files
  are not shipped and cannot be downloaded here).
- hub/datasets--Salesforce--wikitext/: a snapshot with README.md (the dataset card's `configs:` block, as on the Hub) and
  wikitext-2-raw-v1/{train,validation,test}-00000-of-00001.parquet: the shipped corpus as WikiText rows (one line of
  text per row ending in "\\n", empty rows between paragraphs; plays in order, the last two held out).
- datasets/Salesforce___wikitext/wikitext-2-raw-v1/0.0.0/<commit>/: the Arrow cache `load_dataset` prepares on its
  first (online) call, written by datasets' own Parquet builder from those parquet files. Offline (HF_HUB_OFFLINE=1)
  `load_dataset` reads exactly this folder ("Using the latest cached version of the dataset").
Build it with the Python that will read it (datasets' cache format follows its version).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL_ID = "gpt2"
DATASET_ID = "Salesforce/wikitext"
DATASET_CONFIG = "wikitext-2-raw-v1"
SPLITS = ("train", "validation", "test")
CARD = """---
language:
- en
license:
- cc-by-sa-3.0
pretty_name: WikiText (the course's local stand-in, built from data/shakespeare by scripts/local_hub.py)
configs:
- config_name: {config}
  data_files:
  - split: train
    path: {config}/train-*
  - split: validation
    path: {config}/validation-*
  - split: test
    path: {config}/test-*
---
# WikiText stand-in

Not WikiText: the course's Shakespeare corpus in WikiText's layout, for running the Colab branches offline.
"""


def environment(home: str | os.PathLike[str]) -> dict[str, str]:
    """Variables that make transformers and datasets read `home` and never ask the Hub."""
    home = Path(home).resolve()
    return {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_DATASETS_CACHE": str(home / "datasets"),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _commit(files: dict[str, Path]) -> str:
    """A stable 40-hex commit id for a snapshot (its files' names and contents)."""
    h = hashlib.sha1()
    for name in sorted(files):
        h.update(name.encode())
        h.update(hashlib.sha256(files[name].read_bytes()).digest())
    return h.hexdigest()


def place_snapshot(hub: Path, repo_type: str, repo_id: str, files: dict[str, Path]) -> tuple[Path, str]:
    """Lay out `files` (path in the repo -> local file) as huggingface_hub's cache does after a download: the
    content under blobs/<sha256>, the snapshot's files as relative symlinks to them, refs/main naming the commit."""
    folder = hub / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = _commit(files)
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    for name, src in sorted(files.items()):
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        blob = folder / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot, commit


def wikitext_rows(files: list[str]) -> list[str]:
    """The corpus as WikiText rows: each non-empty line as ' line\\n' (WikiText's leading space), '' between
    paragraphs."""
    rows: list[str] = []
    for path in files:
        for paragraph in Path(path).read_text().split("\n\n"):
            lines = [ln.strip() for ln in paragraph.splitlines() if ln.strip()]
            if lines:
                rows += [f" {ln}\n" for ln in lines] + [""]
    return rows


def build_dataset(home: Path, work: Path) -> dict:
    """The dataset repo's snapshot and the Arrow cache `load_dataset` would have prepared from it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.parquet.parquet import Parquet

    from helpers.data import corpus_files

    plays = corpus_files()
    split_files = {"train": plays[:-2], "validation": plays[-2:-1], "test": plays[-1:]}
    files: dict[str, Path] = {}
    for split in SPLITS:
        local = work / f"{split}.parquet"
        pq.write_table(pa.table({"text": wikitext_rows(split_files[split])}), local)
        files[f"{DATASET_CONFIG}/{split}-00000-of-00001.parquet"] = local
    card = work / "README.md"
    card.write_text(CARD.format(config=DATASET_CONFIG))
    files["README.md"] = card
    snapshot, commit = place_snapshot(home / "hub", "dataset", DATASET_ID, files)
    cache = home / "datasets"
    namespace, name = DATASET_ID.split("/")
    shutil.rmtree(cache / f"{namespace}___{name}", ignore_errors=True)
    data_files = {s: [str(snapshot / DATASET_CONFIG / f"{s}-00000-of-00001.parquet")] for s in SPLITS}
    builder = Parquet(cache_dir=str(cache), dataset_name=name, hash=commit, config_name=DATASET_CONFIG,
                      data_files=DataFilesDict.from_patterns(data_files))
    # what load_dataset's Hub module sets: the repo id (the cache's "Salesforce___" prefix) and the config's own name
    # as its id (the data files come from the dataset card, not from arguments)
    builder.repo_id, builder.config_id = DATASET_ID, DATASET_CONFIG
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()
    return {"dataset": DATASET_ID, "config": DATASET_CONFIG, "commit": commit, "arrow_cache": builder.cache_dir,
            "rows": {s: pq.read_metadata(files[f"{DATASET_CONFIG}/{s}-00000-of-00001.parquet"]).num_rows
                     for s in SPLITS}}


def build_model(home: Path, work: Path, size: str, seed: int = 0) -> dict:
    """GPT-2's repo: config, generation config, safetensors weights (course-initialised) and the course's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.data import load_text_dataset, train_tokenizer
    from helpers.models import gpt2_config

    model_dir, tok_dir = work / "model", work / "tokenizer"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gpt2_config(size))
    model.save_pretrained(str(model_dir))
    n_params = sum(p.numel() for p in model.parameters())
    del model
    train_tokenizer(load_text_dataset("local")["train"]["text"], tok_dir)
    files = {p.name: p for p in sorted(model_dir.iterdir()) if p.is_file()}
    files.update({p.name: p for p in sorted(tok_dir.iterdir()) if p.is_file()})
    _, commit = place_snapshot(home / "hub", "model", MODEL_ID, files)
    return {"model": MODEL_ID, "architecture": size, "n_params": n_params, "commit": commit, "files": sorted(files),
            "weights_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))}


def build(home: str | os.PathLike[str], model_size: str = "gpt2") -> dict:
    """Both repos under `home` (replacing what was there); returns what was built."""
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        work = Path(tmp)
        (work / "ds").mkdir()
        (work / "model").mkdir()
        info = {"home": str(home), "dataset": build_dataset(home, work / "ds"),
                "model": build_model(home, work / "model", model_size)}
    (home / "local_hub.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("home", type=Path, help="the HF_HOME folder to fill (its hub/ and datasets/ are replaced)")
    parser.add_argument("--model-size", default="gpt2", help="the GPT-2 ladder rung saved as 'gpt2' (default gpt2)")
    parser.add_argument("--env-file", type=Path, help="also write the variables as `export` lines here, to `source`")
    args = parser.parse_args(argv)
    info = build(args.home, args.model_size)
    print(json.dumps(info, indent=2))
    exports = "".join(f"export {k}={v}\n" for k, v in environment(args.home).items())
    print(exports, end="")
    if args.env_file:
        args.env_file.write_text(exports)
    return 0


if __name__ == "__main__":
    sys.exit(main())
