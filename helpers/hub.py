"""Whether a notebook takes its Colab branch: a model and a corpus from the Hugging Face Hub (notebooks 01 and 04).

On Colab the Hub answers, and `from_pretrained("gpt2")` / `load_dataset("Salesforce/wikitext", ...)` download. Offline
(HF_HUB_OFFLINE=1) the same calls read the local Hugging Face cache, so the Colab branch runs wherever that cache
holds both, as after an earlier download (the course's tests build one with scripts/local_hub.py). Anywhere else the
notebooks take their offline branch: the shipped corpus and GPT-2 built from its config. Nothing here asks the
network: offline, transformers would retry for ~23 s before failing.
"""
from __future__ import annotations

import os
from pathlib import Path

from helpers.hardware import in_colab

__all__ = ["HUB_DEFAULTS", "hub_available", "hub_cache", "hub_offline", "hub_or_local", "hub_source", "in_hub_cache"]

# what notebooks 01 and 04 load on Colab: GPT-2 (124M) and WikiText-2 ("name:config", helpers.load_text_dataset)
HUB_DEFAULTS = {"model": "gpt2", "dataset": "Salesforce/wikitext:wikitext-2-raw-v1"}

_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: transformers and datasets read only the local cache."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")


def hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment now (its constants are fixed at import)."""
    return Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub")


def _datasets_cache() -> Path:
    return Path(os.environ.get("HF_DATASETS_CACHE") or _hf_home() / "datasets")


def in_hub_cache(model_id: str | None = None, dataset: str | None = None) -> bool:
    """The local Hugging Face cache holds `model_id` (its config.json) and `dataset` ("name[:config]", prepared the
    way an earlier `load_dataset` leaves it), each where given, so they load with HF_HUB_OFFLINE=1."""
    from huggingface_hub import try_to_load_from_cache

    if model_id is not None:
        try:
            found = try_to_load_from_cache(model_id, "config.json", cache_dir=hub_cache())
        except ValueError:  # not a Hub id at all (HFValidationError)
            return False
        if not isinstance(found, str):
            return False
    if dataset is None:
        return True
    name, _, config = dataset.partition(":")
    if name.count("/") > 1 or not name:
        return False
    folder = _datasets_cache() / "___".join(name.split("/"))
    return any(folder.glob(f"{config or '*'}/*/*/dataset_info.json"))


def hub_available(model_id: str | None = None, dataset: str | None = None) -> bool:
    """True where the Colab branch can load `model_id` and `dataset` (each where given): on Colab (the Hub answers),
    or offline with them in the local cache. A local folder or "local" is not a Hub name: False."""
    names = [n for n in (model_id, dataset) if n is not None]
    if not names or any(n == "local" or Path(n).is_dir() for n in names):
        return False
    if hub_offline():
        return in_hub_cache(model_id, dataset)
    return in_colab()


def hub_or_local(model: str, dataset: str) -> tuple[str, str]:
    """(model, dataset) a notebook loads: the Hub defaults where `hub_available` (Colab's branch), otherwise "local"
    in their place (the shipped corpus; GPT-2 built from its config), with one printed line saying which. A name
    the learner chose is kept either way (notebooks 01 and 04)."""
    use_model = model != HUB_DEFAULTS["model"] or hub_available(model_id=model)
    use_dataset = dataset != HUB_DEFAULTS["dataset"] or hub_available(dataset=dataset)
    model, dataset = (model if use_model else "local"), (dataset if use_dataset else "local")
    hub = [n for n in (model, dataset) if n in HUB_DEFAULTS.values()]
    if hub:
        print(f"Colab's branch: {' and '.join(hub)} through from_pretrained / load_dataset, from {hub_source()}")
    if "local" in (model, dataset):
        print("no Hugging Face Hub here: " + " and ".join(
            w for w, n in (("the shipped corpus (data/shakespeare)", dataset), ("GPT-2 built from its config with "
                           "random weights (it learns from scratch, so text it generates is far from fluent)", model))
            if n == "local") + ", through the same from_pretrained / load_dataset calls")
    return model, dataset


def hub_source() -> str:
    """Where the Colab branch's downloads come from, for the notebook to print."""
    if hub_offline():
        return f"the local Hugging Face cache in {_hf_home()} (HF_HUB_OFFLINE=1: no download)"
    return "the Hugging Face Hub"
