"""Model sizes the course uses, built from configs: no download needed (notebooks 00-02).

The GPT-2 family ladder has the published architectures of gpt2 ... gpt2-xl plus larger
rungs of the same shape, so "how big a model fits" can be asked offline.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from helpers.atomic import needs_writing, write_atomically
from helpers.hub import HUB_LOOKUP_TIMEOUT_S

__all__ = [ "gpt2_config", "load_causal_lm", "model_shape", "save_model_from_config"]

# name -> (hidden size, layers, heads); vocab 50257, context 1024 as in GPT-2
GPT2_LADDER: dict[str, tuple[int, int, int]] = {
    "gpt2-tiny": (64, 2, 2),  # 3.3M with GPT-2's vocabulary: CPU smoke runs
    "gpt2": (768, 12, 12),  # 124M
    "gpt2-medium": (1024, 24, 16),  # 355M
    "gpt2-large": (1280, 36, 20),  # 774M
    "gpt2-xl": (1600, 48, 25),  # 1.56B
    "gpt2-2.7b": (2560, 32, 32),  # 2.65B (GPT-Neo-2.7B's shape)
    "gpt2-6.7b": (4096, 32, 32),  # 6.65B
}
GPT2_VOCAB = 50257
GPT2_CONTEXT = 1024
# How long the planner waits for the Hugging Face Hub to answer one request about a model id: HUB_LOOKUP_TIMEOUT_S
# (helpers.hub, imported above; 3 s).


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the estimators need to know about a causal LM."""

    name: str
    n_params: int
    largest_layer_params: int
    hidden: int
    n_layers: int
    n_heads: int
    vocab: int
    # the longest sequence the model takes (learned positions: n_positions / max_position_embeddings); 0: not known
    n_positions: int = 0
    # a Llama-shaped model's layer dimensions (helpers.long_context.LongContextShape): its activations are then counted
    # part by part as in notebook 06 (helpers.activation_bytes); None: the GPT formula
    llama: Any = None


# names learners type for a ladder rung (Hugging Face calls GPT-2 124M "gpt2", its paper "small")
_LADDER_ALIASES = {"gpt2-small": "gpt2", "small": "gpt2", "gpt2-base": "gpt2", "base": "gpt2", "gpt-2": "gpt2",
                   "gpt": "gpt2", "medium": "gpt2-medium", "large": "gpt2-large", "xl": "gpt2-xl",
                   "tiny": "gpt2-tiny", "gpt2-extra-large": "gpt2-xl", "gpt2-xlarge": "gpt2-xl"}


def nearest_ladder_name(name: Any) -> str:
    """The ladder rung a learner most likely meant by `name`: an alias ('gpt2-small' -> 'gpt2'), a size ('124M',
    'gpt2-1.5b') -> the rung nearest in parameters, else the closest spelling."""
    text = str(name).strip().lower().replace("_", "-")
    if text in GPT2_LADDER:
        return text
    if text in _LADDER_ALIASES:
        return _LADDER_ALIASES[text]
    count = parse_param_count(re.sub(r"^(gpt-?2)[- ]?", "", text)) if text else None
    if count is not None and count > 0:
        return min(GPT2_LADDER, key=lambda r: abs(math.log(_ladder_shape(r).n_params / count)))
    return difflib.get_close_matches(text, list(GPT2_LADDER), n=1, cutoff=0.0)[0]


def _unknown_size(name: Any, arg: str = "model", sizes: bool = True) -> ValueError:
    """The error for a model name that is not a ladder rung, with the nearest rung as the fix (`arg`=...).

    `sizes`: the call also takes a size such as '350M' (model_shape, plan); gpt2_config and save_model_from_config
    build a rung, so they take ladder names only and say so."""
    guess = nearest_ladder_name(name)
    if sizes:
        return ValueError(f"unknown model size {name!r}: did you mean {guess!r}? Fix: {arg}={guess!r}, another "
                          f"ladder name ({', '.join(GPT2_LADDER)}), a size such as '350M' or '1.3B', or a local "
                          "folder.")
    return ValueError(f"unknown model size {name!r}: did you mean {guess!r}? Fix: {arg}={guess!r}, or another "
                      f"ladder name ({', '.join(GPT2_LADDER)}); this builds a ladder rung, so it takes a ladder "
                      "name, not a size such as '124M' (the fix is the rung nearest to what you typed).")


