"""Files and folders the helpers write appear whole or not at all; half-written ones are rebuilt (issue 13)."""
import json
import os
import pathlib

import pytest
import torch
from transformers import PreTrainedModel

from conftest import interrupt_save_after_config
from helpers.atomic import check_replaceable, needs_writing, write_atomically
from helpers.models import load_causal_lm, model_folder_problem, save_model_from_config

TINY = dict(size="gpt2-tiny", vocab_size=256)


def siblings(path):
    return sorted(p.name for p in path.parent.iterdir())


def test_write_atomically_leaves_nothing_when_interrupted(tmp_path):
    target = tmp_path / "figures.json"

    def interrupted(tmp):
        tmp.write_text('{"half": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, interrupted)
    assert siblings(target) == []
    write_atomically(target, lambda tmp: tmp.write_text('{"a": 1}'))
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, interrupted)
    assert json.loads(target.read_text()) == {"a": 1} and siblings(target) == ["figures.json"]


def test_a_folder_replaces_the_old_one_only_when_complete(tmp_path):
    target = tmp_path / "out"
    write_atomically(target, lambda tmp: (tmp.mkdir(), (tmp / "old.txt").write_text("old")))

    def interrupted(tmp):
        tmp.mkdir()
        (tmp / "new.txt").write_text("new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, interrupted)
    assert sorted(os.listdir(target)) == ["old.txt"] and siblings(target) == ["out"]
    write_atomically(target, lambda tmp: (tmp.mkdir(), (tmp / "new.txt").write_text("new")))
    assert sorted(os.listdir(target)) == ["new.txt"] and siblings(target) == ["out"]


def test_leftovers_of_a_killed_writer_are_removed_by_the_next_write(tmp_path):
    dead = tmp_path / ".out.partial-999999999-abcdef01"  # no such process
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    alive = tmp_path / f".out.partial-{os.getppid()}-abcdef01"  # a writer still running: left alone
    alive.mkdir()
    write_atomically(tmp_path / "out", lambda tmp: tmp.mkdir())
    assert siblings(tmp_path / "out") == sorted([alive.name, "out"])


def test_an_interrupted_model_save_leaves_nothing_and_the_next_call_builds_it(tmp_path, monkeypatch):
    path = tmp_path / "model"
    real = interrupt_save_after_config(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_model_from_config(path, **TINY)
    assert not path.exists() and siblings(path) == []
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real)
    save_model_from_config(path, **TINY)
    assert model_folder_problem(path) is None
    assert load_causal_lm(str(path)).config.vocab_size == 256


def test_a_model_folder_with_only_config_json_is_rebuilt(tmp_path, capsys):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # what the old, non-atomic save left
    with pytest.raises(OSError, match="no file named model.safetensors"):
        load_causal_lm(str(path))
    save_model_from_config(path, **TINY)
    assert "incomplete saved model (config.json without model.safetensors" in capsys.readouterr().out
    assert load_causal_lm(str(path)).config.vocab_size == 256


def test_truncated_weights_are_rebuilt_and_a_complete_folder_is_reused(tmp_path, capsys):
    path = tmp_path / "model"
    save_model_from_config(path, **TINY)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert "cut short" in model_folder_problem(path)
    save_model_from_config(path, **TINY)
    assert "rebuilding it" in capsys.readouterr().out and model_folder_problem(path) is None
    before = weights.stat().st_mtime_ns
    save_model_from_config(path, **TINY)
    assert weights.stat().st_mtime_ns == before and capsys.readouterr().out == ""


def test_a_folder_with_other_files_is_not_replaced(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds files that are not part of a saved model \(notes.txt\).*"
                                              r"Fix: pass a new folder, e.g. '.*work-model'") as err:
        save_model_from_config(work, **TINY)
    assert (work / "notes.txt").read_text() == "mine"
    fix = str(err.value).split("e.g. ")[1].strip("'.")
    save_model_from_config(fix, **TINY)
    assert model_folder_problem(fix) is None
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match="is a file, not a folder for a saved model"):
        check_replaceable(a_file, ["*"], "model")


def test_needs_writing_tells_absent_empty_complete_and_half_written_apart(tmp_path, capsys):
    problem = lambda p: None if (p / "done").exists() else "no done"  # noqa: E731
    folder = tmp_path / "x"
    assert needs_writing(folder, problem, ["*"], "thing")
    folder.mkdir()
    assert needs_writing(folder, problem, ["*"], "thing") and capsys.readouterr().out == ""
    (folder / "part").write_text("")
    assert needs_writing(folder, problem, ["*"], "thing") and "incomplete saved thing (no done" in capsys.readouterr().out
    (folder / "done").write_text("")
    assert not needs_writing(folder, problem, ["*"], "thing")


def test_course_configs_and_figures_are_written_whole(tmp_path, monkeypatch):
    from helpers import records
    from helpers.config import write_course_configs

    written = write_course_configs(tmp_path / "configs")
    assert all(json.loads(p.read_text()) for p in written) and siblings(written[0]) == sorted(p.name for p in written)
    target = tmp_path / "figures" / "figures.json"
    monkeypatch.setenv(records.FIGURES_ENV, str(target))
    records.record_figure("a", 1)
    real_write = pathlib.Path.write_text

    def half_write(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(pathlib.Path, "write_text", half_write)
    with pytest.raises(KeyboardInterrupt):
        records.record_figure("b", 2)
    monkeypatch.setattr(pathlib.Path, "write_text", real_write)
    assert json.loads(target.read_text()) == {"a": 1} and siblings(target) == ["figures.json"]


@pytest.mark.slow
def test_torch_save_of_corpus_blocks_is_atomic(tmp_path, monkeypatch):
    from helpers import scale_out

    def half_save(obj, f):
        open(f, "wb").write(b"PK\x03\x04 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", half_save)
    with pytest.raises(KeyboardInterrupt):
        scale_out.corpus_blocks(tmp_path, 256, 16, texts=50)
    assert not list(tmp_path.glob("blocks-*"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
