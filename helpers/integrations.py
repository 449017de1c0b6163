"""One DeepSpeed config, three drivers: the raw engine, Hugging Face Trainer and Accelerate (notebook 04).

- Trainer takes the config through ``TrainingArguments(deepspeed=...)``. Values it also owns (batch sizes,
  learning rate, Adam betas/eps, weight decay, clipping, warm-up, fp16/bf16) may be written ``"auto"``: Trainer
  fills them from its arguments (`trainer_ds_config`, `AUTO_FIELDS`, both in helpers.config, which writes that form
  as configs/<name>_trainer.json). A concrete value that disagrees with the arguments is refused when training
  starts. Create the arguments *before* the model: for ZeRO-3 they register the config globally, so
  ``from_pretrained`` builds the model partitioned.
- Accelerate takes the same dict through ``DeepSpeedPlugin(hf_ds_config=...)``; optimizer and scheduler come
  from the config (``DummyOptim`` / ``DummyScheduler`` stand in for them). ``Accelerator(cpu=True)`` silently
  drops DeepSpeed, so `run_accelerate` checks that the model really became a ``DeepSpeedEngine``.
- Both leave global state behind (transformers' ZeRO-3 config, Accelerate's singleton state, an environment
  variable); `reset_hf_deepspeed_state` (helpers.runtime) clears it so a notebook can run twice in one kernel.
- `run_trainer` and `run_accelerate` return the record `train_run` returns (`helpers.train.RunResult`); what only
  these drivers can tell (the config the engine ran, its class) is in its `extras`.

The launch commands for N GPUs are in `helpers.launch`; the launched Trainer program is
notebooks/programs/trainer_train.py.
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from helpers.config import AUTO_FIELDS, HIDDEN_SIZE_AUTO, ConfigError, trainer_ds_config
# the check, the dotted-key reader and the config walk trainer_ds_config and explain_config use
from helpers.config import _MISSING, _check_config_dict as _check_config, _dotted_get as _get, _leaves
from helpers.memory import GB, GiB, measure_peak
from helpers.runtime import (destroy_engine, reset_hf_deepspeed_state, reset_peak_stats, setup_single_process,
                             teardown)
from helpers.train import RunResult

if TYPE_CHECKING:
    from helpers.hardware import Runtime

__all__ = ["auto_table", "config_differences", "training_arguments", "ordered_blocks", "causal_lm_collator",
           "fix_causal_lm_loss", "loss_token_count", "StepRecorder", "recorded_result", "accelerate_precision",
           "teardown_hf", "agreement"]


def _flatten(config: dict[str, Any]) -> dict[str, Any]:
    """dotted key -> value of every non-dict value (an empty section adds nothing)."""
    return {key: value for key, value in _leaves(config) if not isinstance(value, dict)}


def auto_table(ds_config: dict[str, Any], trainer_config: dict[str, Any],
               resolved: dict[str, Any] | None = None) -> str:
    """Key | helpers value | what Trainer is given | where it comes from | what the engine ran (if known)
    (notebook 04)."""
    rows = [("key", "helpers config", "Trainer config", "filled from", "engine ran")]
    for key, source in {**AUTO_FIELDS, **HIDDEN_SIZE_AUTO}.items():
        given = _get(trainer_config, key)
        if given is _MISSING:
            continue
        ran = "" if resolved is None else _get(resolved, key, "-")
        rows.append((key, str(_get(ds_config, key, "-")), str(given), source if given == "auto" else "(as given)",
                     str(ran)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    if resolved is None:
        widths[4] = 0
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths) if w).rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def config_differences(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (reference value, other value)} for every leaf that differs or exists on one side only
    (notebook 04)."""
    a, b = _flatten(reference), _flatten(other)
    return {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in sorted(a.keys() | b.keys())
            if a.get(k, "<absent>") != b.get(k, "<absent>")}