def gpt2_config(name: str, **overrides: Any) -> Any:
    """A transformers GPT2Config for a ladder rung (no download; notebooks 01-05)."""
    from transformers import GPT2Config

    if not isinstance(name, str) or name not in GPT2_LADDER:
        raise _unknown_size(name, "name", sizes=False)
    hidden, layers, heads = GPT2_LADDER[name]
    kwargs: dict[str, Any] = dict(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=GPT2_VOCAB,
                                  n_positions=GPT2_CONTEXT)
    kwargs.update(overrides)
    return GPT2Config(**kwargs)


def parse_param_count(text: str | float | int) -> int | None:
    """350M, 1.3B, 7e9 or 124000000 -> a parameter count; None when `text` is not a number."""
    if isinstance(text, (int, float)):
        return int(text) if math.isfinite(text) else None
    if not isinstance(text, str):
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmb]?)\s*(params)?\s*", text.lower())
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m.group(2)])


def model_shape(model: str | int | float | Any) -> ModelShape:
    """Parameter counts and dimensions for a size ("1.3B"), a ladder name, a local path / Hub id, or a config
    (notebook 00).

    The model is built on the meta device, so nothing is allocated or downloaded beyond its config. A bare
    size gets the layer shapes of the GPT-2 ladder rung nearest in parameters (for the activation estimate).
    A name that starts like a ladder name ("gpt2-xxl") but is not one, or an empty one, is refused with the
    nearest rung before the Hub is asked (notebooks 00-02, planner).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.memory import count_params

    if isinstance(model, bool) or not (isinstance(model, (str, int, float)) or hasattr(model, "model_type")):
        raise ValueError(f"model must be a size, a ladder name, a folder, a Hub id or a transformers config "
                         f"(got {model!r}, a {type(model).__name__}). Fix: model='gpt2'.")
    count = parse_param_count(model) if isinstance(model, (str, int, float)) else None
    if isinstance(model, (int, float)) and count is None:  # nan, inf
        count = 0
    if count is not None and not count > 0:
        raise ValueError(f"a model size must be a positive parameter count (got {model!r}). Fix: model='124M' "
                         "(or '1.3B', 7e9, or a ladder name such as 'gpt2').")
    if isinstance(model, str) and model not in GPT2_LADDER and (not model.strip() or (
            model.strip().lower().startswith("gpt2") and not Path(model).is_dir())):
        raise _unknown_size(model)  # empty, or looks like a course name: never ask the Hub (23 s of retries offline)
    if isinstance(model, str) and Path(model).is_dir() and not (Path(model) / "config.json").is_file():
        raise ValueError(f"{model!r} is a folder without a config.json, not a saved model. Fix: model='gpt2' (a "
                         "ladder name), or a folder that save_pretrained or helpers.save_model_from_config wrote.")
    if count is not None:
        rung = min((r for r in GPT2_LADDER if r != "gpt2-tiny"),
                   key=lambda r: abs(math.log(model_shape(r).n_params / count)))
        near = model_shape(rung)
        scale = count / near.n_params
        return ModelShape(name=f"{count / 1e9:.2f}B params" if count >= 1e9 else f"{count / 1e6:.0f}M params",
                          n_params=count, largest_layer_params=int(near.largest_layer_params * scale),
                          hidden=near.hidden, n_layers=near.n_layers, n_heads=near.n_heads, vocab=near.vocab,
                          n_positions=near.n_positions)
    cached = _offline_hub_config(model) if isinstance(model, str) else None
    if isinstance(model, str) and model in GPT2_LADDER and cached is None:
        return _ladder_shape(model)
    if cached is not None:
        config, name = cached, model  # offline, from_pretrained(model) loads this cached config's model
    elif isinstance(model, str) and Path(model).is_dir():
        config, name = AutoConfig.from_pretrained(model), Path(model).name
    elif isinstance(model, str):
        config, name = hub_config(model), model
    else:
        config, name = model, getattr(model, "name_or_path", "") or type(model).__name__
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    total, largest = count_params(net)

    def first(*keys: str) -> int:
        for k in keys:
            if getattr(config, k, None) is not None:
                return int(getattr(config, k))
        return 0

    llama = None
    if getattr(config, "model_type", "") == "llama":
        from helpers.long_context import long_context_shape

        llama = long_context_shape(config)
    return ModelShape(name=name, n_params=total, largest_layer_params=largest,
                      hidden=first("hidden_size", "n_embd", "d_model"),
                      n_layers=first("num_hidden_layers", "n_layer", "num_layers"),
                      n_heads=first("num_attention_heads", "n_head"), vocab=first("vocab_size"),
                      n_positions=first("n_positions", "max_position_embeddings", "n_ctx"), llama=llama)


def _offline_hub_config(name: str) -> Any:
    """The config `from_pretrained(name)` would load when the Hub is switched off (HF_HUB_OFFLINE=1) and the local
    Hugging Face cache holds `name` (a real earlier download, or scripts/local_hub.py's stand-in); None otherwise.
    Online, a ladder name is the Hub model's published architecture, so the ladder answers."""
    from helpers.hub import hub_cache, hub_offline, in_hub_cache

    if not hub_offline() or Path(name).is_dir() or not in_hub_cache(model_id=name):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name, local_files_only=True, cache_dir=str(hub_cache()))


