"""Helpers for the DeepSpeed course notebooks.

Importing this package does nothing heavy: every public name is resolved lazily on first
use (PEP 562), so ``import helpers`` is instant and works without torch or deepspeed.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # hardware (notebook 00 onwards)
    "Runtime": "hardware",
    "detect_runtime": "hardware",
    "choose_precision": "hardware",
    "t4_budget_requested": "hardware",
    "apply_t4_budget": "hardware",
    "sized": "hardware",
    "smoke_size": "hardware",
    "T4_VRAM_GIB": "hardware",
    "COLAB_RAM_GB": "hardware",
    "in_colab": "hardware",
    "default_nvme_path": "hardware",
    # DeepSpeed in a notebook
    "setup_single_process": "runtime",
    "free_port": "runtime",
    "teardown": "runtime",
    "reset_peak_stats": "runtime",
    "gpu_allocated_bytes": "runtime",
    "mmap_large_allocations": "runtime",
    "release_host_memory": "runtime",
    "clean_slate": "runtime",
    "require": "runtime",
    "live_engines": "runtime",
    "warm_up_deepspeed": "runtime",
    # config builder
    "build_ds_config": "config",
    "validate_ds_config": "config",
    "ConfigError": "config",
    "COURSE_CONFIGS": "config",
    "course_config": "config",
    "write_course_configs": "config",
    "offload_config": "config",
    "OFFLOAD_KINDS": "config",
    "check_nvme_path": "config",
    "check_nvme_buffers": "config",
    "nvme_buffer_size_for": "config",
    # memory
    "ModelStateEstimate": "memory",
    "estimate_model_states": "memory",
    "estimate_activations": "memory",
    "estimate_for_config": "memory",
    "deepspeed_estimate": "memory",
    "count_params": "memory",
    "measure_peak": "memory",
    "Measurement": "memory",
    "preflight": "memory",
    "BudgetError": "memory",
    # health
    "run_ds_report": "health",
    "parse_ds_report": "health",
    "health_checks": "health",
    "health_table": "health",
    # plots
    "plot_peak_vram": "plots",
    "plot_memory_breakdown": "plots",
    "plot_memory_timeline": "plots",
    "plot_losses": "plots",
    "plot_speed_vs_memory": "plots",
    "colab_t4_profile": "hardware",
    # planner
    "plan": "planner",
    "planner_widget": "planner",
    "estimate_peak": "memory",
    "model_states_per_gpu": "memory",
    "estimate_step_transient": "memory",
    # data (notebook 01 onwards)
    "load_text_dataset": "data",
    "train_tokenizer": "data",
    "load_tokenizer": "data",
    "pack_blocks": "data",
    "block_loader": "data",
    # models
    "GPT2_LADDER": "models",
    "gpt2_config": "models",
    "model_shape": "models",
    "save_model_from_config": "models",
    "load_causal_lm": "models",
    # ZeRO-3 models and checkpoints (notebook 02)
    "build_zero3_model": "checkpoints",
    "release_zero3": "checkpoints",
    "save_checkpoint": "checkpoints",
    "resume_checkpoint": "checkpoints",
    "consolidate_to_hf": "checkpoints",
    # training runs
    "RunResult": "train",
    "train_run": "train",
    "evaluate": "train",
    "results_table": "train",
    # a run in a fresh child process (notebook 02, the ladder)
    "train_in_fresh_process": "fresh_process",
    "child_baseline_rss": "fresh_process",
    "run_process_group": "fresh_process",
    # records
    "record_figure": "records",
    "recorded_figures": "records",
    # Hugging Face Trainer and Accelerate (notebook 04)
    "AUTO_FIELDS": "integrations",
    "HIDDEN_SIZE_AUTO": "integrations",
    "driver_config": "integrations",
    "trainer_ds_config": "integrations",
    "auto_table": "integrations",
    "config_differences": "integrations",
    "training_arguments": "integrations",
    "ordered_blocks": "integrations",
    "causal_lm_collator": "integrations",
    "fix_causal_lm_loss": "integrations",
    "loss_token_count": "integrations",
    "StepRecorder": "integrations",
    "DriverRun": "integrations",
    "recorded_result": "integrations",
    "run_trainer": "integrations",
    "run_accelerate": "integrations",
    "accelerate_precision": "integrations",
    "hf_deepspeed_state": "integrations",
    "reset_hf_deepspeed_state": "integrations",
    "teardown_hf": "integrations",
    "placeholder_tensors": "integrations",
    "check_saved_weights": "integrations",
    "logits_for": "integrations",
    "accelerate_config_yaml": "integrations",
    "launch_commands": "integrations",
    "launch_script": "integrations",
    "agreement": "integrations",
    # Mixture of Experts (notebook 03)
    "MoEConfig": "moe",
    "ParamCounts": "moe",
    "build_gpt_moe": "moe",
    "count_moe_params": "moe",
    "moe_param_groups": "moe",
    "describe_param_groups": "moe",
    "measure_flops_per_token": "moe",
    "analytic_flops_per_token": "moe",
    "expert_capacity": "moe",
    "RoutingRecorder": "moe",
    "RoutingSummary": "moe",
    "set_capacity_factor": "moe",
    "capacity_sweep": "moe",
    "MoERun": "moe",
    "moe_table": "moe",
    "moe_ds_config": "moe",
    "train_moe": "moe",
    "evaluate_moe": "moe",
    "zero3_refusal": "moe",
    "expert_parallel_summary": "moe",
    "plot_expert_load": "moe",
    "plot_capacity_sweep": "moe",
    "plot_balance": "moe",
    "plot_params": "moe",
    "quiet_deepspeed": "moe",
    # scaling out: launcher, data / pipeline / tensor parallelism (notebook 05)
    "SCALE_OUT_SHAPES": "scale_out",
    "gpt_config": "scale_out",
    "corpus_blocks": "scale_out",
    "rank_state_bytes": "scale_out",
    "GradientPeak": "scale_out",
    "launch_argv": "scale_out",
    "single_node_commands": "scale_out",
    "function_source": "scale_out",
    "run_ranks": "scale_out",
    "hostfile_text": "scale_out",
    "parse_hostfile": "scale_out",
    "multi_node_commands": "scale_out",
    "zero_rows": "scale_out",
    "with_estimates": "scale_out",
    "estimate_parts": "scale_out",
    "scaling_table": "scale_out",
    "plot_zero_scaling": "scale_out",
    "pipeline_layers": "scale_out",
    "lm_loss": "scale_out",
    "PipelineSchedule": "scale_out",
    "pipeline_schedule": "scale_out",
    "autotp_config": "scale_out",
    "topology_table": "scale_out",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'helpers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"helpers.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
