"""ZeRO-3 done right, and checkpoints that survive (notebook 02); saved ZeRO-3 weights checked (notebook 04).

- A model meant for ZeRO-3 is built *partitioned* (``deepspeed.zero.Init``) through the Hugging Face
  integration: create ``HfDeepSpeedConfig(ds_config)`` first and keep it alive; ``from_pretrained`` /
  ``from_config`` then build each layer straight into its partitions and initialise weights the
  Hugging Face way. A bare ``zero.Init`` around ``from_config`` skips that initialisation.
- ``engine.save_checkpoint`` writes partitioned states; ``zero_to_fp32`` consolidates them into one fp32
  state dict, which becomes an ordinary Hugging Face checkpoint.
- Under ZeRO-3 a plain ``state_dict()`` holds shape-[0] placeholders (`placeholder_tensors`); `check_saved_weights`
  compares a saved folder with the engine's gathered weights, tensor by tensor, and `logits_for` compares a
  reloaded model with the engine.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from helpers.atomic import check_replaceable, write_atomically

__all__ = [ "consolidate_to_hf",
           "placeholder_tensors", "check_saved_weights", "logits_for"]


def build_zero3_model(ds_config: dict[str, Any], name_or_path: str | None = None, config: Any = None,
                      seed: int | None = None) -> tuple[Any, Any]:
    """(model, keep_alive): a causal LM built partitioned under ZeRO-3 via HfDeepSpeedConfig (notebook 02).

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
    """Forget the global ZeRO-3 config, so later models are built whole again (after a ZeRO-3 run) (notebook 02)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def _barrier() -> None:
    """Wait for every rank (nothing to wait for in one process)."""
    from deepspeed import comm as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(engine: Any, directory: str | Path, tag: str | None = None) -> Path:
    """engine.save_checkpoint: model, optimizer, scheduler and step, partitioned as trained (notebook 02).

    Written atomically: every rank saves into `<tag>.partial`, then rank 0 renames it to `<tag>` and points
    'latest' at it. An interrupted save leaves the previous checkpoint and 'latest' as they were; its partial
    folder is removed by the next save. The tag defaults to DeepSpeed's `global_step<N>`.
    """
    directory = Path(directory)
    tag = _check_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    partial = directory / f"{tag}.partial"  # the same name on every rank
    if engine.global_rank == 0 and directory.is_dir():  # every interrupted save's folder, whatever its tag (issue 41:
        for stale in directory.glob("*.partial"):      # another tag's stayed, GBs on Colab)
            if stale.is_dir():
                shutil.rmtree(stale)
    _barrier()
    engine.save_checkpoint(str(directory), tag=partial.name, save_latest=False)
    if engine.global_rank == 0:
        write_atomically(directory / tag, lambda tmp: os.replace(partial, tmp))
        write_atomically(directory / "latest", lambda tmp: tmp.write_text(tag))
    _barrier()
    return directory


def _check_tag(tag: Any) -> str:
    """A checkpoint tag names one folder: no path separator, not '.', '..' or a '.partial' name (issue 41: a tag with
    '/' failed with FileNotFoundError and left its .partial folder)."""
    text = str(tag)
    if not text or text in (".", "..") or "/" in text or os.sep in text or text.endswith(".partial"):
        fix = text.replace("/", "_").replace(os.sep, "_").removesuffix(".partial").strip(".") or "step0"
        raise ValueError(f"checkpoint tag {tag!r}: a tag names one folder inside the checkpoint directory. "
                         f"Fix: tag={fix!r}")
    return text


def _saved_tags(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.name.endswith(".partial")) \
        if directory.is_dir() else []


def resume_checkpoint(engine: Any, directory: str | Path, tag: str | None = None) -> dict[str, Any]:
    """engine.load_checkpoint into a freshly initialised engine of the same config; returns client state (notebook 02).

    Checked first, each with its fix (issue 41: DeepSpeed ends in a bare AssertionError): the tag ('latest' when
    None) is a saved folder, not an interrupted save's; the checkpoint was saved at the engine's kind of ZeRO stage
    (a ZeRO-3 checkpoint holds partitioned model states, stages 0-2 one model file: neither loads into the other)."""
    directory = Path(directory)
    chosen = tag
    if chosen is None and (directory / "latest").is_file():
        chosen = (directory / "latest").read_text().strip()
    if chosen is not None:
        chosen = _check_tag(chosen)
        if not (directory / chosen).is_dir():
            saved = _saved_tags(directory)
            fix = f"tag={saved[-1]!r} (saved here: {', '.join(saved)})" if saved else "save a checkpoint first"
            interrupted = (directory / f"{chosen}.partial").exists()
            raise FileNotFoundError(f"no DeepSpeed checkpoint {chosen!r} in {directory}"
                                    + (": its save was interrupted (only a .partial folder is there). Fix: save it "
                                       f"again, or resume from {fix}" if interrupted else f". Fix: {fix}"))
        stage = getattr(engine, "zero_optimization_stage", lambda: None)()
        if stage is not None:
            saved_stage3 = any((directory / chosen).glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))
            if saved_stage3 != (stage == 3):
                raise ValueError(
                    f"checkpoint {directory / chosen} was saved by a {'ZeRO-3' if saved_stage3 else 'ZeRO stage 0-2'} "
                    f"engine and this engine is ZeRO stage {stage}: DeepSpeed loads a checkpoint only into the kind of "
                    "stage that saved it. Fix: resume with the config it was saved with, or consolidate it "
                    "(consolidate_to_hf, zero_to_fp32) and start the new config from those weights")
    path, client_state = engine.load_checkpoint(str(directory), tag=chosen)
    if path is None:
        interrupted = tag is not None and (Path(directory) / f"{tag}.partial").exists()
        raise FileNotFoundError(f"no DeepSpeed checkpoint found in {directory} (tag {tag!r})"
                                + (": its save was interrupted (only a .partial folder is there). Fix: save it "
                                   "again, or resume from 'latest' (tag=None)" if interrupted else
                                   ": check the folder and its 'latest' file"))
    return client_state or {}


def consolidate_to_hf(checkpoint_dir: str | Path, model_config: Any, out_dir: str | Path,
                      tag: str | None = None) -> Path:
    """zero_to_fp32: merge a ZeRO-2/3 checkpoint into one fp32 state dict, save it as a Hugging Face model
    (notebook 02).

    `out_dir` is written atomically (a previous model there is replaced once the new one is complete); a folder
    holding anything but a saved model is refused before the checkpoint is read (notebook 02).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    from helpers.models import MODEL_FILES

    check_replaceable(out_dir, MODEL_FILES, "model")
    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    release_zero3()  # the consolidated model must be built whole
    model = AutoModelForCausalLM.from_config(model_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}  # tied to the input embedding
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    return write_atomically(out_dir, lambda tmp: model.save_pretrained(str(tmp)))


