"""One training run, DeepSpeed engine or plain PyTorch, measured: the loop behind notebooks 01-05.

Notebook 01 writes the DeepSpeed loop out once; afterwards `train_run` carries it and returns a
`RunResult`, the record that flows into reports/*.json and the plots.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from helpers.memory import GiB, measure_peak
from helpers.runtime import reset_peak_stats, setup_single_process, teardown

if TYPE_CHECKING:
    from helpers.hardware import Runtime


@dataclass
class RunResult:
    """What one run measured (and what was estimated for it)."""

    name: str
    model: str
    params: int
    config: str
    precision: str
    micro_batch: int
    grad_accum: int
    seq_len: int
    steps: int
    checkpointing: bool
    runtime: str
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_vram_gib: float = 0.0  # peak GPU allocated above the idle baseline
    peak_reserved_gib: float = 0.0
    estimated_vram_gib: float = 0.0
    peak_rss_gib: float = 0.0  # peak process RSS (GiB)
    baseline_rss_gib: float = 0.0  # process RSS when the run started (what the kernel already held)
    disk_gib: float = 0.0
    seconds: float = 0.0
    error: str = ""
    # peak process RSS (GiB) while the model is built, while deepspeed.initialize runs, and while training
    rss_by_phase: dict[str, float] = field(default_factory=dict)
    # what one kind of run adds (MoE routing, a Trainer's or Accelerate's own numbers), JSON-serialisable
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """measured / estimated peak VRAM (nan without both)."""
        return self.peak_vram_gib / self.estimated_vram_gib if self.estimated_vram_gib and self.peak_vram_gib \
            else math.nan

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = None if math.isnan(self.ratio) else round(self.ratio, 3)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunResult":
        """The record `as_dict` wrote (a child process's run, a report row)."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        kept["val_losses"] = [tuple(v) for v in kept.get("val_losses", [])]
        return cls(**kept)

    def row(self, width: int = 22) -> str:
        """One line of a fixed-width table (see `results_table`)."""
        return (f"{self.name:<{width}}{self.peak_vram_gib:>9.2f}{self.estimated_vram_gib:>9.2f}{self.ratio:>7.2f}"
                f"{self.tokens_per_s:>10.0f}{self.peak_rss_gib:>9.2f}"
                f"{self.losses[0] if self.losses else math.nan:>8.3f}{self.losses[-1] if self.losses else math.nan:>8.3f}")


def results_table(results: list[RunResult]) -> str:
    """Measured peak VRAM, estimate, ratio, tokens/s, RSS and first/last loss per run."""
    width = max([22] + [len(r.name) + 1 for r in results])
    head = (f"{'run':<{width}}{'peak GiB':>9}{'est GiB':>9}{'ratio':>7}{'tokens/s':>10}{'RSS GiB':>9}"
            f"{'loss0':>8}{'lossN':>8}")
    return "\n".join([head, "-" * len(head)] + [r.row(width) for r in results])


def _autocast(runtime: "Runtime") -> Any:
    import contextlib

    import torch

    if runtime.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if runtime.precision == "fp16" else torch.bfloat16
    return torch.autocast(runtime.device, dtype=dtype)


def evaluate(model: Any, blocks: Any, runtime: "Runtime", batches: int = 4, batch_size: int = 4,
             autocast: bool = False) -> float:
    """Mean loss over the first `batches` batches of `blocks` (no gradients)."""
    import torch

    was_training = model.training  # restored below: a model left in eval mode trains without dropout
    model.eval()
    losses = []
    device = runtime.device if runtime.has_gpu else "cpu"
    with torch.no_grad():
        for i in range(min(batches, len(blocks) // batch_size)):
            ids = blocks[i * batch_size:(i + 1) * batch_size]["input_ids"].to(device)
            if autocast:
                with _autocast(runtime):
                    losses.append(float(model(input_ids=ids, labels=ids).loss))
            else:
                losses.append(float(model(input_ids=ids, labels=ids).loss))
    if was_training:
        model.train()
    return sum(losses) / max(len(losses), 1)


def train_run(name: str, model_factory: Callable[[], Any], train_blocks: Any, *, runtime: "Runtime",
              ds_config: dict[str, Any] | None = None, val_blocks: Any = None, steps: int = 20,
              micro_batch: int = 4, grad_accum: int = 1, lr: float = 3e-4, checkpointing: bool = False,
              eval_every: int = 0, eval_batches: int = 4, warmup_steps: int = 2, seed: int = 0,
              estimated_bytes: int = 0, model_name: str = "", nvme_path: str | None = None,
              progress: bool = True, on_step: Callable[[int, float], None] | None = None,
              on_phase: Callable[[str], None] | None = None) -> RunResult:
    """Train a fresh model for `steps` optimizer steps and measure it (ds_config None: plain PyTorch AMP).

    `model_factory()` returns the model, or (model, keep_alive) for a model built under ZeRO-3
    (`helpers.build_zero3_model`). Peak GPU memory is measured above the idle baseline, tokens/s after
    `warmup_steps`, bytes in `nvme_path` while it runs. CUDA out-of-memory is caught and reported in
    `RunResult.error`. Everything is torn down before returning, so runs can follow one another.
    `on_phase(name)` and `on_step(step, loss)` report progress (a child process sends them to the notebook).
    """
    import torch

    torch.manual_seed(seed)
    setup_single_process()
    reset_peak_stats()
    seq_len = int(train_blocks[0]["input_ids"].shape[-1])
    result = RunResult(name=name, model=model_name, params=0, config="plain PyTorch" if ds_config is None else name,
                       precision=runtime.precision, micro_batch=micro_batch, grad_accum=grad_accum, seq_len=seq_len,
                       steps=steps, checkpointing=checkpointing, runtime=runtime.label)
    ns: dict[str, Any] = {}
    try:
        with measure_peak(nvme_path=nvme_path) as mem:
            try:
                _train(ns, result, model_factory, train_blocks, runtime, ds_config, val_blocks, steps, micro_batch,
                       grad_accum, lr, checkpointing, eval_every, eval_batches, warmup_steps, seed, progress,
                       on_step or (lambda step, loss: None), on_phase or (lambda phase: None))
            except torch.OutOfMemoryError as exc:
                result.error = "CUDA out of memory: " + str(exc).split("\n")[0][:300]
    finally:  # an interrupted run (KeyboardInterrupt) is torn down too: its engine must not outlive the cell
        zero3 = ns.get("keep_alive") is not None
        teardown(ns, "engine", "optimizer", "model", "keep_alive")
        if zero3:
            from helpers.checkpoints import release_zero3

            release_zero3()
    marks = [("build model", ns.get("t_start")), ("initialize", ns.get("t_built")), ("train", ns.get("t_ready")),
             ("end", time.perf_counter())]
    for (phase, t0), (_, t1) in zip(marks, marks[1:]):
        if t0 is not None and t1 is not None:
            result.rss_by_phase[phase] = round(mem.peak_between("rss", t0 - mem.started, t1 - mem.started) / GiB, 3)
    result.peak_vram_gib = round((mem.peak_gpu_allocated - mem.baseline_gpu_allocated) / GiB, 3)
    result.peak_reserved_gib = round(mem.peak_gpu_reserved / GiB, 3)
    result.peak_rss_gib = round(mem.peak_rss / GiB, 3)
    result.baseline_rss_gib = round(mem.baseline_rss / GiB, 3)
    result.disk_gib = round(mem.peak_nvme_bytes / GiB, 3)
    result.estimated_vram_gib = round(estimated_bytes / GiB, 3)
    return result


def _train(ns: dict[str, Any], result: RunResult, model_factory: Callable[[], Any], train_blocks: Any,
           runtime: "Runtime", ds_config: dict[str, Any] | None, val_blocks: Any, steps: int, micro_batch: int,
           grad_accum: int, lr: float, checkpointing: bool, eval_every: int, eval_batches: int,
           warmup_steps: int, seed: int, progress: bool, on_step: Callable[[int, float], None],
           on_phase: Callable[[str], None]) -> None:
    """The loop of `train_run`; every object it makes is kept in `ns`, for the teardown."""
    import torch
    from tqdm.auto import tqdm

    from helpers.data import block_loader

    batches = block_loader(train_blocks, micro_batch, seed=seed)
    device = "cuda" if runtime.has_gpu else "cpu"
    tokens_per_step = micro_batch * grad_accum * result.seq_len
    lr_warmup = max(1, steps // 10)
    ns["t_start"] = time.perf_counter()
    made = model_factory()
    ns["t_built"] = time.perf_counter()
    model, ns["keep_alive"] = made if isinstance(made, tuple) else (made, None)
    del made
    ns["model"] = model
    result.params = sum({id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters()}.values())
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if ds_config is None:
        model.to(device)
        ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        # the same linear warm-up as the DeepSpeed configs get below
        scheduler = torch.optim.lr_scheduler.LambdaLR(ns["optimizer"], lambda s: min(1.0, s / lr_warmup))
        scaler = torch.amp.GradScaler(device, enabled=runtime.precision == "fp16")
    else:
        import deepspeed

        cfg = copy.deepcopy(ds_config)
        cfg.update(train_micro_batch_size_per_gpu=micro_batch, gradient_accumulation_steps=grad_accum,
                   train_batch_size=micro_batch * grad_accum)
        if "optimizer" in cfg:
            cfg["optimizer"]["params"]["lr"] = lr
        if "scheduler" in cfg:
            cfg["scheduler"]["params"].update(warmup_max_lr=lr, warmup_num_steps=lr_warmup, warmup_type="linear")
        on_phase("deepspeed.initialize")
        ns["engine"], ns["optimizer"], _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                   config=cfg)
    del model
    on_phase("training")
    ns["t_ready"] = time.perf_counter()
    net = ns.get("engine") or ns["model"]
    net.train()
    start = time.perf_counter()
    timed_from = None
    bar = tqdm(range(steps), desc=result.name, disable=not progress)
    for step in bar:
        if step == warmup_steps:
            if runtime.has_gpu:
                torch.cuda.synchronize()
            timed_from = time.perf_counter()
        step_loss = 0.0
        for _ in range(grad_accum):
            ids = next(batches)["input_ids"].to(device)
            if ds_config is None:
                with _autocast(runtime):
                    loss = net(input_ids=ids, labels=ids).loss / grad_accum
                scaler.scale(loss).backward()
                step_loss += loss.item()
            else:
                loss = net(input_ids=ids, labels=ids).loss
                net.backward(loss)
                net.step()
                step_loss += loss.item() / grad_accum
        if ds_config is None:
            scaler.unscale_(ns["optimizer"])
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(ns["optimizer"])
            scaler.update()
            scheduler.step()
            ns["optimizer"].zero_grad(set_to_none=True)
        del loss, ids
        result.losses.append(step_loss)
        on_step(step, step_loss)
        if timed_from is not None and step > warmup_steps:
            rate = (step - warmup_steps) * tokens_per_step / (time.perf_counter() - timed_from)
            bar.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{rate:,.0f}")
        else:
            bar.set_postfix(loss=f"{step_loss:.3f}")
        if val_blocks is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            result.val_losses.append((step + 1, evaluate(net, val_blocks, runtime, eval_batches, micro_batch,
                                                         autocast=ds_config is None)))
    if runtime.has_gpu:
        torch.cuda.synchronize()
    end = time.perf_counter()
    if timed_from is not None and steps > warmup_steps:
        result.tokens_per_s = round((steps - warmup_steps) * tokens_per_step / (end - timed_from), 1)
    result.seconds = round(end - start, 2)
