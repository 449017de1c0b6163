"""THE training loop of the course and THE record of a run (notebooks 01-04, the benchmarks).

Notebook 01 writes the DeepSpeed loop out once; afterwards `train_run` carries it and returns a
`RunResult`, the record that flows into reports/*.json and the plots. The DeepSpeed config is the single
source of truth for micro-batch, gradient accumulation, learning rate and warm-up: `train_run` reads them
from it (`RunSettings.from_config`), for a DeepSpeed engine and for plain PyTorch AMP alike
(`plain_pytorch=True`), so a baseline and a ZeRO run are comparable by construction. What one kind of
model adds to the loop (MoE's parameter groups, loss parts and routing: `helpers.moe.MoEHooks`) comes in
as a `TrainHooks` object and lands in `RunResult.extras`.

Units: GPU memory in GiB (the VRAM budget's unit), host RAM and disk in GB = 1e9 bytes (the RAM and disk
budgets' unit, `helpers.hardware`).
"""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence

from helpers.memory import GB, GiB, measure_peak
from helpers.runtime import reset_peak_stats, setup_single_process, teardown

if TYPE_CHECKING:
    from helpers.hardware import Runtime

__all__ = [ "pool_runs", "speed_rounds", "train_run", "results_table",
           "stage0_fp16_loss"]

# fields written in GiB by reports before issue 14, now in GB (what `RunResult.from_dict` converts)
_GIB_TO_GB = {"peak_rss_gib": "peak_rss_gb", "baseline_rss_gib": "baseline_rss_gb", "disk_gib": "disk_gb"}


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
    # wall seconds of each timed optimizer step (after the untimed ones; evaluation excluded): the spread of tokens/s
    step_seconds: list[float] = field(default_factory=list)
    peak_vram_gib: float = 0.0  # peak GPU allocated above the idle baseline
    peak_reserved_gib: float = 0.0
    estimated_vram_gib: float = 0.0
    peak_rss_gb: float = 0.0  # peak process RSS (GB = 1e9 bytes, as the RAM budget)
    baseline_rss_gb: float = 0.0  # process RSS when the run started (what the kernel already held)
    disk_gb: float = 0.0  # the NVMe folder's peak above its size when the run started: this run's own use (GB)
    seconds: float = 0.0
    error: str = ""
    # peak process RSS (GB) while the model is built, while deepspeed.initialize runs, and while training
    rss_by_phase: dict[str, float] = field(default_factory=dict)
    # what one kind of run adds (MoE routing, a Trainer's or Accelerate's own numbers), JSON-serialisable
    extras: dict[str, Any] = field(default_factory=dict)
    # the learning rate each optimizer step applied (read before the step: DeepSpeed's engine.get_lr(), or plain's)
    lrs: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """measured / estimated peak VRAM (nan without both)."""
        return self.peak_vram_gib / self.estimated_vram_gib if self.estimated_vram_gib and self.peak_vram_gib \
            else math.nan

    def applied_lrs(self) -> list[float]:
        """The learning rate of each update the run applied: `lrs` less the steps fp16 overflow skipped (a skipped step
        updates nothing, and DeepSpeed's scheduler does not advance on it), so runs with other skips compare."""
        skipped = set(self.extras.get("skipped_at_steps", []))
        return [lr for step, lr in enumerate(self.lrs) if step not in skipped]

    @property
    def val_loss(self) -> float:
        """The last validation loss (nan without one)."""
        return self.val_losses[-1][1] if self.val_losses else math.nan

    def step_tokens_per_s(self) -> list[float]:
        """tokens/s of each timed optimizer step, sorted (empty when none was timed)."""
        tokens = self.micro_batch * self.grad_accum * self.seq_len
        return sorted(tokens / s for s in self.step_seconds if s > 0)

    def speed_spread(self) -> tuple[float, float, float]:
        """(lower quartile, median, upper quartile) of the per-step tokens/s: the middle half of the timed steps.

        With fewer than 2 timed steps all three are `tokens_per_s` (no spread measured)."""
        rates = self.step_tokens_per_s()
        if len(rates) < 2:
            return self.tokens_per_s, self.tokens_per_s, self.tokens_per_s
        return _quantile(rates, 0.25), _quantile(rates, 0.5), _quantile(rates, 0.75)

    def speed_text(self) -> str:
        """'16,316 tokens/s (per step 15,900-16,700 over the middle half of 18 timed steps)': the median step and the
        spread of the middle half of the per-step speeds."""
        low, mid, high = self.speed_spread()
        n = len(self.step_seconds)
        if n < 2:
            return f"{self.tokens_per_s:,.0f} tokens/s (one timed step: no spread)"
        return f"{mid:,.0f} tokens/s (per step {low:,.0f}-{high:,.0f} over the middle half of {n} timed steps)"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = None if math.isnan(self.ratio) else round(self.ratio, 3)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunResult":
        """The record `as_dict` wrote (a child process's run, a report row); older GiB fields are converted."""
        d = dict(d)
        old = [k for k in _GIB_TO_GB if k in d]
        for k in old:
            d.setdefault(_GIB_TO_GB[k], round(d.pop(k) * GiB / GB, 3))
        if "peak_rss_gib" in old and "rss_by_phase" in d:
            d["rss_by_phase"] = {k: round(v * GiB / GB, 3) for k, v in d["rss_by_phase"].items()}
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in d.items() if k in names}
        kept["val_losses"] = [tuple(v) for v in kept.get("val_losses", [])]
        return cls(**kept)

    def row(self, width: int = 22, gpu: bool = True) -> str:
        """One line of a fixed-width table (see `results_table`); `gpu=False`: the RAM layout of a CPU run."""
        losses = (f"{self.losses[0] if self.losses else math.nan:>8.3f}"
                  f"{self.losses[-1] if self.losses else math.nan:>8.3f}")
        speed = self.speed_spread()[1]  # the median step, as speed_text says it: one tokens/s per run on the page
        if not gpu:
            growth = max(self.peak_rss_gb - self.baseline_rss_gb, 0.0)
            return f"{self.name:<{width}}{growth:>15.2f}{self.peak_rss_gb:>13.2f}{speed:>10.0f}" + losses
        return (f"{self.name:<{width}}{self.peak_vram_gib:>9.2f}{self.estimated_vram_gib:>9.2f}{self.ratio:>9.2f}"
                f"{speed:>10.0f}{self.peak_rss_gb:>9.2f}" + losses)


# Issue 42: a run "learns" when its loss fell by a clear margin, not when the last loss is below the first (a random
# wide model's loss wanders by more than that within a few steps: reports/lr_sweep.md). The mean of the last three
# losses at least LOSS_FALL_NATS below the first on a GPU; a CPU smoke run (a few steps of a tiny model) only has to
# fall. Fewer than four losses judge nothing.
LOSS_FALL_NATS = 1.0


def loss_drop(losses: Sequence[float]) -> float:
    """The first loss less the mean of the last three, in nats; NaN with fewer than four losses (benchmarks/ladder.py,
    notebook 02's ladder)."""
    if len(losses) < 4:
        return math.nan
    return float(losses[0]) - sum(float(x) for x in losses[-3:]) / 3


def loss_fell(losses: Sequence[float], *, on_gpu: bool) -> tuple[bool, str]:
    """(learns, why): the loss fell by LOSS_FALL_NATS (on a GPU) or at all (CPU smoke runs), judged by `loss_drop`
    (benchmarks/ladder.py)."""
    drop = loss_drop(losses)
    if math.isnan(drop):
        return False, f"{len(losses)} loss(es): at least 4 are needed to judge"
    need = LOSS_FALL_NATS if on_gpu else 0.0
    said = (f"loss fell {drop:.2f} nats (first {losses[0]:.2f}, last three {losses[0] - drop:.2f})"
            if drop > 0 else f"loss did not fall (first {losses[0]:.2f}, last three {losses[0] - drop:.2f})")
    if (drop >= need) if on_gpu else (drop > 0):
        return True, said
    return False, said + (f"; {need:g} needed" if drop > 0 else "")


