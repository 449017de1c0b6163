"""Colab's Hub branches offline (issue 21): scripts/local_hub.py lays out a Hugging Face cache as a download leaves it,
and with HF_HUB_OFFLINE=1 the real `load_dataset` / `from_pretrained` calls read it; helpers.hub decides the branch."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers import hub

sys.path.insert(0, str(ROOT / "scripts"))
import local_hub  # noqa: E402


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    info = local_hub.build(home, model_size="gpt2-tiny")
    return home, info


def test_the_cache_is_laid_out_as_a_download_leaves_it(hub_home):
    home, info = hub_home
    repo = home / "hub" / "models--gpt2"
    commit = (repo / "refs" / "main").read_text()
    assert commit == info["model"]["commit"] and len(commit) == 40
    snapshot = repo / "snapshots" / commit
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (snapshot / name).is_symlink(), name  # huggingface_hub links snapshot files to blobs/<sha256>
        assert (snapshot / name).resolve().parent == (repo / "blobs").resolve()
    data = home / "hub" / "datasets--Salesforce--wikitext" / "snapshots" / info["dataset"]["commit"]
    assert (data / "README.md").read_text().count("config_name: wikitext-2-raw-v1") == 1
    assert sorted(p.name for p in (data / "wikitext-2-raw-v1").iterdir()) == [
        "test-00000-of-00001.parquet", "train-00000-of-00001.parquet", "validation-00000-of-00001.parquet"]
    assert info["dataset"]["rows"]["train"] > 5 * info["dataset"]["rows"]["validation"] > 0


def test_the_colab_calls_load_from_it_offline_in_a_fresh_process(hub_home):
    """The notebooks' own calls, in a fresh Python with only the variables local_hub prints: nothing is downloaded
    (offline mode raises on any request)."""
    home, info = hub_home
    code = ("import json, helpers\n"
            "ds = helpers.load_text_dataset('Salesforce/wikitext:wikitext-2-raw-v1')\n"
            "tok = helpers.load_tokenizer('gpt2')\n"
            "model = helpers.load_causal_lm('gpt2')\n"
            "print(json.dumps({'splits': sorted(ds), 'train': len(ds['train']), 'first': ds['train'][0]['text'],\n"
            "  'vocab': len(tok), 'pad': tok.pad_token, 'params': sum(p.numel() for p in model.parameters()),\n"
            "  'branch': helpers.hub_available('gpt2', 'Salesforce/wikitext:wikitext-2-raw-v1')}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(local_hub.environment(home))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["splits"] == ["test", "train", "validation"] and got["train"] == info["dataset"]["rows"]["train"]
    assert got["first"].startswith(" ") and got["first"].endswith("\n")  # WikiText's row shape
    assert got["vocab"] == 8192 and got["pad"] == "<|endoftext|>"
    assert got["params"] == info["model"]["n_params"] and got["branch"] is True


def test_branch_follows_colab_and_the_offline_cache(hub_home, monkeypatch, capsys):
    home, _ = hub_home
    for k, v in local_hub.environment(home).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    assert hub.hub_available("gpt2", "Salesforce/wikitext:wikitext-2-raw-v1")
    assert hub.hub_available(dataset="Salesforce/wikitext")  # any config of it
    assert not hub.hub_available("gpt2-medium") and not hub.hub_available(dataset="Salesforce/wikitext:other")
    assert not hub.hub_available("local") and not hub.hub_available(str(home))  # a folder is not a Hub name
    assert hub.hub_or_local("gpt2", "Salesforce/wikitext:wikitext-2-raw-v1") == (
        "gpt2", "Salesforce/wikitext:wikitext-2-raw-v1")
    assert "Colab's branch: gpt2 and Salesforce/wikitext:wikitext-2-raw-v1" in capsys.readouterr().out
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "nothing-here"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "nothing-here"))
    assert hub.hub_or_local("gpt2", "Salesforce/wikitext:wikitext-2-raw-v1") == ("local", "local")
    out = capsys.readouterr().out
    assert "no Hugging Face Hub here" in out and "Colab's branch" not in out
    # a name the learner chose is kept (its own error will say what is wrong), the defaults become "local"
    assert hub.hub_or_local("my-org/my-model", "Salesforce/wikitext:wikitext-2-raw-v1") == ("my-org/my-model", "local")
    # online and not on Colab: the offline branch, without asking the network
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert not hub.hub_available("gpt2")
    monkeypatch.setenv("COLAB_RELEASE_TAG", "test")
    assert hub.hub_available("gpt2", "Salesforce/wikitext:wikitext-2-raw-v1")


def test_offline_a_cached_ladder_name_has_the_cached_models_shape(hub_home, monkeypatch):
    """What from_pretrained('gpt2') loads offline is the cache's model (here GPT-2's architecture at the tiny rung), so
    the estimate uses its config; without the cache (or online) 'gpt2' is the published 124M architecture."""
    from helpers.models import model_shape

    home, info = hub_home
    for k, v in local_hub.environment(home).items():
        monkeypatch.setenv(k, v)
    assert model_shape("gpt2").n_params == info["model"]["n_params"] < 10e6
    assert model_shape("gpt2-medium").n_params > 300e6  # not in the cache: the ladder
    with pytest.raises(ValueError, match="nor a Hugging Face Hub id"):
        model_shape("not a repo id!")  # refused with the fix, not a crash in the cache lookup
    with pytest.raises(ValueError):
        model_shape("gpt2-xxl")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert 124e6 < model_shape("gpt2").n_params < 125e6
