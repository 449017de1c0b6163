"""ZeRO-3 done right, and checkpoints that survive (notebook 02).

- A model meant for ZeRO-3 is built *partitioned* (``deepspeed.zero.Init``) through the Hugging Face
  integration: create ``HfDeepSpeedConfig(ds_config)`` first and keep it alive; ``from_pretrained`` /
  ``from_config`` then build each layer straight into its partitions and initialise weights the
  Hugging Face way. A bare ``zero.Init`` around ``from_config`` skips that initialisation.
- ``engine.save_checkpoint`` writes partitioned states; ``zero_to_fp32`` consolidates them into one fp32
  state dict, which becomes an ordinary Hugging Face checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def build_zero3_model(ds_config: dict[str, Any], name_or_path: str | None = None, config: Any = None,
                      seed: int | None = None) -> tuple[Any, Any]:
    """(model, keep_alive): a causal LM built partitioned under ZeRO-3 via HfDeepSpeedConfig.

    Give a checkpoint (`name_or_path`, loaded with from_pretrained) or a `config` (from_config, random
    weights initialised as without ZeRO). Keep `keep_alive` referenced until deepspeed.initialize has
    run; call `release_zero3()` after the engine is torn down.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    stage = ds_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"build_zero3_model needs a ZeRO stage 3 config (got stage {stage}); "
                         "for stages 0-2 load the model normally")
    if (name_or_path is None) == (config is None):
        raise ValueError("give exactly one of name_or_path (from_pretrained) or config (from_config)")
    keep_alive = HfDeepSpeedConfig(ds_config)  # from here on transformers builds models under zero.Init
    if seed is not None:
        torch.manual_seed(seed)
    if name_or_path is not None:
        model = AutoModelForCausalLM.from_pretrained(name_or_path)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return model, keep_alive


def release_zero3() -> None:
    """Forget the global ZeRO-3 config, so later models are built whole again (after a ZeRO-3 run)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def save_checkpoint(engine: Any, directory: str | Path, tag: str | None = None) -> Path:
    """engine.save_checkpoint: model, optimizer, scheduler and step, partitioned as trained."""
    directory = Path(directory)
    engine.save_checkpoint(str(directory), tag=tag)
    return directory


def resume_checkpoint(engine: Any, directory: str | Path, tag: str | None = None) -> dict[str, Any]:
    """engine.load_checkpoint into a freshly initialised engine of the same config; returns client state."""
    path, client_state = engine.load_checkpoint(str(directory), tag=tag)
    if path is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint found in {directory} (tag {tag!r}): "
                                "check the folder and its 'latest' file")
    return client_state or {}


def consolidate_to_hf(checkpoint_dir: str | Path, model_config: Any, out_dir: str | Path,
                      tag: str | None = None) -> Path:
    """zero_to_fp32: merge a ZeRO-2/3 checkpoint into one fp32 state dict, save it as a Hugging Face model."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    release_zero3()  # the consolidated model must be built whole
    model = AutoModelForCausalLM.from_config(model_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied to the input embedding
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))
    return out_dir
