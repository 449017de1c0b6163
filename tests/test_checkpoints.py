"""ZeRO-3 built through the Hugging Face integration, checkpoint resume and zero_to_fp32 round trips (CPU, fp32)."""
import math
import os

import pytest
import torch
from transformers import AutoConfig

from conftest import interrupt_save_after_config
from helpers.checkpoints import build_zero3_model, consolidate_to_hf, release_zero3, resume_checkpoint, save_checkpoint
from helpers.config import course_config
from helpers.data import load_text_dataset, pack_blocks, train_tokenizer
from helpers.hardware import detect_runtime
from helpers.models import gpt2_config, load_causal_lm, save_model_from_config
from helpers.runtime import DIST_ENV_VARS, setup_single_process, teardown

VOCAB = 512
MB = 4


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    ds = load_text_dataset("local")
    tok = train_tokenizer(ds["train"]["text"], root / "tok", vocab_size=VOCAB)
    blocks = pack_blocks(ds["train"].select(range(300)), tok, 32)
    # no dropout: a resumed run must repeat the straight run exactly (DeepSpeed does not checkpoint torch's RNG)
    model_dir = save_model_from_config(root / "model", "gpt2-tiny", vocab_size=VOCAB, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)
    return root, blocks, model_dir


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in DIST_ENV_VARS:
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)
    setup_single_process()
    yield
    release_zero3()


def ids_for(blocks, step):
    return blocks[step * MB:(step + 1) * MB]["input_ids"]


def engine_for(model, cfg):
    import deepspeed

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=cfg)
    engine.train()
    return {"engine": engine, "optimizer": optimizer, "scheduler": scheduler}


def train_steps(engine, blocks, steps):
    losses = []
    for step in steps:
        ids = ids_for(blocks, step)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_zero3_model_built_the_hf_way_starts_at_the_zero0_loss(work):
    _, blocks, _ = work
    rt = detect_runtime()
    config = gpt2_config("gpt2-tiny", vocab_size=VOCAB)
    ids = ids_for(blocks, 0)

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    ns = engine_for(AutoModelForCausalLM.from_config(config), course_config("zero0", rt))
    loss0 = ns["engine"](input_ids=ids, labels=ids).loss.item()
    teardown(ns, "engine", "optimizer", "scheduler")

    cfg3 = course_config("zero3", rt)
    model3, keep_alive = build_zero3_model(cfg3, config=config, seed=0)
    assert all(hasattr(p, "ds_id") for p in model3.parameters()), "built partitioned under zero.Init"
    ns = engine_for(model3, cfg3)
    del model3, keep_alive
    loss3 = ns["engine"](input_ids=ids, labels=ids).loss.item()
    teardown(ns, "engine", "optimizer", "scheduler")
    assert abs(loss0 - math.log(VOCAB)) < 0.3  # a fresh model predicts ~uniformly
    assert abs(loss3 - loss0) < 0.05, (loss0, loss3)


@pytest.mark.slow
def test_resume_continues_the_same_loss_trajectory_and_zero_to_fp32_round_trips(work, tmp_path):
    root, blocks, model_dir = work
    rt = detect_runtime()
    cfg = course_config("zero3", rt, scheduler=None)

    model, keep = build_zero3_model(cfg, model_dir)
    ns = engine_for(model, cfg)
    del model, keep
    straight = train_steps(ns["engine"], blocks, range(6))
    teardown(ns, "engine", "optimizer", "scheduler")
    release_zero3()

    model, keep = build_zero3_model(cfg, model_dir)
    ns = engine_for(model, cfg)
    del model, keep
    first = train_steps(ns["engine"], blocks, range(3))
    save_checkpoint(ns["engine"], tmp_path / "ckpt", tag="step3")
    teardown(ns, "engine", "optimizer", "scheduler")
    release_zero3()

    model, keep = build_zero3_model(cfg, model_dir)
    ns = engine_for(model, cfg)
    del model, keep
    resume_checkpoint(ns["engine"], tmp_path / "ckpt", tag="step3")
    assert ns["engine"].global_steps == 3
    rest = train_steps(ns["engine"], blocks, range(3, 6))
    assert first == pytest.approx(straight[:3], abs=1e-6)
    assert rest == pytest.approx(straight[3:], abs=1e-5), (straight, first + rest)

    # zero_to_fp32: consolidate, load as an ordinary Hugging Face model, same logits as the engine
    save_checkpoint(ns["engine"], tmp_path / "final")
    ids = ids_for(blocks, 7)
    ns["engine"].eval()
    with torch.no_grad():
        engine_logits = ns["engine"](input_ids=ids).logits.float()
    teardown(ns, "engine", "optimizer", "scheduler")
    out = consolidate_to_hf(tmp_path / "final", AutoConfig.from_pretrained(model_dir), tmp_path / "hf")
    assert os.path.exists(out / "config.json")
    reloaded = load_causal_lm(str(out)).eval()
    with torch.no_grad():
        hf_logits = reloaded(input_ids=ids).logits
    assert torch.allclose(hf_logits, engine_logits, atol=1e-5), (hf_logits - engine_logits).abs().max()


