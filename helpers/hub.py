"""Whether a notebook takes its Colab branch: a model and a corpus from the Hugging Face Hub (notebooks 01 and 04).

On Colab the Hub answers, and `from_pretrained("gpt2")` / `load_dataset("Salesforce/wikitext", ...)` download. Offline
(HF_HUB_OFFLINE=1) the same calls read the local Hugging Face cache, so the Colab branch runs wherever that cache
holds both, as after an earlier download (the course's tests build one with scripts/local_hub.py). Anywhere else the
notebooks take their offline branch: the shipped corpus and GPT-2 built from its config. `hub_available` never asks
the network: offline, transformers would retry for ~23 s before failing.

A name a learner types (MODEL='gpt2-medium', DATASET='wikitext') goes through `check_hub_name` before transformers or
datasets see it: a local folder or a cached name loads as before (a cached one from the cache alone when the Hub is
switched off or does not answer), a name the Hub must serve is refused with the fix when the Hub does not answer
within HUB_LOOKUP_TIMEOUT_S (one request, no retries; offline, from_pretrained retried for 47-49 s and load_dataset
for 24 s before failing, issue 23 item 8).
"""
from __future__ import annotations

import contextlib
import difflib
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from helpers.hardware import in_colab

__all__ = ["hub_or_local", "hub_stand_in"]

# what notebooks 01 and 04 load on Colab: GPT-2 (124M) and WikiText-2 ("name:config", helpers.load_text_dataset)
HUB_DEFAULTS = {"model": "gpt2", "dataset": "Salesforce/wikitext:wikitext-2-raw-v1"}

_TRUE = {"1", "true", "yes", "on"}
# How long the course waits for the Hugging Face Hub to answer one request: offline, transformers' own lookup retries
# for ~23 s per file (huggingface_hub's backoff of 1+2+4+8+8 s), which froze the planner (issue 16) and the loading
# cells of notebooks 01 and 04 (47-49 s, issue 23 item 8). helpers.models.hub_config and `check_hub_name` use it.
HUB_LOOKUP_TIMEOUT_S = 3.0


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: transformers and datasets read only the local cache."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")


def hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment now (its constants are fixed at import)."""
    return Path(os.environ.get("HF_HUB_CACHE") or _hf_home() / "hub")


def datasets_cache() -> Path:
    """datasets' cache folder, read from the environment now (datasets fixes its own when imported)."""
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
    folder = datasets_cache() / "___".join(name.split("/"))
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
    in their place (the shipped corpus; GPT-2 built from its config), with one printed line saying which (notebook 01).
    A name the learner chose is kept when it can load here (a folder, a cached name, or the Hub answers:
    `check_hub_name`, within HUB_LOOKUP_TIMEOUT_S); otherwise it is refused now, with the fix, rather than after a
    minute of retries in the loading cell (notebooks 01 and 04)."""
    use_model = model != HUB_DEFAULTS["model"] or hub_available(model_id=model)
    use_dataset = dataset != HUB_DEFAULTS["dataset"] or hub_available(dataset=dataset)
    refusals = []
    for name, kind, chosen in ((model, "model", use_model and model != HUB_DEFAULTS["model"]),
                               (dataset, "dataset", use_dataset and dataset != HUB_DEFAULTS["dataset"])):
        if chosen and name != "local":
            try:
                check_hub_name(name, kind, variable=kind.upper())
            except HubUnreachableError as exc:
                refusals.append(str(exc))
    if refusals:
        raise HubUnreachableError("\n".join(refusals))
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


def hub_stand_in() -> bool:
    """The local Hugging Face cache is the course's stand-in (scripts/local_hub.py leaves local_hub.json in HF_HOME)
    (notebook 01): `gpt2` holds course-initialised weights and the course's tokenizer, `Salesforce/wikitext` the
    Shakespeare corpus in WikiText's layout. The code path is Colab's; the numbers are not what the real model and
    corpus give."""
    return (_hf_home() / "local_hub.json").is_file()


def hub_source() -> str:
    """Where the Colab branch's downloads come from, for the notebook to print."""
    if hub_offline():
        where = f"the local Hugging Face cache in {_hf_home()} (HF_HUB_OFFLINE=1: no download)"
        if hub_stand_in():
            where += (": the course's STAND-IN (scripts/local_hub.py), random-initialised GPT-2 weights and the "
                      "Shakespeare corpus under the Hub's names, so losses and generated text are not GPT-2's on "
                      "WikiText; on Colab they will differ")
        return where
    return "the Hugging Face Hub"