def stage0_fp16_loss(engine: Any, loss: Any) -> Any:
    """The loss to pass to `engine.backward`: scaled by the fp16 loss scale where DeepSpeed 0.19.8 forgets to
    (notebook 01).

    `engine.backward` multiplies the loss by the fp16 loss scale only for a ZeRO optimizer (stages 1-3). With ZeRO
    off (stage 0) in fp16 the engine's optimizer is `FP16_Optimizer` / `FP16_UnfusedOptimizer`, whose `step()` still
    divides the gradients by that scale (65,536 at `initial_scale_power` 16): ZeRO-0's gradients came out 65,536 times
    too small, clipping never acted and AdamW's eps swamped the updates (notebook 01: ZeRO-0 ended at loss 8.5 where
    stages 1-3 reached 7.2). This scales the loss as those optimizers' own `backward()` does; any other engine gets
    the loss unchanged. The fix proposed upstream (deepspeedai/DeepSpeed pull request 8393) makes this a no-op.
    """
    optimizer = getattr(engine, "optimizer", None)
    scaling = getattr(optimizer, "loss_scale_config", None)
    if scaling is None or not callable(getattr(engine, "fp16_enabled", None)) or not engine.fp16_enabled():
        return loss
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(optimizer, ZeROOptimizer):
        return loss
    if getattr(optimizer, "custom_loss_scaler", False):
        return optimizer.external_loss_scale * loss
    if getattr(scaling, "use_grad_scaling", False):
        return loss.float() * scaling.cur_scale
    return loss


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile `q` of an already sorted list."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class SpeedComparison:
    """Run `a` against run `b` in tokens/s, with the spread of their steps (notebooks 01 and 03)."""

    a: str
    b: str
    ratio: float  # median step of a / median step of b
    separated: bool  # the middle halves of their per-step tokens/s do not overlap
    low: float  # ratio of a's lower quartile to b's upper quartile
    high: float  # ratio of a's upper quartile to b's lower quartile

    @property
    def verdict(self) -> str:
        """'faster', 'slower' or 'no difference beyond the spread'."""
        if not self.separated:
            return "no difference beyond the spread"
        return "faster" if self.ratio > 1 else "slower"

    def __str__(self) -> str:
        spread = f"x{self.ratio:.2f} (x{self.low:.2f}-x{self.high:.2f} between the middle halves of their steps)"
        if not self.separated:
            return f"{self.a} vs {self.b}: {spread}: no difference beyond the step-to-step spread"
        return f"{self.a} vs {self.b}: {spread}: {self.verdict}"


def compare_speed(a: RunResult, b: RunResult) -> SpeedComparison:
    """Compare two runs' tokens/s by their per-step spread: a difference counts only when the middle halves of their
    steps do not overlap (a's lower quartile above b's upper quartile, or the reverse) (notebook 02).

    Runs with fewer than 2 timed steps have no spread: they are never called different."""
    a_lo, a_mid, a_hi = a.speed_spread()
    b_lo, b_mid, b_hi = b.speed_spread()
    if not (a_mid > 0 and b_mid > 0 and b_lo > 0):
        return SpeedComparison(a.name, b.name, math.nan, False, math.nan, math.nan)
    measured = len(a.step_seconds) >= 2 and len(b.step_seconds) >= 2
    separated = measured and (a_lo > b_hi or a_hi < b_lo)
    return SpeedComparison(a.name, b.name, a_mid / b_mid, separated, a_lo / b_hi, a_hi / b_lo)


class TimedRun(Protocol):
    """What `speed_ratios` and `speed_rounds` read of a run: a `RunResult`, or anything with these."""

    name: str
    tokens_per_s: float

    def step_tokens_per_s(self) -> list[float]: ...


@dataclass(frozen=True)
class SpeedRatio:
    """One run's tokens/s against the reference's (`speed_ratios`)."""

    name: str
    ratio: float  # the run's median step / the reference's median step (its runs' steps pooled)
    low: float  # the run's lower quartile / the reference's upper quartile (the middle halves of the steps)
    high: float  # the run's upper quartile / the reference's lower quartile
    # further from the nearer reference run than the reference's runs lie apart, AND the middle halves of the steps apart
    beyond_noise: bool


@dataclass(frozen=True)
class SpeedRatios:
    """Speed ratios against a reference that ran more than once, judged against how far its runs moved apart.

    The step-to-step spread inside one run does not bound how far the same config moves from run to run (notebook 01
    measured its reference x1.04 and x1.09 apart in two runs): running the reference first and last in the same
    cell measures that drift where the ratios are measured, and a ratio means something only beyond it."""

    reference: str
    reference_medians: tuple[float, ...]  # each reference run's median step tokens/s, in the order they ran
    rows: tuple[SpeedRatio, ...]

    @property
    def noise(self) -> float:
        """How far the reference's runs moved apart (max/min of their median steps, >= 1); nan after one run."""
        mids = [m for m in self.reference_medians if m > 0]
        return max(mids) / min(mids) if len(mids) > 1 else math.nan

    def noise_text(self) -> str:
        if math.isnan(self.noise):
            return f"{self.reference} ran once: no run-to-run noise measured, so no ratio is judged"
        return f"reference ran x{self.noise:.2f} apart"

    def table(self, note: str = "") -> str:
        """The printable lines: the reference's runs (the noise), then each ratio with the middle halves of the steps,
        its meaning only beyond the noise. `note` is added to the heading (a CPU run says what its numbers are)."""
        mids = " and ".join(f"{m:,.0f}" for m in self.reference_medians)
        runs = {1: "once", 2: "twice, first and last"}.get(len(self.reference_medians),
                                                           f"{len(self.reference_medians)} times")
        noise = "" if math.isnan(self.noise) else f", x{self.noise:.2f} apart: the noise"
        head = [f"tokens/s against {self.reference} (ratios of median steps; in brackets, between the middle halves "
                f"of the steps){note}:",
                f"  {self.reference} ran {runs}: median steps {mids} tokens/s{noise}"]
        width = max([8] + [len(r.name) + 1 for r in self.rows])
        lines = []
        for r in self.rows:
            if math.isnan(r.ratio):
                lines.append(f"  {r.name:<{width}}not measured (no timed steps)")
                continue
            if r.beyond_noise:
                meaning = f"{abs(r.ratio - 1):.0%} {'more' if r.ratio > 1 else 'fewer'} tokens/s, beyond the noise"
            elif math.isnan(self.noise):
                meaning = "not judged: " + self.noise_text()
            else:
                meaning = f"within the noise ({self.noise_text()})"
            lines.append(f"  {r.name:<{width}}{f'x{r.ratio:.2f} (x{r.low:.2f}-x{r.high:.2f})':<22}{meaning}")
        return "\n".join(head + lines)

    def __str__(self) -> str:
        return self.table()