# ---------------------------------------------------------------- saved ZeRO-3 weights, checked (notebook 04)

def placeholder_tensors(state_dict: dict[str, Any]) -> tuple[int, int]:
    """(empty tensors, all tensors) in a state dict: ZeRO-3 leaves its partitioned parameters as shape [0]
    (notebook 04)."""
    empty = sum(1 for t in state_dict.values() if hasattr(t, "numel") and t.numel() == 0)
    return empty, len(state_dict)


def check_saved_weights(directory: str | Path, engine: Any) -> dict[str, Any]:
    """Compare a saved model folder with the engine's (gathered) ZeRO-3 weights, tensor by tensor (notebook 04).

    Returns {"file", "tensors", "empty", "shape_mismatches", "max_abs_diff"}; a folder without weights
    raises FileNotFoundError naming the fix.
    """
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        listing = sorted(p.name for p in Path(directory).iterdir()) if Path(directory).is_dir() else []
        raise FileNotFoundError(f"no *.safetensors weights in {directory} (it holds {listing}). Under ZeRO-3 "
                                "Trainer writes weights only with stage3_gather_16bit_weights_on_model_save: true; "
                                "otherwise recover them from the DeepSpeed checkpoint with zero_to_fp32.")
    saved: dict[str, Any] = {}
    for f in files:
        saved.update(load_file(str(f)))
    module = getattr(engine, "module", engine)
    named = dict(module.named_parameters())
    empty = sum(1 for t in saved.values() if t.numel() == 0)
    mismatches, worst = [], 0.0
    for key, tensor in saved.items():
        param = named.get(key)
        if param is None:
            continue
        full = _full_tensor(param)
        if tuple(full.shape) != tuple(tensor.shape):
            mismatches.append(f"{key}: saved {tuple(tensor.shape)} vs model {tuple(full.shape)}")
            continue
        worst = max(worst, float((tensor.float() - full).abs().max()) if full.numel() else 0.0)
    return {"file": ", ".join(f.name for f in files), "tensors": len(saved), "empty": empty,
            "shape_mismatches": mismatches, "max_abs_diff": worst}


def _full_tensor(param: Any) -> Any:
    """The whole parameter in fp32 on the CPU; a ZeRO-3 partition is gathered (and released again) for it."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE:
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().to("cpu", torch.float32).clone()
    return param.detach().to("cpu", torch.float32).clone()  # whole already (persistent, or not ZeRO-3)


def logits_for(model: Any, ids: Any) -> Any:
    """Logits of `model` (an engine or a plain model) for `ids`, in fp32 on the CPU, without gradients (notebook 04)."""
    import torch

    was_training = model.training
    model.eval()
    device = next(getattr(model, "module", model).parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids.to(device)).logits.float().cpu()
    if was_training:
        model.train()
    return out