def training_arguments(output_dir: str | Path, ds_config: dict[str, Any], runtime: "Runtime", *, steps: int,
                       seed: int = 0, checkpointing: bool = False, progress: bool = True, auto: bool = True,
                       **overrides: Any) -> Any:
    """TrainingArguments whose values agree with the concrete `ds_config`, which Trainer gets "auto"-filled
    (notebook 04).

    With `auto=False` the concrete config is passed as it is: it works too, as long as every value agrees
    with these arguments (Trainer refuses a mismatch when training starts). Create the arguments BEFORE the
    model: with ZeRO-3 they make from_pretrained build the model partitioned.
    """
    from transformers import TrainingArguments

    _check_config(ds_config)
    if runtime.precision == "fp16" and not runtime.has_gpu:
        raise ConfigError("fp16 needs a GPU. Fix: on CPU train in fp32 (helpers.course_config(name, runtime)).")
    params = _get(ds_config, "optimizer.params", {})
    betas = params.get("betas", [0.9, 0.999])
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=int(ds_config["train_micro_batch_size_per_gpu"]),
        gradient_accumulation_steps=int(ds_config.get("gradient_accumulation_steps", 1)),
        max_steps=steps,
        learning_rate=float(params.get("lr", 5e-5)),
        adam_beta1=float(betas[0]), adam_beta2=float(betas[1]),
        adam_epsilon=float(params.get("eps", 1e-8)),
        weight_decay=float(params.get("weight_decay", 0.0)),
        max_grad_norm=float(ds_config.get("gradient_clipping", 1.0)),
        warmup_steps=int(_get(ds_config, "scheduler.params.warmup_num_steps", 0)),
        fp16=runtime.precision == "fp16", bf16=runtime.precision == "bf16",
        gradient_checkpointing=checkpointing,
        train_sampling_strategy="sequential",  # the batches come pre-ordered (`ordered_blocks`)
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=not progress, seed=seed,
        deepspeed=trainer_ds_config(ds_config) if auto else copy.deepcopy(ds_config),
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def ordered_blocks(train_blocks: Any, micro_batch: int, batches: int, seed: int = 0) -> Any:
    """The first `batches` batches `train_run` would draw, as a Dataset in that order (for a sequential sampler)
    (notebook 04)."""
    from datasets import Dataset

    from helpers.data import as_tensors, block_loader

    loader = block_loader(train_blocks, micro_batch, seed=seed)
    rows = [row for _ in range(batches) for row in next(loader)["input_ids"].tolist()]
    return Dataset.from_dict({"input_ids": rows}).with_transform(as_tensors)  # not with_format("torch"): as_tensors


