"""One config, three drivers (raw engine, Trainer, Accelerate), ZeRO-3 saving with Trainer, global state, the
launched Trainer program (CPU)."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from helpers.checkpoints import check_saved_weights, logits_for, placeholder_tensors
from helpers.config import AUTO_FIELDS, ConfigError, course_config, trainer_ds_config
from helpers.data import load_text_dataset, pack_blocks, train_tokenizer
from helpers.hardware import detect_runtime
from helpers.integrations import (agreement, auto_table, causal_lm_collator, config_differences, fix_causal_lm_loss,
                                  loss_token_count, ordered_blocks, run_accelerate, run_trainer, teardown_hf,
                                  training_arguments)
from helpers.runtime import hf_deepspeed_state, reset_hf_deepspeed_state
from helpers.launch import PROGRAMS, accelerate_config_yaml, launch_commands, run_ranks
from helpers.models import load_causal_lm, save_model_from_config
from helpers.runtime import DIST_ENV_VARS, setup_single_process
from helpers.train import MeasureSettings, train_run

VOCAB = 1024
SEQ = 32
MB = 4
STEPS = 6
LR = 3e-3
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def config(name, steps=STEPS, **overrides):
    """The one config every driver gets (as notebook 04 builds it): warm-up a tenth of the steps."""
    return course_config(name, detect_runtime(), micro_batch_size=MB, lr=LR, warmup_steps=max(1, steps // 10),
                         **overrides)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrations")
    ds = load_text_dataset("local")
    tok = train_tokenizer(ds["train"]["text"], root / "tok", vocab_size=VOCAB)
    blocks = pack_blocks(ds["train"].select(range(400)), tok, SEQ)
    # no dropout: the three drivers then compute exactly the same steps
    model_dir = save_model_from_config(root / "model", "gpt2-tiny", vocab_size=VOCAB, **NO_DROPOUT)
    return root, blocks, model_dir


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in DIST_ENV_VARS + ("ACCELERATE_USE_DEEPSPEED",):
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    setup_single_process()
    yield
    reset_hf_deepspeed_state()


def test_trainer_config_marks_exactly_the_trainer_owned_keys_auto():
    cfg = course_config("zero2", detect_runtime(), micro_batch_size=MB, lr=LR)
    auto = trainer_ds_config(cfg)
    diff = config_differences(cfg, auto)
    assert diff and all(new == "auto" for _, new in diff.values())
    assert set(diff) <= set(AUTO_FIELDS)
    assert {"optimizer.params.lr", "train_micro_batch_size_per_gpu", "gradient_clipping"} <= set(diff)
    assert auto["zero_optimization"] == cfg["zero_optimization"]  # bucket sizes kept unless asked
    assert cfg["optimizer"]["params"]["lr"] == LR  # the input is not modified
    buckets = trainer_ds_config(course_config("zero3"), auto_buckets=True)["zero_optimization"]
    assert buckets["reduce_bucket_size"] == buckets["stage3_param_persistence_threshold"] == "auto"
    assert "per_device_train_batch_size" in auto_table(cfg, auto)
    with pytest.raises(ConfigError, match="zero_optimization"):
        trainer_ds_config({"train_batch_size": 4})
    # the T4's fp16 config in Trainer's form (configs/zero2_trainer.json): the batch and both half-precision switches
    # "auto", so the one file runs in fp16, bf16 or fp32 as TrainingArguments say, on any number of GPUs
    t4_form = trainer_ds_config(course_config("zero2"))
    assert list(t4_form)[0] == "train_batch_size" and t4_form["train_batch_size"] == "auto"
    assert t4_form["fp16"]["enabled"] == t4_form["bf16"]["enabled"] == "auto"
    assert t4_form["fp16"]["loss_scale"] == 0  # the rest of the section as it was


def test_training_arguments_fill_the_auto_values_with_the_config_values(work):
    root, _, _ = work
    rt = detect_runtime()
    cfg = config("zero2")
    args = training_arguments(root / "out", cfg, rt, steps=STEPS)
    filled = args.hf_deepspeed_config.config
    for key in ("train_micro_batch_size_per_gpu", "gradient_clipping", "optimizer", "gradient_accumulation_steps"):
        assert filled[key] == cfg[key], key
    # the course's config leaves train_batch_size to DeepSpeed; Trainer's form has it "auto", filled for this world
    assert "train_batch_size" not in cfg and filled["train_batch_size"] == MB * args.world_size
    assert filled["scheduler"]["params"]["warmup_max_lr"] == LR
    reset_hf_deepspeed_state()


def test_trainer_refuses_a_concrete_value_that_disagrees_with_its_arguments(work):
    root, _, model_dir = work
    rt = detect_runtime()
    cfg = config("zero2")
    args = training_arguments(root / "out", cfg, rt, steps=STEPS, auto=False, learning_rate=LR / 10)
    with pytest.raises(ValueError, match="optimizer.params.lr"):
        args.hf_deepspeed_config.trainer_config_finalize(args, load_causal_lm(model_dir), STEPS)


def test_ordered_blocks_are_the_batches_train_run_draws(work):
    _, blocks, _ = work
    from helpers.data import block_loader

    ordered = ordered_blocks(blocks, MB, 3, seed=0)
    loader = block_loader(blocks, MB, seed=0)
    for i in range(3):
        assert torch.equal(ordered[i * MB:(i + 1) * MB]["input_ids"], next(loader)["input_ids"])
    batch = causal_lm_collator([ordered[0], ordered[1]])
    assert batch["input_ids"].shape == (2, SEQ) and torch.equal(batch["labels"], batch["input_ids"])


@pytest.mark.slow
@pytest.mark.parametrize("stage,accum", [(2, 2), (3, 1)])
def test_raw_engine_trainer_and_accelerate_follow_the_same_loss_trajectory(work, stage, accum):
    root, blocks, model_dir = work
    rt = detect_runtime()
    cfg = config(f"zero{stage}", grad_accum_steps=accum)
    if stage == 3:
        from helpers.checkpoints import build_zero3_model

        raw_factory = lambda: build_zero3_model(cfg, model_dir)  # noqa: E731
    else:
        raw_factory = lambda: load_causal_lm(model_dir)  # noqa: E731
    raw = train_run("raw", raw_factory, blocks, runtime=rt, ds_config=cfg, steps=STEPS,
                    measure=MeasureSettings(progress=False))
    data = ordered_blocks(blocks, MB, STEPS * accum)
    trainer = run_trainer("Trainer", lambda: load_causal_lm(model_dir), data, runtime=rt, ds_config=cfg,
                          steps=STEPS, output_dir=root / f"trainer{stage}", progress=False)
    accel = run_accelerate("Accelerate", lambda: load_causal_lm(model_dir), data, runtime=rt, ds_config=cfg,
                           steps=STEPS, progress=False)
    assert raw.losses[-1] < raw.losses[0] - 0.2, raw.losses
    assert (raw.micro_batch, raw.grad_accum) == (MB, accum)  # read from the config
    for run, driver in ((trainer, "Trainer"), (accel, "Accelerate")):
        assert run.extras["driver"] == driver and run.extras["engine_class"] == "DeepSpeedEngine"
        assert len(run.losses) == STEPS and (run.micro_batch, run.grad_accum) == (MB, accum)
        assert run.losses == pytest.approx(raw.losses, rel=1e-4), driver
        assert agreement(raw, run) < 1e-3
        assert run.tokens_per_s > 0 and run.params == raw.params and run.peak_rss_gb > 0
        # every value of the helpers config is what the engine ran
        changed = {k: v for k, v in config_differences(cfg, run.extras["resolved_config"]).items()
                   if v[0] != "<absent>"}
        changed.pop("steps_per_print", None)  # Accelerate silences DeepSpeed's own logging
        assert not changed, changed
    assert hf_deepspeed_state()["transformers HfDeepSpeedConfig"] == "none"  # nothing left behind


@pytest.mark.slow
def test_trainer_without_the_loss_fix_divides_by_every_token(work):
    root, blocks, model_dir = work
    rt = detect_runtime()
    cfg = config("zero2")
    from transformers import Trainer

    ns = {}
    batch = causal_lm_collator([blocks[i] for i in range(MB)])
    model = load_causal_lm(model_dir)
    args = training_arguments(root / "out", cfg, rt, steps=STEPS)
    ns["trainer"] = Trainer(model=model, args=args, data_collator=causal_lm_collator)
    assert loss_token_count(ns["trainer"], batch) == MB * SEQ  # position 0 is counted but never predicted
    # a second Trainer on the same arguments meets the first one's Accelerate state (fresh arguments reset it)
    with pytest.raises(NotImplementedError, match="second `Accelerator`"):
        Trainer(model=model, args=args)
    teardown_hf(ns, "trainer")
    fix_causal_lm_loss(model)
    ns["trainer"] = Trainer(model=model, args=training_arguments(root / "out", cfg, rt, steps=STEPS),
                            data_collator=causal_lm_collator)
    assert loss_token_count(ns["trainer"], batch) == MB * (SEQ - 1)
    teardown_hf(ns, "trainer")


@pytest.mark.slow
def test_zero3_trainer_saves_real_weights_that_reload_to_the_same_logits(work):
    root, blocks, model_dir = work
    rt = detect_runtime()
    cfg = config("zero3", steps=4)
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even the small tensors
    ids = blocks[0:2]["input_ids"]
    out = root / "zero3_saved"
    saved = {}

    def save(trainer):
        engine = trainer.model_wrapped
        assert engine.module.transformer.wte.weight.numel() == 0  # partitioned: a placeholder on this rank
        empty, total = placeholder_tensors(engine.module.state_dict())
        trainer.model.save_pretrained(str(root / "naive"))  # saves the placeholders
        naive = check_saved_weights(root / "naive", engine)
        trainer.save_model(str(out))
        saved.update(logits=logits_for(engine, ids), check=check_saved_weights(out, engine),
                     placeholders=(empty, total), naive=naive)

    run = run_trainer("Trainer ZeRO-3", lambda: load_causal_lm(model_dir), ordered_blocks(blocks, MB, 4),
                      runtime=rt, ds_config=cfg, output_dir=root / "t3", progress=False, after=save)
    assert len(run.losses) == 4 and run.extras["resolved_config"]["zero_optimization"]["stage"] == 3
    empty, total = saved["placeholders"]
    assert empty == total > 0  # a naive state_dict() under ZeRO-3 holds nothing but placeholders
    assert saved["naive"]["empty"] > 0 and saved["naive"]["shape_mismatches"]
    check = saved["check"]
    assert check["empty"] == 0 and not check["shape_mismatches"] and check["tensors"] >= total - 1
    assert check["max_abs_diff"] == 0.0
    reloaded = load_causal_lm(str(out))  # built whole: the global ZeRO-3 config was reset
    assert reloaded.transformer.wte.weight.shape == (VOCAB, 64)
    assert torch.allclose(logits_for(reloaded, ids), saved["logits"], atol=1e-5)
    fresh = load_causal_lm(model_dir)
    assert not torch.allclose(logits_for(fresh, ids), saved["logits"], atol=1e-3)  # training changed it


def test_saved_weights_check_names_the_fix_for_a_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="stage3_gather_16bit_weights_on_model_save"):
        check_saved_weights(tmp_path, None)


@pytest.mark.slow
def test_a_second_accelerator_with_deepspeed_is_refused_until_the_state_is_reset():
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    rt = detect_runtime()
    cfg = course_config("zero2", rt)
    ns = {"first": Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(cfg)))}
    assert hf_deepspeed_state()["ACCELERATE_USE_DEEPSPEED"] == "true"
    with pytest.raises(NotImplementedError, match="second `Accelerator`"):
        Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(cfg)))
    before = reset_hf_deepspeed_state()
    assert before["Accelerate state"] != "none"
    assert hf_deepspeed_state() == {"transformers HfDeepSpeedConfig": "none", "Accelerate state": "none",
                                    "ACCELERATE_USE_DEEPSPEED": "unset"}
    ns["second"] = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(cfg)))
    assert str(ns["second"].distributed_type).endswith("DEEPSPEED")
    teardown_hf(ns, "first", "second")


@pytest.mark.slow
def test_teardown_frees_the_trainer_model_a_plain_del_keeps(work):
    import gc
    import weakref

    from transformers import Trainer

    root, blocks, model_dir = work
    rt = detect_runtime()
    cfg = config("zero2", steps=2)
    refs = []
    for how in ("del", "teardown_hf"):
        ns = {"trainer": Trainer(model=load_causal_lm(model_dir),
                                 args=training_arguments(root / "tt", cfg, rt, steps=2, progress=False),
                                 train_dataset=ordered_blocks(blocks, MB, 2), data_collator=causal_lm_collator)}
        ns["trainer"].train()
        refs.append(weakref.ref(ns["trainer"].model_wrapped.module))
        if how == "del":
            del ns["trainer"]
            reset_hf_deepspeed_state()
        else:
            teardown_hf(ns, "trainer")
        gc.collect()
    assert refs[0]() is not None  # something still holds the engine's model after a plain del
    assert refs[1]() is None


def test_launch_commands_and_accelerate_config(tmp_path):
    cfg_path = ROOT / "configs" / "zero3.json"
    program = PROGRAMS / "trainer_train.py"
    cmds = launch_commands(program, 4, args=["--deepspeed", cfg_path], accelerate_config="acc.yaml")
    assert cmds["deepspeed"] == ("deepspeed --num_gpus 4 --master_port 29500 notebooks/programs/trainer_train.py "
                                 "--deepspeed configs/zero3.json")
    assert cmds["torchrun"].startswith("torchrun --nproc_per_node 4 --master_port 29500 notebooks/programs/")
    assert cmds["accelerate"].startswith("accelerate launch --multi_gpu --num_processes 4 --main_process_port 29500")
    assert cmds["accelerate (config file)"].startswith("accelerate launch --config_file acc.yaml ")
    assert all(c.endswith("trainer_train.py --deepspeed configs/zero3.json") for c in cmds.values())
    with pytest.raises(ValueError, match="positive integer"):
        launch_commands(program, 0)
    text = accelerate_config_yaml(cfg_path, 4)
    assert "mixed_precision" not in text  # Accelerate refuses it next to a deepspeed_config_file
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(path))
    assert loaded.num_processes == 4 and str(loaded.distributed_type).endswith("DEEPSPEED")
    assert loaded.deepspeed_config["deepspeed_config_file"] == str(cfg_path)
    assert loaded.deepspeed_config["zero3_init_flag"] is True  # read from the JSON: stage 3
    assert "zero3_init_flag: false" in accelerate_config_yaml(ROOT / "configs" / "zero2.json", 2)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_trainer_program_runs_under_the_launch_command(work, tmp_path, launcher):
    root, _, model_dir = work
    cfg_path = ROOT / "configs" / "zero2_trainer.json"  # the file notebook 04's commands pass, as it is
    yaml_path = tmp_path / "accelerate.yaml"
    yaml_path.write_text(accelerate_config_yaml(cfg_path, 1))
    args = ["--deepspeed", cfg_path, "--model", model_dir, "--tokenizer", root / "tok", "--data", "local",
            "--seq-len", SEQ, "--steps", 2]
    ranks = run_ranks(PROGRAMS / "trainer_train.py", 1, tmp_path / "out", device="cpu", launcher=launcher,
                      args=args, accelerate_config=yaml_path if launcher == "accelerate" else None)
    report = ranks[0]
    assert report["command"].startswith("deepspeed --num_accelerators 1 " if launcher == "deepspeed" else
                                        "accelerate launch --config_file ")
    assert report["engine"] == "DeepSpeedEngine" and report["world_size"] == 1 and report["train_loss"] > 0
    assert report["train_batch_size"] == 4  # "auto": world size x micro-batch x accumulation
    assert report["filled"] == {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4}


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    out = tmp_path / "integrations.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "integrations.py"), "--size", "gpt2-tiny",
                           "--steps", "4", "--seq-len", "32", "--configs", "zero2", "--out", str(out),
                           "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["driver"] for r in report["rows"]} == {"raw engine", "Trainer", "Accelerate"}
    for row in report["rows"]:
        assert row["runtime"] == report["runtime"] and row["final_loss"] > 0 and row["tokens_per_s"] > 0
    assert report["agreement"]["zero2"]["max_loss_diff"] < 1e-3
    assert out.with_suffix(".md").read_text().startswith("#")


def test_the_step_recorder_times_each_step_for_the_runs_spread():
    """Issue 40: Trainer's and Accelerate's runs carry their step times, so notebook 04 compares them with the raw
    engine by the spread of their steps as train_run's runs are."""
    from helpers.integrations import StepRecorder

    rec = StepRecorder(tokens_per_step=100, untimed_steps=2)
    rec.times = [1.0, 2.0, 3.0, 3.5, 4.5]
    assert rec.step_seconds == [1.0, 0.5, 1.0]
    assert abs(rec.tokens_per_s - 300 / 2.5) < 1e-9