def hub_config(repo_id: str, timeout_s: float | None = None) -> Any:
    """The transformers config of a Hugging Face Hub model id, or an error within about `timeout_s` seconds
    (default HUB_LOOKUP_TIMEOUT_S) when the Hub cannot be reached (notebook 00's planner).

    One HEAD request for the repo's config.json with huggingface_hub's own `timeout` and no retries comes first;
    only when it answers does transformers fetch the config (a few kB, never weights). Offline, a config already in
    the local Hugging Face cache is used; otherwise the error says what to type instead.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id
    from transformers import AutoConfig

    timeout = HUB_LOOKUP_TIMEOUT_S if timeout_s is None else timeout_s
    instead = ("Fix: a ladder name (" + ", ".join(GPT2_LADDER) + "), a size such as '1.3B', or a local folder "
               "with a config.json.")
    try:
        validate_repo_id(repo_id)
    except ValueError:
        raise ValueError(f"{repo_id!r} is not a folder here, nor a Hugging Face Hub id (org/name). {instead}") from None
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=timeout)
    except RepositoryNotFoundError as exc:  # GatedRepoError too: the Hub answered, no such (public) model
        raise ValueError(f"no public model {repo_id!r} on the Hugging Face Hub "
                         f"({type(exc).__name__}). {instead}") from None
    except EntryNotFoundError:
        raise ValueError(f"{repo_id!r} on the Hugging Face Hub has no config.json. {instead}") from None
    except HfHubHTTPError as exc:
        raise OSError(f"the Hugging Face Hub refused the lookup of {repo_id!r}: {exc}. {instead}") from None
    except Exception as exc:  # no network, a timeout, offline mode (httpx / huggingface_hub errors)
        try:
            return AutoConfig.from_pretrained(repo_id, local_files_only=True)
        except Exception:
            reason = f"{type(exc).__name__}: {exc}"
            raise OSError(f"could not reach the Hugging Face Hub within {timeout:g} s to look up {repo_id!r} "
                          f"({reason[:160]}), and it is not in the local cache. {instead}") from None
    return AutoConfig.from_pretrained(repo_id)


# what save_pretrained writes for a causal LM (safetensors, sharded or not)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json")


def model_folder_problem(path: str | Path) -> str | None:
    """What is missing or broken in a saved Hugging Face model folder; None when it is complete.

    Complete: config.json (and generation_config.json, if there) parse, and every weights file (model.safetensors,
    or each shard the index names) opens with its full length.
    """
    from safetensors import safe_open

    path = Path(path)
    if not (path / "config.json").is_file():
        return "no config.json"
    for name in ("config.json", "generation_config.json"):  # the second only for generative models
        if not (path / name).is_file():
            continue
        try:
            json.loads((path / name).read_text())
        except ValueError:
            return f"{name} is cut short"
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        weights = [path / "model.safetensors"]
    elif index.is_file():
        try:
            weights = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError):
            return f"{index.name} is cut short"
    else:
        return "config.json without model.safetensors"
    for f in weights:
        if not f.is_file():
            return f"no {f.name}"
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception:  # SafetensorError: header or data shorter than declared
            return f"{f.name} is cut short or unreadable"
    return None


# config.json keys that say how a folder was written, not which model it holds
_VOLATILE_CONFIG_KEYS = ("transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path")
# written into config.json by save_model_from_config: the seed of its random weights (a saved folder's weights
# depend on it, and nothing else in the folder says which seed made them)
SEED_CONFIG_KEY = "ds_course_seed"


def _saved_config_differs(path: Path, config: Any) -> str | None:
    """What in the folder's config.json differs from `config` ('n_embd 64, asked 1024'); None when it matches."""
    try:
        saved = type(config).from_json_file(str(path / "config.json")).to_dict()
    except Exception as exc:  # unreadable, or another model type
        return f"its config.json does not read as a {type(config).__name__} ({type(exc).__name__})"
    wanted = json.loads(json.dumps(config.to_dict()))
    saved = json.loads(json.dumps(saved))
    diff = [f"{k} {saved.get(k)!r}, asked {wanted.get(k)!r}" for k in sorted(set(wanted) | set(saved))
            if k not in _VOLATILE_CONFIG_KEYS and saved.get(k) != wanted.get(k)]
    return ", ".join(diff[:4]) + (" ..." if len(diff) > 4 else "") if diff else None