# ------------------------------------------------------------------ names the Hub must serve (issue 23 item 8)

class HubUnreachableError(OSError):
    """A Hub name that is not in the local cache while the Hub is switched off or does not answer; the message says
    what to use instead."""


_PROBE_MEMORY_S = 30.0  # one answer (or silence) of the Hub serves the calls of one notebook cell
_probe: dict[str, tuple[float, str | None]] = {}


def hub_unreachable(timeout_s: float | None = None) -> str | None:
    """None when the Hugging Face Hub's endpoint answers one HTTP request (any status) within `timeout_s` seconds
    (default helpers.hub.HUB_LOOKUP_TIMEOUT_S), else why not ('ConnectError: ...', 'no answer within 3 s').

    One HEAD request without retries, in a daemon thread so that a slow name lookup cannot hold the caller past the
    cap; the outcome is remembered for 30 s. HF_HUB_OFFLINE=1 answers at once ('HF_HUB_OFFLINE=1')."""
    if hub_offline():
        return "HF_HUB_OFFLINE=1"
    timeout = HUB_LOOKUP_TIMEOUT_S if timeout_s is None else float(timeout_s)
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    seen = _probe.get(endpoint)
    if seen is not None and time.monotonic() - seen[0] < _PROBE_MEMORY_S:
        return seen[1]
    result: list[str | None] = []

    def ask() -> None:
        try:
            from huggingface_hub import get_session

            get_session().head(endpoint + "/api/models/gpt2", timeout=timeout, follow_redirects=False)
            result.append(None)
        except Exception as exc:  # httpx's ConnectError / TimeoutException, a proxy's refusal
            result.append(f"{type(exc).__name__}: {exc}"[:160])

    thread = threading.Thread(target=ask, name="ds-course-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    why = result[0] if result else f"no answer within {timeout:g} s"
    _probe[endpoint] = (time.monotonic(), why)
    return why


def cached_hub_names(kind: str = "model") -> list[str]:
    """The model ids (kind 'model') or datasets ('name:config', kind 'dataset') the local Hugging Face cache holds so
    that they load offline (`in_hub_cache`), sorted."""
    names: set[str] = set()
    if kind == "dataset":
        for info in datasets_cache().glob("*/*/*/*/dataset_info.json"):
            config, folder = info.parents[2].name, info.parents[3].name
            if folder.count("___") == 1 and not folder.startswith(("_", ".")):  # org___name: not a local builder
                names.add(folder.replace("___", "/") + ":" + config)
    else:
        for repo in hub_cache().glob("models--*"):
            name = repo.name[len("models--"):].replace("--", "/")
            if any((repo / "snapshots").glob("*/config.json")) and in_hub_cache(model_id=name):
                names.add(name)
    return sorted(names)


def _typo_of(name: str, candidates: list[str]) -> str | None:
    """The candidate `name` most likely misspells or shortens ('wikitext' -> 'Salesforce/wikitext:...'); None."""
    want = name.strip().lower()
    bare = {c: c.partition(":")[0].lower() for c in candidates}
    for c, repo in bare.items():  # the dataset's own name without its org or config
        if want in (repo, repo.rsplit("/", 1)[-1]) and want != c.lower():
            return c
    close = difflib.get_close_matches(want, [b.rsplit("/", 1)[-1] for b in bare.values()], n=1, cutoff=0.75)
    if close:
        return next(c for c, repo in bare.items() if repo.rsplit("/", 1)[-1] == close[0])
    return None


def _fix_text(name: str, kind: str, variable: str | None, local_size: str | None) -> str:
    """'Fix: ...' for a Hub name that cannot load here: names that do (cached ones, the typo's target first, 'local'
    for a dataset, a folder) and what the notebooks' parameter takes."""
    cached = cached_hub_names("dataset" if kind == "dataset" else "model")
    guess = _typo_of(name, cached)
    others = ", ".join(repr(c) for c in cached if c != guess)
    cache_part = (f"{guess!r} (did you mean it? it is in the local cache" + (f", as are {others}" if others else "")
                  + ")") if guess else (f"a name in the local cache: {others}" if others else "")
    if kind == "dataset":
        parts = ["'local' (the shipped corpus, data/shakespeare)", cache_part, "a folder of .txt files"]
        notebook = f"{variable or 'DATASET'} = 'local'"
    elif kind == "tokenizer":
        parts = [cache_part, "a folder with a saved tokenizer (helpers.train_tokenizer(texts, folder) trains one in "
                             "seconds)"]
        notebook = f"{variable or 'MODEL'} = 'local' (a tokenizer trained on the corpus)"
    else:
        size = local_size or "gpt2"
        parts = [cache_part, f"a folder with a saved model (helpers.save_model_from_config(folder, {size!r}) builds "
                             "one from its config, random weights)"]
        notebook = (f"{variable or 'MODEL'} = 'local' with LOCAL_SIZE = {local_size!r} (built from its config)"
                    if local_size else f"{variable or 'MODEL'} = 'local' (GPT-2 built from its config, LOCAL_SIZE "
                    "its size)")
    fixes = [p for p in parts if p]
    return (f"Fix: {'; or '.join(fixes)}. In notebooks 01 and 04: {notebook}. With internet (Colab), {name!r} "
            "downloads as it is.")


def check_hub_name(name: Any, kind: str = "model", *, variable: str | None = None, local_size: str | None = None,
                   timeout_s: float | None = None) -> str:
    """Where `name` loads from, decided before transformers or datasets see it (their own lookups retry for 24-49 s
    when the Hub does not answer):

    - "local": 'local', a local folder, or not a Hub name at all (the library answers at once);
    - "cache": in the local Hugging Face cache while the Hub is switched off (HF_HUB_OFFLINE=1) or does not answer
      within `timeout_s` (helpers.hub.HUB_LOOKUP_TIMEOUT_S): load it with local_files_only / `datasets_offline`;
    - "hub": the Hub answers: the library asks it as usual (Colab; nothing changes for names that resolve).

    Anything else, a name only the Hub could serve while it does not answer, raises HubUnreachableError with the fix
    (cached names, the one it looks like a typo of, 'local' or a folder). `kind`: 'model', 'tokenizer' or 'dataset'
    ('name[:config]'); `variable`: the notebooks' parameter named in the fix (MODEL, DATASET); `local_size`: the
    helpers.models.GPT2_LADDER rung the fix builds in the name's place (default 'gpt2')."""
    if kind not in ("model", "tokenizer", "dataset"):
        raise ValueError(f"kind must be 'model', 'tokenizer' or 'dataset' (got {kind!r}). Fix: kind='model'.")
    if not isinstance(name, str) or name == "local" or Path(name).exists():
        return "local"
    from huggingface_hub.utils import validate_repo_id

    repo = name.partition(":")[0] if kind == "dataset" else name
    try:
        validate_repo_id(repo)
    except ValueError:
        return "local"  # not a Hub id: the library's own error comes without a request
    cached = in_hub_cache(dataset=name) if kind == "dataset" else in_hub_cache(model_id=name)
    why = hub_unreachable(timeout_s)
    if why is None:
        return "hub"
    if cached:
        return "cache"
    what = {"model": "model", "tokenizer": "tokenizer of", "dataset": "dataset"}[kind]
    cache = datasets_cache() if kind == "dataset" else hub_cache()
    if why == "HF_HUB_OFFLINE=1":
        head = f"{what} {name!r} is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloads"
    else:
        timeout = HUB_LOOKUP_TIMEOUT_S if timeout_s is None else float(timeout_s)
        library = "load_dataset" if kind == "dataset" else "from_pretrained"
        head = (f"{what} {name!r} is not in the local Hugging Face cache ({cache}) and the Hugging Face Hub did not "
                f"answer within {timeout:g} s ({why}); {library} would retry for 25-50 s and then fail")
    raise HubUnreachableError(f"{head}. {_fix_text(name, kind, variable, local_size)}")


@contextlib.contextmanager
def datasets_offline() -> Iterator[None]:
    """datasets reads only its local cache inside this block, as with HF_HUB_OFFLINE=1 at import (datasets fixes
    its `config.HF_HUB_OFFLINE` when imported; `load_dataset` has no local_files_only)."""
    import datasets.config as dconfig

    before = dconfig.HF_HUB_OFFLINE
    dconfig.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dconfig.HF_HUB_OFFLINE = before