def test_build_zero3_model_refuses_other_stages(work):
    with pytest.raises(ValueError, match="needs a ZeRO stage 3 config"):
        build_zero3_model(course_config("zero2"), "unused")


class FakeEngine:
    """Writes what engine.save_checkpoint writes (the tag folder), optionally interrupted half-way."""

    global_rank = 0

    def __init__(self, steps, interrupt=False):
        self.global_steps, self.interrupt = steps, interrupt

    def save_checkpoint(self, save_dir, tag, save_latest=True):
        assert save_latest is False  # 'latest' is written by the helper, after the folder is complete
        folder = os.path.join(save_dir, tag)
        os.makedirs(folder)
        open(os.path.join(folder, "mp_rank_00_model_states.pt"), "wb").write(b"model")
        if self.interrupt:
            raise KeyboardInterrupt
        open(os.path.join(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "wb").write(b"optimizer")

    def load_checkpoint(self, directory, tag=None):
        return None, None


def test_an_interrupted_checkpoint_save_keeps_the_previous_one_and_latest(tmp_path):
    save_checkpoint(FakeEngine(1), tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step1"
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(FakeEngine(2, interrupt=True), tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step1" and not (tmp_path / "global_step2").exists()
    assert len(os.listdir(tmp_path / "global_step1")) == 2
    with pytest.raises(FileNotFoundError, match="its save was interrupted.*Fix: save it again"):
        resume_checkpoint(FakeEngine(2), tmp_path, tag="global_step2")
    save_checkpoint(FakeEngine(2), tmp_path)  # the next save replaces the partial folder
    assert sorted(os.listdir(tmp_path)) == ["global_step1", "global_step2", "latest"]
    assert (tmp_path / "latest").read_text() == "global_step2" and len(os.listdir(tmp_path / "global_step2")) == 2


class FakeStage3Engine(FakeEngine):
    def zero_optimization_stage(self):
        return 3


def test_a_save_removes_every_interrupted_save_and_refuses_a_tag_that_is_a_path(tmp_path):
    """Issue 41 item 4: after a kill during the save of B, B.partial stayed when the next save was tag C; a tag with
    '/' raised FileNotFoundError and left step0.partial."""
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(FakeEngine(1, interrupt=True), tmp_path, tag="B")
    save_checkpoint(FakeEngine(2), tmp_path, tag="C")
    assert sorted(os.listdir(tmp_path)) == ["C", "latest"]
    with pytest.raises(ValueError, match=r"tag 'run/step0': a tag names one folder.*Fix: tag='run_step0'") as err:
        save_checkpoint(FakeEngine(3), tmp_path, tag="run/step0")
    assert sorted(os.listdir(tmp_path)) == ["C", "latest"]  # nothing written
    save_checkpoint(FakeEngine(3), tmp_path, tag=str(err.value).split("tag=")[-1].strip("'"))  # the fix passes
    assert (tmp_path / "latest").read_text() == "run_step0"


def test_resume_names_the_saved_tags_and_refuses_another_zero_stage_before_deepspeed_asserts(tmp_path):
    save_checkpoint(FakeEngine(1), tmp_path, tag="step1")
    with pytest.raises(FileNotFoundError, match=r"no DeepSpeed checkpoint 'step9'.*Fix: tag='step1' \(saved here: "
                                                r"step1\)"):
        resume_checkpoint(FakeEngine(1), tmp_path, tag="step9")
    with pytest.raises(ValueError, match=r"saved by a ZeRO stage 0-2 engine and this engine is ZeRO stage 3.*Fix: "
                                         r"resume with the config it was saved with"):
        resume_checkpoint(FakeStage3Engine(1), tmp_path)  # tag None: 'latest' -> step1
    with pytest.raises(FileNotFoundError, match="no DeepSpeed checkpoint found"):  # the stage matches: DeepSpeed's turn
        resume_checkpoint(FakeEngine(1), tmp_path)


def test_consolidate_to_hf_writes_whole_models_and_refuses_a_folder_of_other_files(tmp_path, monkeypatch):
    import deepspeed.utils.zero_to_fp32 as z2f
    from transformers import AutoModelForCausalLM, PreTrainedModel

    config = gpt2_config("gpt2-tiny", vocab_size=VOCAB)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    monkeypatch.setattr(z2f, "get_fp32_state_dict_from_zero_checkpoint", lambda *a, **k: dict(state))
    out = consolidate_to_hf(tmp_path / "ckpt", config, tmp_path / "hf")
    reloaded = load_causal_lm(str(out))
    assert torch.equal(reloaded.transformer.wte.weight, state["transformer.wte.weight"])

    real = interrupt_save_after_config(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        consolidate_to_hf(tmp_path / "ckpt", config, tmp_path / "hf")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # the previous model, untouched
    assert torch.equal(load_causal_lm(str(out)).transformer.wte.weight, state["transformer.wte.weight"])

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    monkeypatch.setattr(z2f, "get_fp32_state_dict_from_zero_checkpoint",
                        lambda *a, **k: pytest.fail("the checkpoint was read before the folder was checked"))
    with pytest.raises(FileExistsError, match=r"not part of a saved model \(todo.txt\).*Fix: pass a new folder"):
        consolidate_to_hf(tmp_path / "ckpt", config, tmp_path / "notes")