def save_model_from_config(directory: str | Any, size: str = "gpt2", seed: int = 0, **overrides: Any) -> str:
    """Build a ladder model from its config (random weights, seeded), save it in Hugging Face format (notebook 01).

    Offline stand-in for a Hub checkpoint: it loads through the same ``from_pretrained`` call (notebooks 01,
    02, 04). A complete folder is reused only when its config.json is the one asked for (size, overrides and the
    seed, which is written there as `SEED_CONFIG_KEY`); otherwise it is rewritten, saying why. The folder is written
    atomically, and a half-written one (from an interrupted save of an older version) is rebuilt. A bad directory,
    size or seed is refused with the fix before anything is built.
    """
    from helpers.checks import check_number

    ladder = size if isinstance(size, str) and size in GPT2_LADDER else "gpt2"
    if isinstance(directory, bytes) or not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ValueError(f"directory must be a folder to save the model in (got {directory!r}). "
                         f"Fix: directory={'model-' + ladder!r} (or any new folder, e.g. WORK / 'model').")
    if not isinstance(size, str) or size not in GPT2_LADDER:
        raise _unknown_size(size, "size", sizes=False)  # refused before anything is built
    check_number("seed", seed, positive=False, integer=True, example=0)
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    config = gpt2_config(size, **overrides)
    setattr(config, SEED_CONFIG_KEY, seed)
    rewrite = needs_writing(path, model_folder_problem, MODEL_FILES, "model")
    if not rewrite:
        differs = _saved_config_differs(path, config)
        if differs:
            print(f"{path}: holds another model than {size!r} with these settings ({differs}): rewriting it")
            rewrite = True
    if rewrite:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        write_atomically(path, lambda tmp: model.save_pretrained(str(tmp)))
    return str(path)


def load_causal_lm(name_or_path: str, **kwargs: Any) -> Any:
    """AutoModelForCausalLM.from_pretrained: 'gpt2' from the Hub on Colab, a local folder offline (notebook 02).

    A Hub name that is neither cached nor served by the Hub within HUB_LOOKUP_TIMEOUT_S is refused with the fix
    before transformers retries (`helpers.hub.check_hub_name`); a cached one loads from the cache when the Hub does not
    answer."""
    from transformers import AutoModelForCausalLM

    from helpers.hub import check_hub_name, hub_cache

    size = name_or_path if name_or_path in GPT2_LADDER else None
    if check_hub_name(name_or_path, "model", variable="MODEL", local_size=size) == "cache":
        kwargs.setdefault("local_files_only", True)
        kwargs.setdefault("cache_dir", str(hub_cache()))
    return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


@functools.lru_cache(maxsize=None)
def _ladder_shape(name: str) -> ModelShape:
    """model_shape of a ladder rung, computed once."""
    return dataclasses.replace(model_shape(gpt2_config(name)), name=name)