def _spread(rates: Sequence[float], fallback: float) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile) of per-step rates in any order (a TimedRun written in a notebook need
    not sort them: notebook 03's printed x0.59 (x0.53-x0.58) before this sorted); all `fallback` with fewer than 2."""
    if len(rates) < 2:
        return fallback, fallback, fallback
    rates = sorted(rates)
    return _quantile(rates, 0.25), _quantile(rates, 0.5), _quantile(rates, 0.75)


def speed_ratios(results: Sequence[TimedRun], reference: str, repeat: str | None = None) -> SpeedRatios:
    """Every run of `results` against the reference in tokens/s of median steps, judged against run-to-run noise
    (notebook 01).

    `reference` and `repeat` name two runs of the same config (run first and last, so the drift over the cell
    shows); their steps are pooled into the reference. The noise is how far their median steps moved apart (x n).
    A ratio is beyond the noise only when the run's median step lies further from the nearer of the reference's runs
    than those two lie apart (below the lower one / n or above the higher one x n) and the middle halves of the run's
    and the pooled reference's steps do not overlap. Without `repeat` nothing is judged (no noise measured)."""
    names = [r.name for r in results]
    if repeat == reference:
        raise ValueError(f"speed_ratios: reference and repeat are both {reference!r}. Fix: give the repeat run a name "
                         f"of its own (e.g. {reference + ' (again)'!r}).")
    for wanted, what in ((reference, "reference"), (repeat, "repeat")):
        if wanted is not None and wanted not in names:
            raise ValueError(f"speed_ratios: no run named {wanted!r} (the {what}) among {names}. Fix: "
                             f"{what}= one of those names (the reference config run first, its repeat last).")
    refs = [r for r in results if r.name in (reference, repeat)]
    pooled = sorted(x for r in refs for x in r.step_tokens_per_s())
    ref_lo, ref_mid, ref_hi = _spread(pooled, sum(r.tokens_per_s for r in refs) / len(refs))
    medians = tuple(_spread(r.step_tokens_per_s(), r.tokens_per_s)[1] for r in refs)
    noise = max(medians) / min(medians) if repeat is not None and min(medians) > 0 else math.nan
    rows = []
    for r in results:
        if r.name in (reference, repeat):
            continue
        lo, mid, hi = _spread(r.step_tokens_per_s(), r.tokens_per_s)
        if not (ref_mid > 0 and ref_lo > 0 and mid > 0):
            rows.append(SpeedRatio(r.name, math.nan, math.nan, math.nan, False))
            continue
        ratio, low, high = mid / ref_mid, lo / ref_hi, hi / ref_lo
        steps_apart = len(r.step_tokens_per_s()) >= 2 and len(pooled) >= 2 and (low > 1 or high < 1)
        beyond = (not math.isnan(noise) and steps_apart
                  and (mid > max(medians) * noise or mid < min(medians) / noise))
        rows.append(SpeedRatio(r.name, ratio, low, high, beyond))
    return SpeedRatios(reference, medians, tuple(rows))


def pool_runs(results: Sequence[RunResult]) -> list[RunResult]:
    """One `RunResult` per name, in the order the names first ran: the runs of one config (rounds of a comparison,
    notebook 01) pooled. Their timed steps together (`tokens_per_s`: the median of them all), the highest peaks, the
    seconds summed, the first error; losses, learning rates and extras are the first run's (the rounds repeat one
    run: same config, seed and batches), with `extras["run_tokens_per_s"]` holding each run's median step."""
    import dataclasses

    by_name: dict[str, list[RunResult]] = {}
    for r in results:
        by_name.setdefault(r.name, []).append(r)
    pooled = []
    for runs in by_name.values():
        first = runs[0]
        steps = [s for r in runs for s in r.step_seconds]
        tokens = first.micro_batch * first.grad_accum * first.seq_len
        rates = sorted(tokens / s for s in steps if s > 0)
        pooled.append(dataclasses.replace(
            first, step_seconds=steps,
            tokens_per_s=round(_quantile(rates, 0.5), 1) if rates else first.tokens_per_s,
            peak_vram_gib=max(r.peak_vram_gib for r in runs), peak_reserved_gib=max(r.peak_reserved_gib for r in runs),
            peak_rss_gb=max(r.peak_rss_gb for r in runs), seconds=round(sum(r.seconds for r in runs), 2),
            error=next((r.error for r in runs if r.error), ""),
            extras=dict(first.extras, run_tokens_per_s=[round(r.speed_spread()[1], 1) for r in runs])))
    return pooled


@dataclass(frozen=True)
class RoundsRatio:
    """One config's tokens/s against the reference's, over all their runs (`speed_rounds`)."""

    name: str
    ratio: float  # the median of all its runs' timed steps / the reference's (nan: no timed step)
    low: float  # the lowest ratio between the middle halves of the steps of any one of its runs and any reference run
    high: float  # the highest
    run_medians: tuple[float, ...]  # each of its runs' median step (tokens/s), in the order they ran

    @property
    def apart(self) -> float:
        """How far its runs' median steps lay apart (max / min, >= 1); nan with fewer than two runs."""
        mids = [m for m in self.run_medians if m > 0]
        return max(mids) / min(mids) if len(mids) > 1 else math.nan


@dataclass(frozen=True)
class SpeedRounds:
    """Speed ratios of configs that each ran more than once in one cell, interleaved (notebook 01: two rounds, the
    second in reverse order), against one reference config (notebook 04: one config through three drivers, a row each).

    Two runs of notebook 01 gave the same rows different verdict words (ZeRO-2 'within the noise' vs 'beyond',
    reports/verdicts.md): a word drawn at a threshold flips whenever a ratio lies near it, however the threshold is
    set. So no row gets a word: each prints its ratio and a range that holds the run-to-run movement measured in
    this cell (any run of it against any run of the reference, between the middle halves of their steps), and one
    sentence says how far one config's runs lay apart."""

    reference: RoundsRatio  # the reference's own runs (ratio 1)
    rows: tuple[RoundsRatio, ...]

    @property
    def noise(self) -> float:
        """How far the runs of one config lay apart, the most over all configs (>= 1); nan when none ran twice."""
        aparts = [r.apart for r in (self.reference, *self.rows) if not math.isnan(r.apart)]
        return max(aparts) if aparts else math.nan

    def table(self, note: str = "", what: str = "config") -> str:
        """The printable lines: the reference's runs, each ratio with its range and its runs, one sentence on the
        noise. `note` is added to the heading (a CPU run says what its numbers are); `what` names a row: "config"
        (notebook 01), "driver" (notebook 04: one config through three drivers)."""
        ref = self.reference.name
        width = max([10] + [len(r.name) + 2 for r in (self.reference, *self.rows)])

        def runs(r: RoundsRatio) -> str:
            mids = [f"{m:,.0f}" for m in r.run_medians]
            listed = mids[0] if len(mids) == 1 else ", ".join(mids[:-1]) + " and " + mids[-1]
            word = "run" if len(mids) == 1 else "runs"
            return f"{word} {listed} tokens/s" + ("" if math.isnan(r.apart) else f", {r.apart - 1:.0%} apart")

        lines = [f"tokens/s against {ref}, every {what} ran {_times(len(self.reference.run_medians))}{note}:",
                 "  the ratio of median steps, all its runs together; in brackets, the lowest and highest ratio between",
                 "  the middle halves of the steps of any one of its runs and any one of the reference's",
                 f"  {ref:<{width}}{'':<22}{runs(self.reference)}"]
        for r in self.rows:
            if math.isnan(r.ratio):
                lines.append(f"  {r.name:<{width}}not measured (no timed steps)")
                continue
            lines.append(f"  {r.name:<{width}}{f'x{r.ratio:.2f} (x{r.low:.2f}-x{r.high:.2f})':<22}{runs(r)}")
        if math.isnan(self.noise):
            lines += [f"no {what} ran twice, so no run-to-run noise was measured: the ranges hold only the spread of "
                      "the steps", "inside each run"]
        else:
            lines += [f"one {what}'s runs lay up to {self.noise - 1:.0%} apart in this cell: read each ratio with its "
                      "range; where the range", f"includes x1.00, this run cannot tell that {what}'s speed from the "
                      "reference's"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def speed_rounds(results: Sequence[TimedRun], reference: str) -> SpeedRounds:
    """Every config of `results` against `reference` in tokens/s, where each config ran more than once in the cell,
    interleaved with the others (runs of one config share its name; notebook 01 runs two rounds, the second in
    reverse order, so a drift over the cell falls on every config alike).

    A row's ratio is the median step of all its runs over the reference's; its range goes from the lowest to the
    highest ratio between the middle halves of the steps (lower quartile / upper quartile and upper / lower) of any
    one of its runs and any one of the reference's: what a single run of each could have shown in this cell. No row
    gets a verdict word (`SpeedRounds` says why); the table's last line says how far one config's runs lay apart."""
    names = list(dict.fromkeys(r.name for r in results))
    if reference not in names:
        raise ValueError(f"speed_rounds: no run named {reference!r} (the reference) among {names}. Fix: reference= "
                         "one of those names.")

    def spreads(name: str) -> list[tuple[float, float, float]]:
        return [_spread(r.step_tokens_per_s(), r.tokens_per_s) for r in results if r.name == name]

    def pooled(name: str) -> float:
        rates = sorted(x for r in results if r.name == name for x in r.step_tokens_per_s())
        if rates:
            return _quantile(rates, 0.5)
        mids = [m for _, m, _ in spreads(name)]
        return sum(mids) / len(mids)

    ref_spreads, ref_mid = spreads(reference), pooled(reference)
    reference_row = RoundsRatio(reference, 1.0, math.nan, math.nan, tuple(m for _, m, _ in ref_spreads))
    rows = []
    for name in names:
        if name == reference:
            continue
        own, mid = spreads(name), pooled(name)
        medians = tuple(m for _, m, _ in own)
        if not (ref_mid > 0 and mid > 0 and all(lo > 0 for lo, _, _ in ref_spreads)):
            rows.append(RoundsRatio(name, math.nan, math.nan, math.nan, medians))
            continue
        low = min(lo / rhi for lo, _, _ in own for _, _, rhi in ref_spreads)
        high = max(hi / rlo for _, _, hi in own for rlo, _, _ in ref_spreads)
        rows.append(RoundsRatio(name, mid / ref_mid, low, high, medians))
    return SpeedRounds(reference_row, tuple(rows))


def results_table(results: list[RunResult]) -> str:
    """Measured peak VRAM, estimate, their ratio (peak/est), tokens/s (of the median step, as `speed_text`), RSS and
    first/last loss per run (notebook 01).

    Runs without a GPU (no VRAM measured) get the RAM layout instead: RAM the run added over its start (the model,
    its optimizer states and activations all live there) and the process's peak RSS, never a column of zeros."""
    width = max([22] + [len(r.name) + 1 for r in results])
    gpu = any(r.peak_vram_gib for r in results)
    if gpu:
        head = (f"{'run':<{width}}{'peak GiB':>9}{'est GiB':>9}{'peak/est':>9}{'tokens/s':>10}{'RSS GB':>9}"
                f"{'loss0':>8}{'lossN':>8}")
    else:
        head = f"{'run':<{width}}{'RAM added GB':>15}{'peak RSS GB':>13}{'tokens/s':>10}{'loss0':>8}{'lossN':>8}"
    return "\n".join([head, "-" * len(head)] + [r.row(width, gpu) for r in results])


@dataclass(frozen=True)
class RunSettings:
    """What `train_run` reads from a DeepSpeed config: batch, accumulation, optimizer and warm-up."""

    micro_batch: int
    grad_accum: int
    lr: float
    warmup_steps: int  # linear learning-rate warm-up (the scheduler's warmup_num_steps; 0: none)
    weight_decay: float
    gradient_clipping: float | None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "RunSettings":
        """The settings of `config` (a helpers.course_config / build_ds_config dict)."""
        if not isinstance(config, dict) or "train_micro_batch_size_per_gpu" not in config:
            raise ValueError("train_run reads micro-batch, accumulation, lr and warm-up from a DeepSpeed config "
                             "with 'train_micro_batch_size_per_gpu'. Fix: ds_config=helpers.course_config('zero2', "
                             "runtime, micro_batch_size=..., lr=..., warmup_steps=...) (also for plain_pytorch=True).")
        opt = config.get("optimizer", {}).get("params", {})
        sched = config.get("scheduler", {}).get("params", {})
        return cls(micro_batch=int(config["train_micro_batch_size_per_gpu"]),
                   grad_accum=int(config.get("gradient_accumulation_steps", 1)),
                   lr=float(opt.get("lr", 1e-3)), warmup_steps=int(sched.get("warmup_num_steps", 0)),
                   weight_decay=float(opt.get("weight_decay", 0.01)),
                   gradient_clipping=config.get("gradient_clipping"))


def lr_scheduler_from_config(optimizer: Any, config: dict[str, Any]) -> Any:
    """The learning-rate scheduler DeepSpeed's engine builds from `config`'s "scheduler" block, on a torch `optimizer`
    (None without one): `deepspeed.runtime.lr_schedules.<type>(optimizer, **params)`, else torch's scheduler of that
    name, as `DeepSpeedEngine._scheduler_from_config` does. A plain PyTorch run with it follows DeepSpeed's schedule
    step for step: WarmupLR warms up over at least 2 steps and its first two updates run at `warmup_min_lr`."""
    block = config.get("scheduler") if isinstance(config, dict) else None
    if not block:
        return None
    import torch
    from deepspeed.runtime import lr_schedules

    kind = block["type"]
    scheduler = getattr(lr_schedules, kind, None) or getattr(torch.optim.lr_scheduler, kind, None)
    if scheduler is None:
        raise ValueError(f"DeepSpeed does not recognize LR scheduler {kind!r}. Fix: one of "
                         f"{sorted(lr_schedules.VALID_LR_SCHEDULES)} in the config's \"scheduler\".")
    return scheduler(optimizer, **block.get("params", {}))


class TrainHooks:
    """What one kind of model adds to `train_run`; this base adds nothing (`helpers.moe.MoEHooks` adds MoE's).

    Called in this order: `on_model` once the model is built, `param_groups` for the optimizer, per micro-batch
    `after_forward`, per optimizer step `after_step`, `evaluate` for validation losses, `finish` on the trained
    model (outside the measurement, skipped when the run failed), `close` always (an interrupt included).
    """

    def on_model(self, model: Any, result: RunResult, train_blocks: Any) -> None:
        """The fresh model, before the optimizer exists (count parameters, install forward hooks)."""

    def param_groups(self, model: Any) -> Any:
        """What the optimizer gets: `model.parameters()` or a list of parameter groups."""
        return model.parameters()

    def after_forward(self, output: Any) -> None:
        """The model's output for one micro-batch (read loss parts here; `.item()` them, keep no tensors)."""

    def after_step(self, step: int, result: RunResult) -> dict[str, str]:
        """One optimizer step is done; returns extra fields for the progress bar."""
        return {}

    def evaluate(self, model: Any, blocks: Any, runtime: "Runtime", batches: int, batch_size: int,
                 autocast: bool) -> float:
        """Validation loss of `model` (the engine, or the plain model) on `blocks`."""
        return evaluate(model, blocks, runtime, batches, batch_size, autocast=autocast)

    def finish(self, model: Any, result: RunResult) -> None:
        """The trained model (unwrapped from its engine), before the teardown: summaries, probes."""

    def close(self) -> None:
        """Remove what `on_model` installed."""


@dataclass(frozen=True)
class MeasureSettings:
    """What `train_run` measures and reports beyond the training itself, and what a kind of model adds: the settings
    no notebook passes (notebooks 01 and 04 train with the defaults; the fresh-process child of notebook 02, the
    benchmarks and the tests set them), as `train_run(..., measure=MeasureSettings(...))`."""

    val_blocks: Any = None  # validation blocks (None: no validation loss)
    eval_every: int = 0  # a validation loss every this many steps and after the last one (0: none)
    eval_batches: int = 4  # micro-batches of `val_blocks` per validation loss
    untimed_steps: int = 2  # the first optimizer steps, left out of tokens/s (warm-up: allocations, kernel choice)
    progress: bool = True  # a progress bar per run
    hooks: TrainHooks | None = None  # what one kind of model adds to the loop (helpers.moe.MoEHooks); None: nothing
    on_step: Callable[[int, float], None] | None = None  # called as on_step(step, loss) after each optimizer step
    on_phase: Callable[[str], None] | None = None  # called as on_phase(name) when the run enters a phase
    # wait for the GPU after every micro-batch and keep its seconds and phases in RunResult.extras (offload_speed.py)
    time_micro_batches: bool = False


def _autocast(runtime: "Runtime") -> Any:
    import contextlib

    import torch

    if runtime.precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.float16 if runtime.precision == "fp16" else torch.bfloat16
    return torch.autocast(runtime.device, dtype=dtype)


def evaluate(model: Any, blocks: Any, runtime: "Runtime", batches: int = 4, batch_size: int = 4,
             autocast: bool = False) -> float:
    """Mean loss over the first `batches` batches of `blocks` (no gradients). Fewer blocks than one batch make one
    smaller batch of all of them; no blocks, or `batches` < 1, are refused (issue 41: both read "validation 0.000")."""
    import torch

    from helpers.checks import check_number

    check_number("eval_batches", batches, positive=True, integer=True, example=4,
                 hint=" (validation batches; 0 would give no validation loss)")
    if len(blocks) == 0:
        raise ValueError("evaluate: no validation blocks, so there is no validation loss. Fix: give validation text "
                         "of at least one block (the split's rows packed to the sequence length), or eval_every=0.")
    batch_size = min(batch_size, len(blocks))
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


def oom_summary(message: str, budget_bytes: int | None = None) -> str:
    """torch's out-of-memory message in the lesson's terms: what was asked for, what PyTorch already held, the budget.

    torch's own text describes the whole device ("GPU 0 has a total capacity of 139.80 GiB ...", on a big GPU capped
    to a T4's budget): true, but not the number the lesson is about. The full text stays in `RunResult.extras`.
    """
    import re

    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", message)
    held = re.search(r"([\d.]+ [KMGT]?i?B) is allocated by PyTorch", message)
    parts = ["CUDA out of memory"]
    if asked:
        parts.append(f"tried to allocate {asked.group(1)}")
    if held:
        parts.append(f"with {held.group(1)} already allocated by PyTorch")
    if budget_bytes:
        parts.append(f"of this runtime's {budget_bytes / 2**30:.2f} GiB budget")
    return (parts[0] + (": " + " ".join(parts[1:]) if len(parts) > 1 else ": " + message.split("\n")[0][:200]))


def _positions(model: Any) -> int:
    """The longest sequence a built model takes (its learned positions); 0 when it does not say."""
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _too_long(seq_len: int, positions: int, what: str) -> Any:
    from helpers.checks import ConfigError

    return ConfigError(f"the training blocks hold {seq_len} tokens, longer than {what} takes: it has {positions} "
                       "positions, and a longer sequence fails in the first step ('IndexError: index out of range in "
                       f"self', the position embedding). Fix: seq_len={positions} (or shorter) where the blocks are "
                       f"made: helpers.pack_blocks(dataset, tokenizer, block_size={positions}).")


@contextlib.contextmanager
def _no_loading_bars() -> Iterator[None]:
    """transformers' "Loading weights" bar off while a run builds its model (a local or cached one: nothing downloads
    there), so a notebook comparing five runs prints five run bars, not ten (issue 40); its setting is restored."""
    import importlib
    import sys

    logging_ = importlib.import_module("transformers.utils.logging") if "transformers" in sys.modules else None
    was_on = logging_ is not None and logging_.is_progress_bar_enabled()
    if was_on:
        logging_.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging_.enable_progress_bar()


def _check_run_inputs(steps: Any, train_blocks: Any, model_factory: Callable[[], Any], model_name: str,
                      untimed_steps: Any = 2, eval_batches: Any = 4) -> tuple[int, Callable[[], Any]]:
    """train_run's inputs, before anything is built: `steps` a positive integer; and blocks no longer than the model's
    positions, checked on the built model before deepspeed.initialize and the first step (only the model says them:
    a ladder name may have been built with another n_positions). Returns the blocks' length and the factory, wrapped
    for that check."""
    from helpers.checks import check_number

    check_number("steps", steps, positive=True, integer=True, example=20,
                 hint=" (optimizer steps to train; 0 or fewer would train nothing)")
    check_number("untimed_steps", untimed_steps, positive=False, integer=True, example=2,
                 hint=" (warm-up steps left out of tokens/s)")
    check_number("eval_batches", eval_batches, positive=True, integer=True, example=4,
                 hint=" (validation batches; 0 would give no validation loss)")
    seq_len = int(train_blocks[0]["input_ids"].shape[-1])

    def checked_factory() -> Any:
        with _no_loading_bars():
            made = model_factory()
        model = made[0] if isinstance(made, tuple) else made
        positions = _positions(model)
        if positions and seq_len > positions:
            zero3 = isinstance(made, tuple) and made[1] is not None
            del made, model
            if zero3:  # built under ZeRO-3's global config: forget it, as train_run's teardown does
                from helpers.checkpoints import release_zero3

                release_zero3()
            raise _too_long(seq_len, positions, f"the model{f' {model_name}' if model_name else ''}")
        return made

    return seq_len, checked_factory


def _nvme_folders(ds_config: dict[str, Any]) -> list[str]:
    """The NVMe folders a DeepSpeed config swaps to (offload_param, offload_optimizer), real paths, no repeats."""
    from helpers.config import _nvme_folders_of

    return list(_nvme_folders_of(ds_config))


def _check_nvme_space(folders: list[str]) -> None:
    """`check_nvme_path` for each NVMe folder when a run starts, before its model is built: there, writable, with
    NVME_MIN_FREE_BYTES free (naming the swap files earlier runs left); what this model needs is checked once it is
    built (`_check_nvme_need`, from the estimate for its parameter count). Nothing is kept between runs."""
    from helpers.config import _check_nvme_folder

    for folder in folders:
        _check_nvme_folder(folder, 0, smaller="")


def _nvme_need_by_folder(ds_config: dict[str, Any], n_params: int, largest_param: int = 0) -> dict[str, int]:
    """{NVMe folder (real path): bytes the config writes there for a model of `n_params` parameters}, from the
    course's estimate (`estimate_for_config(...).nvme`: parameters to offload_param's folder, the optimizer states
    and fp32 gradients to offload_optimizer's)."""
    from helpers.config import _nvme_folders_of
    from helpers.memory import estimate_for_config

    est = estimate_for_config(ds_config, int(n_params), largest_layer_params=int(largest_param))
    return {folder: sum(est.nvme.get(row, 0) for row in rows) for folder, rows in _nvme_folders_of(ds_config).items()}


def _check_nvme_need(ds_config: dict[str, Any], n_params: int, largest_param: int = 0, *, model: str = "",
                     written: dict[str, int] | None = None) -> None:
    """Refuse (ConfigError) a run whose NVMe folder lacks the space the course's estimate says this model writes
    there, whatever the config was built with (issue 41 item 1: a config built without n_params passed the 1 GB
    floor; a 77M model then wrote 1.4 GB on a disk with 1.1 GB free, DeepSpeed's C++ reader aborted the process and
    left its swap files). `written`: bytes this run already wrote to each folder (ZeRO-3's zero.Init swaps the
    parameters out while the model is built): they count as free. The fix names a smaller model that fits."""
    from helpers.checks import ConfigError
    from helpers.config import _leftovers_note

    for folder, needed in _nvme_need_by_folder(ds_config, n_params, largest_param).items():
        if not needed or not os.path.isdir(folder):
            continue
        mine = (written or {}).get(folder, 0)
        room = shutil.disk_usage(folder).free + mine
        if room >= needed:
            continue
        fits = int(n_params * room / needed * 0.95) // 1_000_000
        smaller = (f"train a model of at most ~{fits:,}M parameters (the need grows with the parameter count)"
                   if fits else "train without NVMe offload")
        raise ConfigError(
            f"NVMe offload folder {folder!r} has {room / 1e9:.2f} GB free"
            + (f" (with the {mine / 1e9:.2f} GB this run wrote while building the model)" if mine else "")
            + f", but {model or 'this model'} ({n_params / 1e6:,.1f}M parameters) writes about {needed / 1e9:.2f} GB "
            f"there with this config (helpers.estimate_for_config(ds_config, n_params).nvme): DeepSpeed would fill "
            f"the disk and abort the process in its C++ reader.{_leftovers_note(Path(folder))} Refused before DeepSpeed "
            f"started. "
            f"Fix: point nvme_path at a folder on a disk with at least {needed / 1e9:.1f} GB free (build the config "
            f"again with nvme_path=<that folder> and n_params={n_params}), or {smaller}.")


def _new_swap_bytes(snapshot: dict[str, set[str]]) -> dict[str, int]:
    """{folder: bytes of the files under its zero_stage_3/ that are not in `snapshot`} (this run's own so far)."""
    from helpers.runtime import SWAP_ROOT

    written: dict[str, int] = {}
    for folder, before in snapshot.items():
        total = 0
        for parent, _dirs, files in os.walk(os.path.join(folder, SWAP_ROOT)):
            for name in files:
                path = os.path.join(parent, name)
                if path not in before:
                    with contextlib.suppress(OSError):
                        total += os.stat(path).st_blocks * 512
        written[folder] = total
    return written


def _swap_snapshot(folders: list[str]) -> dict[str, set[str]]:
    """{folder: the paths under its zero_stage_3/ (swap files and folders)} before a run."""
    from helpers.runtime import SWAP_ROOT

    snapshot: dict[str, set[str]] = {}
    for folder in folders:
        root = os.path.join(folder, SWAP_ROOT)
        paths = {root} if os.path.isdir(root) else set()
        for parent, dirs, files in os.walk(root):
            paths.update(os.path.join(parent, name) for name in dirs + files)
        snapshot[folder] = paths
    return snapshot


def _remove_new_swap_files(snapshot: dict[str, set[str]]) -> int:
    """Delete the swap files a run made (those not in `snapshot`) and the folders it made that are left empty.

    `destroy_engine` deletes an engine's swap files by name; this also catches those of a run stopped before its
    engine existed (a ZeRO-3 model built under zero.Init swaps its parameters out at once). Returns bytes freed."""
    from helpers.runtime import SWAP_ROOT, remove_swap_files

    freed = 0
    for folder, before in snapshot.items():
        root = os.path.join(folder, SWAP_ROOT)
        new_files, new_dirs = [], []
        for parent, dirs, files in os.walk(root, topdown=False):
            new_files += [os.path.join(parent, f) for f in files if os.path.join(parent, f) not in before]
            new_dirs += [os.path.join(parent, d) for d in dirs if os.path.join(parent, d) not in before]
        freed += remove_swap_files(new_files)
        for d in new_dirs + ([root] if root not in before else []):  # deepest first
            try:
                os.rmdir(d)
            except OSError:  # not empty (a file that is not ours), or gone
                pass
    return freed


def _clear_traceback_frames(exc: BaseException) -> None:
    """Drop the locals of every finished frame in `exc`'s traceback (and its chained exceptions').

    IPython keeps an interrupted cell's traceback (`sys.last_traceback`, the shell's printer), and each frame in it
    keeps its locals: `_Loop.run`'s engine, a step's loss and batch, DeepSpeed's own frames' `self`. Cleared, the
    traceback still prints (file, line, code) but holds nothing; frames still running (train_run's) are skipped."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]


def _record_memory(result: RunResult, mem: Any, ns: dict[str, Any]) -> None:
    """What `measure_peak` saw while train_run ran (`mem`), into `result`: the peak RSS of each phase, between the
    loop's time marks in `ns` (build model, initialize, train), and the peaks of GPU memory, RSS and NVMe bytes."""
    marks = [("build model", ns.get("t_start")), ("initialize", ns.get("t_built")), ("train", ns.get("t_ready")),
             ("end", time.perf_counter())]
    for (phase, t0), (_, t1) in zip(marks, marks[1:]):
        if t0 is not None and t1 is not None:
            result.rss_by_phase[phase] = round(mem.peak_between("rss", t0 - mem.started, t1 - mem.started) / GB, 3)
    result.peak_vram_gib = round((mem.peak_gpu_allocated - mem.baseline_gpu_allocated) / GiB, 3)
    result.peak_reserved_gib = round(mem.peak_gpu_reserved / GiB, 3)
    result.peak_rss_gb = round(mem.peak_rss / GB, 3)
    result.baseline_rss_gb = round(mem.baseline_rss / GB, 3)
    result.disk_gb = round(mem.nvme_bytes_added / GB, 3)


def train_run(name: str, model_factory: Callable[[], Any], train_blocks: Any, *, runtime: "Runtime",
              ds_config: dict[str, Any], plain_pytorch: bool = False, steps: int = 20, checkpointing: bool = False,
              seed: int = 0, estimated_bytes: int = 0, model_name: str = "",
              measure: MeasureSettings | None = None) -> RunResult:
    """Train a fresh model for `steps` optimizer steps with `ds_config` and measure it (notebook 01).

    Micro-batch, gradient accumulation, learning rate, weight decay, clipping and warm-up come from
    `ds_config` (`RunSettings`). `plain_pytorch=True` trains the same numbers without DeepSpeed: torch AdamW with the
    config's parameters, the very learning-rate scheduler DeepSpeed builds from the config's "scheduler" block
    (`lr_scheduler_from_config`: WarmupLR's first two updates run at warmup_min_lr, and a step fp16 overflow skipped
    does not advance it, as in DeepSpeed's engine), AMP with a GradScaler (the baseline). `RunResult.lrs` is the
    learning rate of each step, for either. `model_factory()` returns the model, or
    (model, keep_alive) for a model built under ZeRO-3 (`helpers.checkpoints.build_zero3_model`). Peak GPU memory is
    measured above the idle baseline, tokens/s after the first `measure.untimed_steps` steps, bytes in the config's
    NVMe folder while it runs (offload_param's, else offload_optimizer's), above what the folder held at the start.
    `measure` (`MeasureSettings`, which no notebook passes) holds validation, warm-up, progress, callbacks and the
    `hooks` one kind of model adds (`helpers.moe.MoEHooks`). CUDA out-of-memory is caught and reported
    in `RunResult.error`. Everything is torn down before returning, so runs can follow one another: the engine,
    the model, and the NVMe swap files the run wrote. An exception anywhere inside (a KeyboardInterrupt while the
    model is built, in deepspeed.initialize or in a step) tears down what was built before it is re-raised, and
    the frames of its traceback are cleared, so a kept traceback (IPython's `sys.last_traceback`) holds no engine
    or model. With NVMe offload the folders are those of `ds_config` (the one home of the NVMe path), checked when
    the run starts (there, writable, NVME_MIN_FREE_BYTES free, naming the swap files earlier runs left) and once
    the model is built, before `deepspeed.initialize`, against the course's estimate for its parameter count
    (ConfigError, with what was built removed); nothing is remembered from the config's build or earlier runs.
    `measure.on_phase(name)` and `measure.on_step(step, loss)` report progress (a child process sends them on).
    `measure.time_micro_batches=True` (benchmarks/offload_speed.py) waits for the GPU after every micro-batch and
    keeps the seconds of each in `extras["micro_batch_s"]` (one list per optimizer step; the last micro-batch of a step
    includes DeepSpeed's optimizer step), and DeepSpeed's count of steps skipped by fp16 overflow in
    `extras["skipped_steps"]`; with DeepSpeed also where each micro-batch's seconds went, in
    `extras["micro_batch_phases"]` (forward, backward, engine.step, and `helpers.step_time.ZERO3_PHASES`: the
    ZeRO-3 optimizer's own components, timed by `PhaseClock`).
    """
    import torch

    measure = measure or MeasureSettings()
    settings = RunSettings.from_config(ds_config)
    seq_len, model_factory = _check_run_inputs(steps, train_blocks, model_factory, model_name,  # issues 23, 41
                                               measure.untimed_steps, measure.eval_batches)
    # a run shorter than its warm-up times its last step(s) rather than none (issue 41: tokens/s read 0); the record
    # says how many steps its tokens/s covers
    untimed_steps = min(measure.untimed_steps, steps - 1)
    nvme_folders = [] if plain_pytorch else _nvme_folders(ds_config)
    _check_nvme_space(nvme_folders)  # before every run: a full disk aborts the process in DeepSpeed's C++ reader
    swap_before = _swap_snapshot(nvme_folders)
    hooks = measure.hooks or TrainHooks()
    torch.manual_seed(seed)
    setup_single_process()
    reset_peak_stats()
    # the precision the run trains in: the config's (NVMe parameter offload runs bf16 on a fp32 CPU runtime)
    precision = runtime.precision if plain_pytorch else next(
        (p for p in ("fp16", "bf16") if (ds_config.get(p) or {}).get("enabled")), "fp32")
    result = RunResult(name=name, model=model_name, params=0, config="plain PyTorch" if plain_pytorch else name,
                       precision=precision, micro_batch=settings.micro_batch, grad_accum=settings.grad_accum,
                       seq_len=seq_len, steps=steps, checkpointing=checkpointing, runtime=runtime.label)
    loop = _Loop(result, settings, runtime, hooks, ds_config, plain_pytorch,
                 _Meter(result, runtime, untimed_steps, micro_batches=measure.time_micro_batches),
                 measure.on_step or (lambda step, loss: None), measure.on_phase or (lambda phase: None))
    if nvme_folders:  # once the model exists, before deepspeed.initialize: its NVMe need, from its parameter count
        loop.check_nvme = lambda n, largest: _check_nvme_need(ds_config, n, largest, model=model_name,
                                                              written=_new_swap_bytes(swap_before))
    try:
        with measure_peak(nvme_path=nvme_folders[0] if nvme_folders else None) as mem:
            try:
                loop.run(model_factory, train_blocks, measure.val_blocks, steps, checkpointing, measure.eval_every,
                         measure.eval_batches, seed, measure.progress)
            except torch.OutOfMemoryError as exc:
                result.error = oom_summary(str(exc), runtime.vram_budget_bytes)
                result.extras["raw_error"] = str(exc).split("\n")[0][:600]
        if not result.error:
            loop.finish()
    except BaseException as exc:  # an interrupt or error anywhere inside: nothing it built may outlive the cell
        _clear_traceback_frames(exc)  # the inner frames' locals (engine, model, batches), before the teardown below
        raise
    finally:  # an interrupted run (KeyboardInterrupt) is torn down too: its engine must not outlive the cell
        try:
            hooks.close()
        finally:
            loop.close()
            _remove_new_swap_files(swap_before)
    _record_memory(result, mem, loop.ns)
    result.estimated_vram_gib = round(estimated_bytes / GiB, 3)
    return result


class _Loop:
    """The loop of `train_run`, the one notebook 01 writes out: build the model and its optimizer (`build`), then per
    optimizer step `engine_step` (DeepSpeed: forward, `engine.backward`, `engine.step` per micro-batch) or `plain_step`
    (PyTorch AMP: forward, scaled backward, then unscale, clip, `scaler.step`, the scheduler). What is measured around
    it (step and micro-batch seconds, tokens/s) is `meter`'s, a `_Meter`; every object the loop makes is kept in `ns`,
    for the teardown (`close`)."""

    def __init__(self, result: RunResult, settings: RunSettings, runtime: "Runtime", hooks: TrainHooks,
                 ds_config: dict[str, Any], plain: bool, meter: "_Meter", on_step: Callable[[int, float], None],
                 on_phase: Callable[[str], None]) -> None:
        self.result, self.settings, self.runtime, self.hooks = result, settings, runtime, hooks
        self.ds_config, self.plain, self.meter, self.on_step, self.on_phase = ds_config, plain, meter, on_step, on_phase
        self.ns: dict[str, Any] = {}
        self.check_nvme: Callable[[int, int], None] | None = None  # (parameters, largest tensor): refuses a full disk

    def build(self, model_factory: Callable[[], Any], checkpointing: bool, train_blocks: Any) -> None:
        """Model, then the optimizer: a DeepSpeed engine, or AdamW + warm-up + GradScaler for plain PyTorch."""
        ns = self.ns
        ns["t_start"] = time.perf_counter()
        made = model_factory()
        ns["t_built"] = time.perf_counter()
        model, ns["keep_alive"] = made if isinstance(made, tuple) else (made, None)
        del made
        ns["model"] = model
        self.result.params = sum({id(p): getattr(p, "ds_numel", p.numel()) for p in model.parameters()}.values())
        if checkpointing:
            model.gradient_checkpointing_enable()
        if hasattr(model, "config") and hasattr(model.config, "use_cache"):  # a Hugging Face model
            model.config.use_cache = False
        self.hooks.on_model(model, self.result, train_blocks)
        if self.plain:
            self._build_plain(model)
        else:
            self._build_engine(model)
        del model

    def _build_plain(self, model: Any) -> None:
        """The model on the device; torch AdamW with the config's numbers, DeepSpeed's own scheduler, a GradScaler."""
        import torch

        ns, s = self.ns, self.settings
        device = "cuda" if self.runtime.has_gpu else "cpu"
        model.to(device)
        opt = self.ds_config.get("optimizer", {}).get("params", {})
        ns["optimizer"] = torch.optim.AdamW(self.hooks.param_groups(model), lr=s.lr, weight_decay=s.weight_decay,
                                            **{k: (tuple(opt[k]) if k == "betas" else float(opt[k]))
                                               for k in ("betas", "eps") if k in opt})
        # the very scheduler DeepSpeed's engine builds from the config (WarmupLR: its warm-up and first steps)
        ns["scheduler"] = lr_scheduler_from_config(ns["optimizer"], self.ds_config)
        fp16 = self.ds_config.get("fp16") or {}  # DeepSpeed's dynamic loss scale: its start and growth window
        ns["scaler"] = torch.amp.GradScaler(device, enabled=self.runtime.precision == "fp16",
                                            init_scale=2.0 ** fp16.get("initial_scale_power", 16),
                                            growth_interval=int(fp16.get("loss_scale_window", 1000)))

    def _build_engine(self, model: Any) -> None:
        """`deepspeed.initialize`: the engine, with the optimizer, scheduler and loss scale its config names."""
        if self.check_nvme is not None:
            largest = max((getattr(p, "ds_numel", p.numel()) for p in model.parameters()), default=0)
            self.check_nvme(self.result.params, largest)
        import deepspeed

        self.on_phase("deepspeed.initialize")
        self.ns["engine"], self.ns["optimizer"], _, _ = deepspeed.initialize(
            model=model, model_parameters=self.hooks.param_groups(model), config=self.ds_config)
        self.meter.watch(self.ns["engine"])

    def close(self) -> None:
        """Tear down everything in `ns`, whether the run finished or stopped anywhere (a half-built engine too)."""
        from helpers.runtime import (destroy_engine, live_engines, release_nvme_swappers, release_zero3_globals,
                                     remove_deepspeed_hooks)

        ns = self.ns
        zero3 = ns.get("keep_alive") is not None
        marks = {k: ns[k] for k in ("t_start", "t_built", "t_ready") if k in ns}
        if ns.get("engine") is None and ns.get("model") is not None:
            # no engine to destroy (deepspeed.initialize was interrupted, or the model was still being set up):
            # what a half-built engine left on the model - hooks holding its optimizer, ZeRO-3's module stack and
            # NVMe swap buffers - goes as destroy_engine would take it
            model = ns["model"]
            try:
                # an engine initialize built but never returned (interrupted after its constructor): destroy it
                for engine in [e for e in live_engines() if getattr(e, "module", None) is model]:
                    destroy_engine(engine)
                release_nvme_swappers(model)
            finally:
                release_zero3_globals(model)
                remove_deepspeed_hooks(model)
                del model
        try:
            self.meter.close()
            teardown(ns, "engine", "scheduler", "scaler", "optimizer", "model", "keep_alive")
        finally:
            ns.clear()  # whatever a failed teardown left; only the phase times stay
            ns.update(marks)
            if zero3:
                from helpers.checkpoints import release_zero3

                release_zero3()

    def finish(self) -> None:
        """`hooks.finish` on the trained model, unwrapped from its engine."""
        net = self.ns.get("engine") or self.ns.get("model")
        self.hooks.finish(getattr(net, "module", net), self.result)

    def engine_step(self, engine: Any, batches: Any, device: str) -> float:
        """One optimizer step with DeepSpeed over `grad_accum` micro-batches; returns its loss. `engine.step()` after
        every micro-batch: the engine counts them and steps its optimizer (and scheduler) after the last one."""
        accum, meter = self.settings.grad_accum, self.meter
        step_loss = 0.0
        for _ in range(accum):
            meter.micro_batch_started()
            ids = next(batches)["input_ids"].to(device)
            meter.mark("batch to device")
            # the output is read and dropped before backward: it holds the logits (micro-batch x sequence x
            # vocabulary: 0.19 GiB at 4 x 512 for GPT-2 in fp16), which would otherwise add to the peak
            out = engine(input_ids=ids, labels=ids)
            self.hooks.after_forward(out)
            loss = out.loss
            del out
            meter.mark("forward")
            engine.backward(stage0_fp16_loss(engine, loss))
            meter.mark("backward")
            engine.step()
            meter.mark("engine.step")
            step_loss += loss.item() / accum
            del loss, ids
            meter.micro_batch_ended()
        meter.micro_batches_done()
        self.result.extras["skipped_steps"] = int(getattr(engine, "skipped_steps", 0))  # fp16 overflow skips so far
        return step_loss

    def plain_step(self, model: Any, batches: Any, device: str) -> float:
        """The same step in plain PyTorch: per micro-batch a forward under autocast and a scaled backward; then the
        GradScaler unscales, clips and steps, and the scheduler steps unless fp16 overflow skipped the update."""
        import torch

        accum, meter = self.settings.grad_accum, self.meter
        optimizer, scaler = self.ns["optimizer"], self.ns["scaler"]
        step_loss = 0.0
        for _ in range(accum):
            meter.micro_batch_started()
            ids = next(batches)["input_ids"].to(device)
            with _autocast(self.runtime):
                out = model(input_ids=ids, labels=ids)
            self.hooks.after_forward(out)
            loss = out.loss / accum
            del out  # the logits, before backward (see engine_step)
            scaler.scale(loss).backward()
            step_loss += loss.item()
            del loss, ids
            meter.micro_batch_ended()
        meter.micro_batches_done()
        scaler.unscale_(optimizer)
        if self.settings.gradient_clipping:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.settings.gradient_clipping)
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(optimizer)
        scaler.update()
        # a step the GradScaler skipped (inf/nan gradients: it lowered the scale) does not advance the schedule,
        # as DeepSpeed's engine does not step its scheduler on an fp16 overflow
        if scaler.is_enabled() and scaler.get_scale() < scale:
            self.result.extras["skipped_steps"] = self.result.extras.get("skipped_steps", 0) + 1
            self.result.extras.setdefault("skipped_at_steps", []).append(len(self.result.losses))
        elif self.ns["scheduler"] is not None:
            self.ns["scheduler"].step()
        optimizer.zero_grad(set_to_none=True)
        return step_loss

    def run(self, model_factory: Callable[[], Any], train_blocks: Any, val_blocks: Any, steps: int,
            checkpointing: bool, eval_every: int, eval_batches: int, seed: int, progress: bool) -> None:
        """Build, then `steps` optimizer steps: each one's learning rate, loss, progress line and validation."""
        from helpers.progress import progress_bar

        from helpers.data import block_loader

        result, runtime, s, meter = self.result, self.runtime, self.settings, self.meter
        batches = block_loader(train_blocks, s.micro_batch, seed=seed)
        device = "cuda" if runtime.has_gpu else "cpu"
        self.build(model_factory, checkpointing, train_blocks)
        self.on_phase("training")
        self.ns["t_ready"] = time.perf_counter()
        net = self.ns.get("engine") or self.ns["model"]
        net.train()
        meter.run_started()
        bar = progress_bar(range(steps), desc=result.name, disable=not progress)
        for step in bar:
            meter.step_started(step)
            skipped_before = getattr(net, "skipped_steps", None)  # DeepSpeed engines count fp16 overflow skips
            # the learning rate this step applies: DeepSpeed's engine.get_lr(), the plain optimizer's group
            lrs = net.get_lr() if hasattr(net, "get_lr") else [g["lr"] for g in self.ns["optimizer"].param_groups]
            result.lrs.append(float(lrs[0]) if lrs else math.nan)
            step_loss = (self.plain_step if self.plain else self.engine_step)(net, batches, device)
            if skipped_before is not None and getattr(net, "skipped_steps", skipped_before) > skipped_before:
                result.extras.setdefault("skipped_at_steps", []).append(step)
            meter.step_ended()
            result.losses.append(step_loss)
            self.on_step(step, step_loss)
            # the loss only: a running tokens/s here would be a third speed beside the median step and the mean the
            # table prints (issue 40: two tokens/s for one run in one cell)
            bar.set_postfix({"loss": f"{step_loss:.3f}", **self.hooks.after_step(step, result)})
            if val_blocks is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
                result.val_losses.append((step + 1, self.hooks.evaluate(net, val_blocks, runtime, eval_batches,
                                                                        s.micro_batch, autocast=self.plain)))
        meter.run_ended(steps, s.micro_batch * s.grad_accum * result.seq_len)


class _Meter:
    """What `train_run` measures around `_Loop`, kept out of the loop a learner reads. Always: the seconds of each
    step from the `untimed_steps`-th on (`RunResult.step_seconds`, the run's tokens/s) and of the whole loop. With
    `micro_batches` (`time_micro_batches=True`, benchmarks/offload_speed.py): each micro-batch's seconds
    (`extras["micro_batch_s"]`, one list per step) and, for a DeepSpeed engine, where they went
    (`extras["micro_batch_phases"]`: the loop's `mark`s, and the ZeRO-3 optimizer's own components,
    `helpers.step_time.ZERO3_PHASES`, timed by `PhaseClock`). Each reading of the clock waits for the GPU first."""

    def __init__(self, result: RunResult, runtime: "Runtime", untimed_steps: int, micro_batches: bool) -> None:
        import torch

        self.result, self.untimed_steps, self.micro_batches = result, untimed_steps, micro_batches
        self.sync = torch.cuda.synchronize if runtime.has_gpu else (lambda: None)
        self.phases_on = False  # per-phase seconds: micro_batches with a DeepSpeed engine (`watch`)
        self.phase_clock: Any = None
        self.start = self.timed_from = self.step_from = self.micro_from = self.mark_from = 0.0
        self.timed = False
        self.timings: list[float] = []
        self.phases: list[dict[str, float]] = []

    def watch(self, engine: Any) -> None:
        """A DeepSpeed engine trains: time its micro-batches' phases, under ZeRO-3 its optimizer's too (ZeRO-1/2's
        optimizer has an `_optimizer_step` of its own, which ZERO3_PHASES must not time)."""
        self.phases_on = self.micro_batches
        if self.micro_batches and engine.zero_optimization_stage() == 3:
            from helpers.step_time import ZERO3_PHASES, PhaseClock

            self.phase_clock = PhaseClock(engine.optimizer, ZERO3_PHASES)

    def close(self) -> None:
        """Take the phase clock's wrappers off the optimizer (the teardown's first act)."""
        clock, self.phase_clock = self.phase_clock, None
        if clock is not None:
            clock.remove()

    def run_started(self) -> None:
        """The loop starts (the model and its optimizer are built)."""
        self.start = time.perf_counter()
        self.result.step_seconds = []

    def step_started(self, step: int) -> None:
        """Optimizer step `step` (from 0) starts; from step `untimed_steps` on, steps are timed."""
        if step == self.untimed_steps:
            self.sync()
            self.timed_from, self.timed = time.perf_counter(), True
        self.step_from = time.perf_counter()

    def step_ended(self) -> None:
        """The step is done: its seconds into `RunResult.step_seconds` when it is timed."""
        if self.timed:
            self.sync()  # plain PyTorch's optimizer step is still queued after .item()
            self.result.step_seconds.append(round(time.perf_counter() - self.step_from, 5))

    def run_ended(self, steps: int, tokens_per_step: int) -> None:
        """tokens/s over the timed steps; the loop's seconds."""
        self.sync()
        end = time.perf_counter()
        if self.timed and steps > self.untimed_steps:
            self.result.tokens_per_s = round((steps - self.untimed_steps) * tokens_per_step / (end - self.timed_from), 1)
            self.result.extras["timed_steps"] = steps - self.untimed_steps
        self.result.seconds = round(end - self.start, 2)

    def micro_batch_started(self) -> None:
        """A micro-batch starts (before its batch moves to the device)."""
        self.micro_from = self.mark_from = time.perf_counter()
        if self.phases_on:
            self.phases.append({})

    def mark(self, phase: str) -> None:
        """The micro-batch's seconds since the last mark (or its start) were spent in `phase`."""
        if self.phases_on:
            self.sync()
            now = time.perf_counter()
            self.phases[-1][phase] = round(now - self.mark_from, 4)
            self.mark_from = now

    def micro_batch_ended(self) -> None:
        """The micro-batch is done: ZeRO-3's optimizer phases into its phases, its seconds into the step's list."""
        if self.phase_clock is not None:
            self.phases[-1].update(self.phase_clock.take())
        if self.micro_batches:
            self.sync()
            self.timings.append(round(time.perf_counter() - self.micro_from, 4))

    def micro_batches_done(self) -> None:
        """The step's micro-batches are done: their seconds (and phases) into the record, as one list each."""
        if self.micro_batches:
            self.result.extras.setdefault("micro_batch_s", []).append(self.timings)
        if self.phases:
            self.result.extras.setdefault("micro_batch_phases", []).append(self.phases)
        self.timings, self.phases = [], []