def causal_lm_collator(features: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack packed blocks; the labels are the inputs (the model shifts them) (notebook 04)."""
    import torch

    ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
    return {"input_ids": ids, "labels": ids}


def fix_causal_lm_loss(model: Any) -> Any:
    """Tell Trainer the model's loss shifts labels, so it divides by the T-1 predicted tokens per block, not T
    (notebook 04).

    GPT2LMHeadModel has no `loss_type` transformers recognises; Trainer then counts every label token and
    reports (and back-propagates) the loss times (T-1)/T (see `loss_token_count`).
    """
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    return model


def loss_token_count(trainer: Any, batch: dict[str, Any]) -> int:
    """How many tokens Trainer divides this batch's summed loss by (its `num_items_in_batch`) (notebook 04)."""
    import torch

    n = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    return int(n)


class StepRecorder:
    """Per-step losses and tokens/s after the first `untimed_steps`, from a hand-written loop or as a Trainer
    callback (as `train_run` times its steps) (notebook 04)."""

    def __init__(self, tokens_per_step: int, untimed_steps: int = 2, cuda: bool = False):
        self.tokens_per_step = tokens_per_step
        self.untimed_steps = untimed_steps
        self.cuda = cuda
        self.losses: list[float] = []
        self.times: list[float] = []
        self.start = time.perf_counter()

    def _now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self) -> None:
        self.start = self._now()

    def step(self, loss: float | None = None) -> None:
        """Call after each optimizer step (with its loss, unless the Trainer log supplies it)."""
        self.times.append(self._now())
        if loss is not None:
            self.losses.append(float(loss))

    @property
    def step_seconds(self) -> list[float]:
        """Seconds of each timed step (after the first `untimed_steps`), end to end: `RunResult.step_seconds`."""
        first = max(self.untimed_steps, 1)
        return [round(b - a, 5) for a, b in zip(self.times[first - 1:], self.times[first:])]

    @property
    def tokens_per_s(self) -> float:
        done = len(self.times) - self.untimed_steps
        if done <= 0:
            return 0.0
        t0 = self.times[self.untimed_steps - 1] if self.untimed_steps else self.start
        return done * self.tokens_per_step / max(self.times[-1] - t0, 1e-9)

    def trainer_callback(self) -> Any:
        """A TrainerCallback feeding this recorder (needs logging_steps=1 for one loss per step)."""
        from transformers import TrainerCallback

        recorder = self

        class _Recorder(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                recorder.begin()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                recorder.step()

            def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
                if logs and "loss" in logs:
                    recorder.losses.append(float(logs["loss"]))

        return _Recorder()


def recorded_result(name: str, recorder: StepRecorder, mem: Any, *, runtime: "Runtime", ds_config: dict[str, Any],
                    dataset: Any, params: int = 0, checkpointing: bool = False, model_name: str = "",
                    estimated_bytes: int = 0, extras: dict[str, Any] | None = None) -> RunResult:
    """A `RunResult` (the record `train_run` returns) from a StepRecorder and a `measure_peak` measurement;
    `extras`: what the driver adds (`driver_extras`) (notebook 04)."""
    return RunResult(
        name=name, model=model_name, params=params, config=name, precision=runtime.precision,
        micro_batch=int(ds_config["train_micro_batch_size_per_gpu"]),
        grad_accum=int(ds_config.get("gradient_accumulation_steps", 1)),
        seq_len=int(dataset[0]["input_ids"].shape[-1]), steps=len(recorder.times), checkpointing=checkpointing,
        runtime=runtime.label, losses=list(recorder.losses), tokens_per_s=round(recorder.tokens_per_s, 1),
        step_seconds=recorder.step_seconds,
        peak_vram_gib=round((mem.peak_gpu_allocated - mem.baseline_gpu_allocated) / GiB, 3),
        peak_reserved_gib=round(mem.peak_gpu_reserved / GiB, 3), peak_rss_gb=round(mem.peak_rss / GB, 3),
        baseline_rss_gb=round(mem.baseline_rss / GB, 3), estimated_vram_gib=round(estimated_bytes / GiB, 3),
        seconds=round(mem.seconds, 2), extras=dict(extras or {}))


def driver_extras(driver: str, engine: Any) -> dict[str, Any]:
    """What a Hugging Face driver adds to its RunResult: its name, the engine's class and the config it ran."""
    return {"driver": driver, "engine_class": _check_engine(engine, driver),
            "resolved_config": copy.deepcopy(engine.config)}


def _tokens_per_step(ds_config: dict[str, Any], dataset: Any) -> int:
    return (int(ds_config["train_micro_batch_size_per_gpu"]) * int(ds_config.get("gradient_accumulation_steps", 1))
            * int(dataset[0]["input_ids"].shape[-1]))


def _param_count(model: Any) -> int:
    return sum({id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters()}.values())


def _check_engine(engine: Any, driver: str) -> str:
    import deepspeed

    if not isinstance(engine, deepspeed.DeepSpeedEngine):
        raise RuntimeError(f"{driver} did not wrap the model in a DeepSpeed engine (got {type(engine).__name__}). "
                           "Fix: do not pass cpu=True to Accelerator (it drops DeepSpeed silently) and pass the "
                           "config (TrainingArguments(deepspeed=...) / DeepSpeedPlugin(hf_ds_config=...)).")
    return type(engine).__name__


def run_trainer(name: str, model_factory: Callable[[], Any], dataset: Any, *, runtime: "Runtime",
                ds_config: dict[str, Any], output_dir: str | Path, steps: int | None = None, seed: int = 0,
                checkpointing: bool = False, untimed_steps: int = 2, estimated_bytes: int = 0, model_name: str = "",
                progress: bool = True, auto: bool = True, after: Callable[[Any], None] | None = None) -> RunResult:
    """Train with transformers' Trainer on `ds_config` and measure it like `train_run` (notebook 04).

    TrainingArguments come first, then `model_factory()` (so ZeRO-3 builds it partitioned). `after(trainer)`
    runs once training is done, before the teardown (e.g. save the model). Global DeepSpeed/Accelerate state is
    reset before and after. `extras`: the driver, the engine's class and the config it ran (`driver_extras`).
    """
    from transformers import Trainer

    steps = steps or len(dataset) // int(ds_config["train_micro_batch_size_per_gpu"])
    _torch_seed(seed)
    setup_single_process()
    reset_hf_deepspeed_state()
    reset_peak_stats()
    recorder = StepRecorder(_tokens_per_step(ds_config, dataset), untimed_steps, runtime.has_gpu)
    ns: dict[str, Any] = {}
    with measure_peak() as mem:
        args = training_arguments(output_dir, ds_config, runtime, steps=steps, seed=seed,
                                  checkpointing=checkpointing, progress=progress, auto=auto)
        model = fix_causal_lm_loss(model_factory())
        model.config.use_cache = False
        params = _param_count(model)
        ns["trainer"] = Trainer(model=model, args=args, train_dataset=dataset, data_collator=causal_lm_collator,
                                callbacks=[recorder.trainer_callback()])
        del model
        ns["trainer"].train()
    trainer = ns["trainer"]
    extras = driver_extras("Trainer", trainer.model_wrapped)
    if after is not None:
        after(trainer)
    del trainer
    teardown_hf(ns, "trainer")
    return recorded_result(name, recorder, mem, runtime=runtime, ds_config=ds_config, dataset=dataset, params=params,
                           checkpointing=checkpointing, model_name=model_name, estimated_bytes=estimated_bytes,
                           extras=extras)


def _torch_seed(seed: int) -> None:
    """torch.manual_seed, imported lazily."""
    import torch

    torch.manual_seed(seed)


def run_accelerate(name: str, model_factory: Callable[[], Any], dataset: Any, *, runtime: "Runtime",
                   ds_config: dict[str, Any], steps: int | None = None, seed: int = 0, checkpointing: bool = False,
                   untimed_steps: int = 2, estimated_bytes: int = 0, model_name: str = "",
                   progress: bool = True) -> RunResult:
    """Train with Accelerate + DeepSpeedPlugin on the same dict and measure it like `train_run` (notebook 04).

    `extras`: the driver, the engine's class and the config it ran (`driver_extras`).
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    from helpers.progress import progress_bar

    _check_config(ds_config)
    micro_batch = int(ds_config["train_micro_batch_size_per_gpu"])
    steps = steps or len(dataset) // micro_batch
    torch.manual_seed(seed)
    setup_single_process()
    reset_hf_deepspeed_state()
    reset_peak_stats()
    recorder = StepRecorder(_tokens_per_step(ds_config, dataset), untimed_steps, runtime.has_gpu)
    grad_accum = int(ds_config.get("gradient_accumulation_steps", 1))
    ns: dict[str, Any] = {}
    with measure_peak() as mem:
        plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds_config))
        # never cpu=True: Accelerate then drops DeepSpeed without a word
        ns["accelerator"] = accelerator = Accelerator(deepspeed_plugin=plugin,
                                                      mixed_precision=accelerate_precision(runtime))
        model = fix_causal_lm_loss(model_factory())  # after the Accelerator: ZeRO-3 builds it partitioned
        model.config.use_cache = False
        params = _param_count(model)
        if checkpointing:
            model.gradient_checkpointing_enable()
        # the config holds the optimizer and scheduler: these placeholders stand in for them
        optimizer = DummyOptim(model.parameters())
        scheduler = DummyScheduler(optimizer)
        loader = torch.utils.data.DataLoader(dataset, batch_size=micro_batch, shuffle=False,
                                             collate_fn=causal_lm_collator)
        ns["engine"], ns["optimizer"], loader, ns["scheduler"] = accelerator.prepare(model, optimizer, loader,
                                                                                     scheduler)
        del model, optimizer, scheduler
        engine = ns["engine"]
        engine.train()
        batches = iter(loader)
        recorder.begin()
        for _ in (bar := progress_bar(range(steps), desc=name, disable=not progress)):
            step_loss = 0.0
            for _ in range(grad_accum):
                batch = next(batches)
                with accelerator.accumulate(engine):  # marks the accumulation boundary for DeepSpeed
                    loss = engine(**batch).loss
                    accelerator.backward(loss)  # engine.backward + engine.step (DeepSpeed steps at the boundary)
                    ns["optimizer"].step()  # no-ops under DeepSpeed, kept so the loop reads as any Accelerate loop
                    ns["scheduler"].step()
                    ns["optimizer"].zero_grad()
                step_loss += loss.item() / grad_accum
            recorder.step(step_loss)
            bar.set_postfix(loss=f"{step_loss:.3f}")
        del loss, batch, batches, loader, engine
    extras = driver_extras("Accelerate", ns["engine"])
    teardown_hf(ns, "engine", "optimizer", "scheduler", "accelerator")
    return recorded_result(name, recorder, mem, runtime=runtime, ds_config=ds_config, dataset=dataset, params=params,
                           checkpointing=checkpointing, model_name=model_name, estimated_bytes=estimated_bytes,
                           extras=extras)


def accelerate_precision(runtime: "Runtime") -> str:
    """Accelerator's mixed_precision for this runtime: 'fp16', 'bf16' or 'no' (fp32) (notebook 04)."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(runtime.precision, "no")


# ---------------------------------------------------------------- global state and teardown

def teardown_hf(namespace: dict[str, Any], *names: str) -> int:
    """Like `helpers.teardown`, for Trainers and Accelerators too: destroy their engines, drop their
    references, reset the global state; returns the CUDA bytes still allocated (notebook 04)."""
    import deepspeed

    destroyed: set[int] = set()
    for name in names:
        obj = namespace.pop(name, None)
        if obj is None:
            continue
        engines, accelerator = [], None
        if hasattr(obj, "model_wrapped") and hasattr(obj, "accelerator"):  # a Trainer
            engines.append(obj.model_wrapped)
            accelerator = obj.accelerator
            for attr in ("model", "model_wrapped", "deepspeed", "optimizer", "lr_scheduler"):
                if hasattr(obj, attr):
                    setattr(obj, attr, None)
            handler = getattr(obj, "callback_handler", None)
            for attr in ("model", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"):
                if handler is not None and hasattr(handler, attr):
                    setattr(handler, attr, None)
        elif type(obj).__name__ == "Accelerator":
            accelerator = obj
            engines.extend(getattr(obj, "_models", []))
        else:
            engines.append(obj)
        for engine in engines:
            if isinstance(engine, deepspeed.DeepSpeedEngine) and id(engine) not in destroyed:
                destroyed.add(id(engine))
                destroy_engine(engine)
        if accelerator is not None:
            accelerator.free_memory()
        state = getattr(obj, "state", None)
        if isinstance(state, dict):
            state.clear()
        del obj, engines, accelerator
    reset_hf_deepspeed_state()
    return teardown(namespace)


def agreement(reference: RunResult, other: RunResult) -> float:
    """Largest per-step |loss difference| between two runs over their common steps (nan if none) (notebook 04)."""
    pairs = list(zip(reference.losses, other.losses))
    return max((abs(a - b) for a, b in pairs), default=math.nan)
