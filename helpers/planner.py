"""Plan a run before running it: model, stage, offload, precision, micro-batch -> DeepSpeed JSON and
the memory estimate against this runtime's budget (notebook 00; an ipywidgets UI over `plan`)."""
from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from helpers.config import ConfigError, build_ds_config, check_number, nvme_buffer_size_for
from helpers.memory import PreflightReport, estimate_activations, preflight

if TYPE_CHECKING:
    from helpers.hardware import Runtime
    from helpers.models import ModelShape


@dataclass
class Plan:
    """The config, the estimate and the verdict for one choice of settings."""

    shape: "ModelShape"
    config: dict[str, Any] | None
    report: PreflightReport | None
    activation_bytes: int
    error: str = ""

    def __str__(self) -> str:
        head = f"model {self.shape.name}: {self.shape.n_params / 1e6:,.1f}M params"
        if self.error:
            return f"{head}\nconfig refused: {self.error}"
        assert self.report is not None
        est = self.report.estimate.with_activations(self.activation_bytes)
        text = [head, est.table(), str(self.report)]
        if self.report.suggestion:
            init = " with the model built under deepspeed.zero.Init" if self.report.suggestion_zero_init else ""
            text.append(f"a config predicted to fit: build_ds_config(**{self.report.suggestion}){init}")
        return "\n".join(text)


def plan(model: "str | ModelShape" = "gpt2", stage: int = 2, *, offload_optimizer: str = "none",
         offload_param: str = "none", precision: str = "auto", micro_batch_size: int = 4, seq_len: int = 512,
         checkpointing: bool = True, runtime: "Runtime | None" = None, nvme_path: str | None = None) -> Plan:
    """Build the config and estimate it against the budget; a refused config is reported, not raised.

    Bad inputs that are not config settings (the model, seq_len) raise ValueError / ConfigError with the fix.
    NVMe parameter buffers are sized for the model's largest tensor, as `offload_config` sizes them.
    """
    from helpers.hardware import detect_runtime
    from helpers.models import ModelShape, model_shape

    check_number("seq_len", seq_len, positive=True, integer=True, example=512)
    runtime = runtime or detect_runtime()
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    try:
        config = build_ds_config(stage, precision=precision, runtime=runtime, micro_batch_size=micro_batch_size,
                                 offload_optimizer=offload_optimizer, offload_param=offload_param,
                                 nvme_path=nvme_path, check_paths=False, largest_param=shape.largest_layer_params,
                                 nvme_buffer_size=nvme_buffer_size_for(shape.largest_layer_params),
                                 activation_checkpointing=checkpointing)
    except ConfigError as exc:
        return Plan(shape, None, None, 0, error=str(exc))
    act_precision = "fp32" if runtime.precision == "fp32" else "fp16"
    act = estimate_activations(micro_batch_size, seq_len, shape.hidden, shape.n_layers, shape.vocab,
                               n_heads=shape.n_heads, precision=act_precision, checkpointing=checkpointing)
    report = preflight(config, shape.n_params, runtime, largest_layer_params=shape.largest_layer_params,
                       activation_bytes=act, nvme_path=nvme_path, raise_on_failure=False)
    return Plan(shape, config, report, act)


def planner_widget(runtime: "Runtime | None" = None) -> Any:
    """An ipywidgets form over `plan`; the JSON and the verdict update as you change a setting."""
    import ipywidgets as w

    from helpers.hardware import detect_runtime
    from helpers.models import GPT2_LADDER

    runtime = runtime or detect_runtime()
    out = w.HTML()
    controls = {
        "model": w.Combobox(value="gpt2", options=list(GPT2_LADDER), description="model",
                            placeholder="1.3B, a ladder name, a local path or Hub id", ensure_option=False),
        "stage": w.Dropdown(options=[0, 1, 2, 3], value=2, description="ZeRO stage"),
        "offload_optimizer": w.Dropdown(options=["none", "cpu", "nvme"], value="none", description="opt. offload"),
        "offload_param": w.Dropdown(options=["none", "cpu", "nvme"], value="none", description="param offload"),
        "precision": w.Dropdown(options=["auto", "fp16", "bf16", "fp32"], value="auto", description="precision"),
        "micro_batch_size": w.IntSlider(value=4, min=1, max=32, description="micro-batch"),
        "seq_len": w.Dropdown(options=[128, 256, 512, 1024], value=512, description="seq len"),
        "checkpointing": w.Checkbox(value=True, description="activation checkpointing"),
    }

    def refresh(_: Any = None) -> None:
        kwargs = {k: c.value for k, c in controls.items()}
        try:
            p = plan(kwargs.pop("model"), runtime=runtime, nvme_path="/tmp/nvme", **kwargs)
            text = str(p) + ("\n\n" + json.dumps(p.config, indent=2) if p.config is not None else "")
        except Exception as exc:  # unknown model id, no network ...
            text = f"cannot plan this: {exc}"
        out.value = f"<pre>{html.escape(text)}</pre>"

    for c in controls.values():
        c.observe(refresh, names="value")
    refresh()
    return w.VBox([w.HBox(list(controls.values())[:4]), w.HBox(list(controls.values())[4:]), out])
