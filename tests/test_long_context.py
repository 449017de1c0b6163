"""The activation estimate of notebook 06 (helpers.long_context) against what autograd really keeps for backward,
for each technique, on a small Llama built from its config (CPU, bf16 and fp32), and the tiled paths' numbers."""
import os

import pytest
import torch

import helpers
from helpers.config import ConfigSettings
from helpers.long_context import estimate_saved_activations, long_context_shape, saved_activation_bytes

CONFIG = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=4000, max_position_embeddings=4096, attn_implementation="sdpa")


def _model(dtype, checkpointing=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


@pytest.mark.parametrize("dtype, e", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("technique", ["plain", "checkpointing", "tiled_mlp", "tiled_logits"])
def test_the_estimate_is_what_autograd_keeps(dtype, e, technique):
    from transformers import LlamaConfig

    shape = long_context_shape(LlamaConfig(**CONFIG))
    model = _model(dtype, checkpointing=technique == "checkpointing")
    for seq_len in (256, 1024):
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq_len))
        if technique == "tiled_logits":
            def forward():
                return helpers.long_context.tiled_causal_lm_loss(model, ids, tile_tokens=128)
        else:
            def forward():
                return model(input_ids=ids, labels=ids).loss
        with helpers.long_context.tiled_mlp() if technique == "tiled_mlp" else torch.enable_grad():
            kept, loss = saved_activation_bytes(forward, exclude=model.parameters())
            loss.backward()
        est = estimate_saved_activations(shape, seq_len, precision_bytes=e,
                                         **({} if technique == "plain" else {technique: True}))
        assert est.gpu_total == pytest.approx(kept, rel=0.005), (technique, seq_len, est.table())


def test_the_tiled_paths_give_the_models_own_loss_and_gradients():
    model = _model(torch.float32)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 512))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with helpers.long_context.tiled_mlp(tile_tokens=100):  # 6 slices, the last one short
        tiled = helpers.long_context.tiled_causal_lm_loss(model, ids, tile_tokens=73)  # 511 positions = 7 equal slices
    tiled.backward()
    assert tiled.item() == pytest.approx(loss.item(), rel=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n
    from transformers.models.llama import modeling_llama
    assert modeling_llama.LlamaMLP.forward.__qualname__ == "LlamaMLP.forward"  # restored on leaving


def test_checkpointing_and_its_offload_move_the_same_bytes_and_the_vocabulary_dominates_the_head():
    from transformers import LlamaConfig

    shape = long_context_shape(LlamaConfig(**{**CONFIG, "vocab_size": 32000, "hidden_size": 1024,
                                             "intermediate_size": 2816, "num_hidden_layers": 16,
                                             "num_attention_heads": 16, "num_key_value_heads": 4}))
    ckpt = estimate_saved_activations(shape, 8192, checkpointing=True)
    off = estimate_saved_activations(shape, 8192, checkpointing=True, offload_checkpoints=True)
    assert off.cpu_total == ckpt.gpu["layer inputs (checkpoints)"] and off.gpu_total == ckpt.gpu_total - off.cpu_total
    assert ckpt.gpu["loss: log-softmax (fp32)"] > ckpt.gpu["layer inputs (checkpoints)"]  # 4 x 32000 > 16 x 2 x 1024
    tiled = estimate_saved_activations(shape, 8192, checkpointing=True, tiled_logits=True)
    assert "loss: log-softmax (fp32)" not in tiled.gpu and tiled.gpu_total < ckpt.gpu_total / 3
    with pytest.raises(ValueError, match="pass checkpointing=True"):
        estimate_saved_activations(shape, 8192, offload_checkpoints=True)
    with pytest.raises(ValueError, match="seq_len must be a positive whole number"):
        estimate_saved_activations(shape, 0)


def test_the_peak_adds_the_larger_backward_transient_and_each_rung_needs_less():
    shape = long_context_shape(helpers.long_context.long_context_config(8192))
    peaks = {name: helpers.long_context.estimate_activation_peak(shape, 32768, **flags) for name, flags in helpers.long_context.TECHNIQUES.items()}
    for name, pk in peaks.items():
        assert pk.gpu_peak == pk.saved.gpu_total + max(pk.transients.values()), name
    gpu = [pk.gpu_peak for pk in peaks.values()]
    assert gpu == sorted(gpu, reverse=True) and gpu[0] > 8 * gpu[-1]  # every rung lowers the peak
    assert peaks["plain"].peak_transient.startswith("loss backward")  # the vocabulary's fp32 gradients
    tiled = helpers.long_context.estimate_activation_peak(shape, 32768, checkpointing=True, tiled_logits=True, logits_tile_tokens=512)
    assert tiled.transients["one logits tile"] == 12 * 8192 * 512  # one tile, whatever the length
    off = peaks["+ checkpoints on CPU"]
    layer_input = 2 * 1024 * 32768
    assert off.saved.cpu["layer inputs (checkpoints)"] == 15 * layer_input  # the newest is never offloaded
    assert off.saved.gpu["last 3 layer inputs (kept on GPU)"] == 3 * layer_input  # DeepSpeed keeps 1 + 2 in flight
    assert off.cpu_pinned_bytes == 15 * 2**26  # 64 MiB each, already a power of two
    odd = helpers.long_context.estimate_activation_peak(shape, 30000, **helpers.long_context.TECHNIQUES["+ checkpoints on CPU"])
    assert odd.cpu_pinned_bytes == 15 * 2**26 > odd.saved.cpu_total  # rounded up by torch's host allocator


def test_the_longest_fitting_length_is_the_last_multiple_that_fits():
    assert helpers.long_context.longest_fitting_seq_len(lambda s: 1000 + 3 * s <= 100_000, multiple=256) == 32_768
    assert helpers.long_context.longest_fitting_seq_len(lambda s: s <= 10**9, upper=1 << 20) == 1 << 20
    assert helpers.long_context.longest_fitting_seq_len(lambda s: False) == 0


def test_the_model_config_is_built_offline_and_bad_shapes_say_the_fix():
    cfg = helpers.long_context.long_context_config(8192)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (1024, 16, 16, 8192)
    n = 2 * 8192 * 1024 + 16 * (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) + 1024
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == n  # ~222M
    for hidden, heads, kv_heads in ((1000, 16, 3), (1020, 12, 4), (1024, 16, 5)):  # head size 62.5 / 85 / 64
        with pytest.raises(ValueError, match="multiple of 8 x heads") as err:
            helpers.long_context.long_context_config(8192, hidden=hidden, heads=heads, kv_heads=kv_heads)
        fix = str(err.value).split("e.g. ")[1]
        hidden, kv = (int(x.split("=")[1]) for x in fix.split(", "))
        helpers.long_context.long_context_config(8192, hidden=hidden, heads=heads, kv_heads=kv)  # the suggested fix passes
    with pytest.raises(ValueError, match="vocab must be a positive whole number"):
        helpers.long_context.long_context_config(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU runtime's behaviour (the GPU's: the test below)")
def test_checkpoints_on_cpu_asks_for_checkpointing_and_changes_nothing_on_a_cpu_runtime():
    """On a GPU the layers run DeepSpeed's checkpoint with cpu_checkpointing inside the block (checked on the GPU
    machine: notebook 06, benchmarks/long_context.py); on CPU the block changes nothing, so the numbers are the same."""
    model = _model(torch.float32, checkpointing=True)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 256))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    own = model.model.layers[0]._gradient_checkpointing_func
    with helpers.long_context.checkpoints_on_cpu(model):
        assert model.model.layers[0]._gradient_checkpointing_func is own
        again = model(input_ids=ids, labels=ids).loss
        again.backward()
    assert again.item() == loss.item()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n
    with pytest.raises(ValueError, match="Fix: model.gradient_checkpointing_enable"):
        with helpers.long_context.checkpoints_on_cpu(_model(torch.float32)):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked checkpoints need a GPU (the GPU machine runs it)")
def test_checkpoints_on_cpu_leave_no_page_locked_buffer_behind_between_lengths():
    """DeepSpeed 0.19.8's offload engine pools its page-locked buffers by exact shape across steps and never empties
    that pool; the block drops the engine on leaving. A step at another length whose checkpoints round to the same
    block size then reuses the first one's blocks from torch's host allocator instead of locking a second set (in the
    benchmark's search, 245,760 then 262,144 tokens: 8 GB twice, killed at the RAM limit)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    from helpers.memory import pinned_bytes

    model = _model(torch.float16, checkpointing=True).cuda()
    layers = len(model.model.layers)

    def step(n):
        ids = torch.randint(0, CONFIG["vocab_size"], (1, n), device="cuda")
        with helpers.long_context.checkpoints_on_cpu(model):
            model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        assert ds_checkpointing._cpu_offload_engine is None, "DeepSpeed's offload engine (and its pool) outlived the block"
        stats = torch.cuda.host_memory_stats()
        assert "allocated_bytes.current" in stats, sorted(stats)
        return stats["allocated_bytes.current"]  # page-locked blocks torch's host allocator owns (in use + cached)

    block = pinned_bytes(1280 * CONFIG["hidden_size"] * 2)  # one fp16 layer input, rounded as torch's allocator does
    assert block == pinned_bytes(1536 * CONFIG["hidden_size"] * 2)
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    owned = step(1280)
    assert owned - before >= (layers - 1) * block, (before, owned)  # the checkpoints did go to page-locked RAM
    owned_after = step(1536)
    assert owned_after - owned < block, f"a second set of page-locked buffers: {owned:,} -> {owned_after:,} bytes"


def test_grouped_query_attention_without_a_fused_kernel_is_refused_with_a_fix_that_passes(monkeypatch):
    """On a T4, PyTorch before 2.15 runs grouped-query attention only in its math kernel (sequence x sequence scores):
    the check refuses such a model before anything is built, and its fix passes the same check. PyTorch's own answer
    needs a GPU, so a T4's is stood in for here: fused ("efficient") only when every query head has its own K/V."""
    from helpers import long_context

    def t4(config, dtype):
        return "efficient" if config.num_key_value_heads == config.num_attention_heads else "math"

    monkeypatch.setattr(long_context, "attention_kernel", t4)
    gqa = helpers.long_context.long_context_config(8192, heads=16, kv_heads=4)
    with pytest.raises(ValueError, match="math kernel") as err:
        helpers.require_fused_attention(gqa, torch.float16)
    message = str(err.value)
    assert "Fix: kv_heads=16" in message and "KV_HEADS = 16" in message and "GiB at 16,384 tokens" in message
    fixed = helpers.long_context.long_context_config(8192, heads=16, kv_heads=16)
    assert helpers.require_fused_attention(fixed, torch.float16) == "efficient"
    with pytest.raises(ValueError, match="math kernel"):  # the engine builder asks before building anything
        helpers.long_context.build_long_context_engine(gqa, {"train_batch_size": 1, "fp16": {"enabled": True}}, "plain")


def test_an_out_of_memory_message_gives_the_request_and_the_allocator_switch_needs_a_gpu():
    from helpers.long_context import _tried_bytes

    msg = "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 139.81 GiB"
    assert _tried_bytes(msg) == int(2.5 * 2**30) and _tried_bytes("Tried to allocate 20.00 MiB.") == 20 * 2**20
    assert _tried_bytes("CUDA error: an illegal memory access") == 0
    assert helpers.use_expandable_segments() is torch.cuda.is_available()


def test_attention_kernel_on_cpu_is_cpu():
    assert helpers.long_context.attention_kernel(helpers.long_context.long_context_config(512, hidden=64, heads=4), torch.float32) == "cpu"


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import ROOT
    from helpers.runtime import DIST_ENV_VARS

    out = tmp_path / "lc.json"
    proc = subprocess.run([sys.executable, "benchmarks/long_context.py", "--hidden", "64", "--intermediate", "176",
                           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--lengths", "256",
                           "--max-seq-len", "512", "--rungs", "plain", "+ checkpoints on CPU", "--parallel", "2", "--out", str(out),
                           "--work-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["rung"] for r in report["rows"]] == ["plain", "+ checkpoints on CPU"]
    for row in report["rows"]:
        (attempt,) = row["attempts"]
        assert attempt["ok"] and attempt["losses"][-1] < attempt["losses"][0] and row["longest"] == 256
        assert attempt["estimate"]["gpu_peak"] > 0 and attempt["peak_rss"] > 0
    assert "| plain | 256 |" in out.with_suffix(".md").read_text()
    assert report["settings"]["parallel"] == 2 and "side by side" in report["how"]  # rows in rung order all the same
    assert [r["attention_kernel"] for r in report["rows"]] == ["cpu", "cpu"]
    assert report["settings"]["allocator"] == "expandable" and "expandable segments" in report["how"]
    # a second run of one rung keeps the other rung's row from the first report, saying when it was measured
    again = tmp_path / "lc2.json"
    proc = subprocess.run([sys.executable, "benchmarks/long_context.py", "--hidden", "64", "--intermediate", "176",
                           "--layers", "2", "--heads", "4", "--lengths", "256", "--max-seq-len", "512", "--rungs",
                           "plain", "--keep-rows-from", str(out), "--out", str(again), "--work-dir",
                           str(tmp_path / "second")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(again.read_text())
    assert [r["rung"] for r in merged["rows"]] == ["plain", "+ checkpoints on CPU"]
    assert merged["rows"][1]["attempts"] == report["rows"][1]["attempts"]  # kept as measured
    assert merged["rows"][0]["measured"].endswith("1 rung(s) side by side")
    assert merged["rows"][1]["measured"].endswith("2 rung(s) side by side")
    # --resume-from the first run's folder: the search goes on from its lengths (256 trained: 2048 is tried), the
    # other rung's row comes from its lines, every estimate is computed again with a RAM base that a step measured
    resumed = tmp_path / "lc3.json"
    proc = subprocess.run([sys.executable, "benchmarks/long_context.py", "--hidden", "64", "--intermediate", "176",
                           "--layers", "2", "--heads", "4", "--kv-heads", "2", "--max-seq-len", "2048", "--rungs",
                           "plain", "--resume-from", str(tmp_path), "--out", str(resumed), "--work-dir",
                           str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS})
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, offloaded = json.loads(resumed.read_text())["rows"]
    assert [a["seq_len"] for a in plain["attempts"]] == [256, 2048] and plain["longest"] == 2048
    assert plain["attempts"][0]["losses"] == report["rows"][0]["attempts"][0]["losses"]  # kept as measured
    assert plain["measured"].count(";") == 1 and plain["measured"].endswith("1 rung(s) side by side")
    assert [a["seq_len"] for a in offloaded["attempts"]] == [256]
    base = plain["attempts"][1]["estimate"]["ram_base"]
    assert base > 0 and plain["attempts"][0]["estimate"]["ram_base"] == base  # one estimate for old and new
    # the report of both runs without running anything (as after GPU calls that each ran some rungs)
    only = tmp_path / "lc4.json"
    proc = subprocess.run([sys.executable, "benchmarks/long_context.py", "--report-only", "--hidden", "64",
                           "--intermediate", "176", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--resume-from",
                           str(tmp_path), str(tmp_path / "again"), "--out", str(only), "--work-dir",
                           str(tmp_path / "only")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = json.loads(only.read_text())
    assert [[a["seq_len"] for a in r["attempts"]] for r in both["rows"]] == [[256, 2048], [256]]
    assert both["runtime"] == report["runtime"] and both["settings"]["parallel"] == 1
    assert not (tmp_path / "only" / "run.json").exists()  # nothing ran: nothing to resume from there
    refused = subprocess.run([sys.executable, "benchmarks/long_context.py", "--hidden", "32", "--resume-from",
                              str(tmp_path), "--work-dir", str(tmp_path / "refused")], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode != 0 and "Fix: run with the earlier settings" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "refused").exists()  # refused before the tokenizer and the token stream were built


def test_benchmark_rows_keep_a_lengths_newest_result_and_only_the_last_processs_end():
    """A length measured again by a later run (--resume-from with --lengths) replaces the earlier result, and a RAM
    kill of an earlier process is not the row's end once a later process ran (2026-12-04: 262,144 tokens, killed at
    the RAM limit after 245,760 in one process, then out of GPU memory in step 2 in a fresh one)."""
    from conftest import ROOT, load_script

    bench = load_script(ROOT / "benchmarks" / "long_context.py", "long_context_bench")
    est = {"gpu_peak": 1, "ram": 1}
    trained = {"kind": "attempt", "seq_len": 245760, "ok": True, "error": None, "peak_gpu_allocated": 1,
               "peak_rss": 1, "tokens_per_s": 1.0, "estimate": est}
    earlier = [{"kind": "start", "base_rss": 1}, trained, {"kind": "trying", "seq_len": 262144, "estimate": est},
               {"kind": "ended", "killed": "killed at the RAM limit (1 OOM kill(s))", "timed_out": False}]
    row = bench.summarize("r", earlier)
    assert (row["first_failing"], row["killed"]) == (262144, "killed at the RAM limit (1 OOM kill(s))")
    again = {"kind": "attempt", "seq_len": 262144, "ok": False, "error": "out of GPU memory", "estimate": est}
    row = bench.summarize("r", earlier + [{"kind": "start", "base_rss": 1}, {"kind": "trying", "seq_len": 262144},
                                          again])
    assert [a["seq_len"] for a in row["attempts"]] == [245760, 262144]
    assert (row["longest"], row["first_failing_error"], row["killed"]) == (245760, "out of GPU memory", None)


@pytest.mark.slow
def test_benchmark_refuses_more_rungs_side_by_side_than_cores_with_a_fix_that_fits(tmp_path):
    import re
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "benchmarks/long_context.py", "--parallel", "999", "--work-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Fix: --parallel" in proc.stderr, proc.stderr[-2000:]
    fits = int(re.search(r"Fix: --parallel (\d+)", proc.stderr).group(1))
    assert 1 <= fits <= len(os.sched_getaffinity(0))  # one core per rung without --emulate
    assert not any(tmp_path.iterdir())  # refused before the tokenizer and the token stream were built


@pytest.mark.slow
@pytest.mark.parametrize("vocab, hidden", [(4000, 128), (256, 256)])  # the loss dominates; a layer does
def test_the_peak_estimate_holds_on_cpu_for_every_technique(vocab, hidden):
    """Measured with torch's profiler memory timeline (every host allocation). The transients were calibrated on the
    GPU (the probe of 2026-12-03); CPU kernels differ a little (a layer's backward here needs ~10 % less): 15 %."""
    import contextlib

    from transformers import AutoModelForCausalLM

    cfg = helpers.long_context.long_context_config(vocab, hidden=hidden, intermediate=int(hidden * 2.6875), layers=2, heads=4,
                                      kv_heads=2)
    shape = long_context_shape(cfg)
    for technique, flags in helpers.long_context.TECHNIQUES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        if flags.get("checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        ids = torch.randint(0, vocab, (1, 1024))

        def step():
            with (helpers.long_context.tiled_mlp() if flags.get("tiled_mlp") else contextlib.nullcontext()), \
                 (helpers.long_context.checkpoints_on_cpu(model) if flags.get("offload_checkpoints") else contextlib.nullcontext()):
                loss = (helpers.long_context.tiled_causal_lm_loss(model, ids, 512) if flags.get("tiled_logits")
                        else model(input_ids=ids, labels=ids).loss)
                loss.backward()

        step()  # the parameters' gradients exist from here on (model states, not activations)
        measured = helpers.measured_peak_bytes(step)
        on_gpu = {k: v for k, v in flags.items() if k != "offload_checkpoints"}  # on CPU nothing moves
        est = helpers.long_context.estimate_activation_peak(shape, 1024, logits_tile_tokens=512, **on_gpu)
        assert measured == pytest.approx(est.gpu_peak, rel=0.15), (technique, measured, est.gpu_peak, est.transients)


def test_train_at_length_trains_and_says_what_it_measured():
    from helpers.runtime import setup_single_process

    setup_single_process()
    cfg = helpers.long_context.long_context_config(512, hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2)
    ds = helpers.build_ds_config(2, runtime=helpers.detect_runtime(), micro_batch_size=1,
                                 settings=ConfigSettings(lr=1e-3, scheduler=None))
    engine = helpers.long_context.build_long_context_engine(cfg, ds, "+ tiled MLP")
    tokens = torch.randint(0, 512, (600,))
    r = helpers.long_context.train_at_length(engine, tokens, 512, "+ tiled MLP", logits_tile_tokens=128)
    assert r.ok and r.losses[1] < r.losses[0] and r.engine_usable and r.tokens_per_s > 0 and r.peak_rss > 0
    with pytest.raises(ValueError, match="seq_len <= 600"):
        helpers.long_context.train_at_length(engine, tokens, 1024, "+ tiled MLP")
    with pytest.raises(ValueError, match="technique must be one of"):
        helpers.long_context.train_at_length(engine, tokens, 512, "flash")
    helpers.runtime.destroy_engine(engine)


def test_the_planner_counts_a_llama_models_activations_as_notebook_06_does():
    """One estimate: helpers.plan on a Llama config uses estimate_activation_peak; GPT-2 keeps the GPT formula."""
    cfg = helpers.long_context.long_context_config(8192)
    shape = helpers.model_shape(cfg)
    assert shape.llama == long_context_shape(cfg) and shape.n_positions == cfg.max_position_embeddings
    runtime = helpers.colab_t4_profile()
    for checkpointing in (False, True):
        p = helpers.plan(cfg, 2, micro_batch_size=1, seq_len=16384, checkpointing=checkpointing, runtime=runtime)
        est = helpers.long_context.estimate_activation_peak(shape.llama, 16384, precision_bytes=2, checkpointing=checkpointing)
        assert p.activation_bytes == est.gpu_peak
    assert not helpers.plan(cfg, 2, micro_batch_size=1, seq_len=16384, checkpointing=False, runtime=runtime).report.fits
    assert helpers.plan(cfg, 2, micro_batch_size=1, seq_len=16384, checkpointing=True, runtime=runtime).report.fits
    gpt2 = helpers.model_shape("gpt2")
    p = helpers.plan("gpt2", 2, micro_batch_size=4, seq_len=512, checkpointing=False, runtime=runtime)
    assert gpt2.llama is None and p.activation_bytes == helpers.memory.estimate_activations(
        4, 512, gpt2.hidden, gpt2.n_layers, gpt2.vocab, n_heads=gpt2.n_heads)


def test_token_stream_is_the_corpus_in_one_sequence_repeated_when_short():
    class Tok:
        eos_token_id = 0

        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[len(t)] * 2 for t in texts]}

    rows = {"text": ["ab", "cde"]}

    class Data:
        def __len__(self):
            return 2

        def __getitem__(self, s):
            return {"text": rows["text"][s]}

    assert helpers.data.token_stream(Data(), Tok(), 5).tolist() == [2, 2, 0, 3, 3]
    assert helpers.data.token_stream(Data(), Tok(), 8).tolist() == [2, 2, 0, 3, 3, 0, 2, 2]
    with pytest.raises(ValueError, match="n_tokens must be a positive whole number"):
        helpers.data.token_stream(Data(), Tok(), 0)


def test_the_tiled_loss_scales_the_heads_gradient_as_fp16_loss_scaling_does():
    """DeepSpeed's TiledFusedLogitsLoss takes the head's weight gradient inside forward: under a scaled backward (fp16
    loss scaling multiplies the loss by S) it came out S times too small. With loss_scale=S every gradient matches."""
    model = _model(torch.float32)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 257))
    scale = 256.0
    (model(input_ids=ids, labels=ids).loss * scale).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for loss_scale, head_ratio in ((1.0, 1 / scale), (scale, 1.0)):
        model.zero_grad()
        loss = helpers.long_context.tiled_causal_lm_loss(model, ids, 64, loss_scale=loss_scale)
        (loss * scale).backward()
        assert (model.lm_head.weight.grad.norm() / ref["lm_head.weight"].norm()).item() == pytest.approx(head_ratio,
                                                                                                      rel=1e-4)
        assert torch.allclose(model.model.embed_tokens.weight.grad, ref["model.embed_tokens.weight"], rtol=1e-4,
                              atol=1e-6)
    assert loss.item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)
    with pytest.raises(ValueError, match="loss_scale must be positive"):
        helpers.long_context.tiled_causal_lm_loss(model, ids, 64, loss_scale=0)


def test_zero2_reduces_the_same_gradients_with_the_tiled_paths():
    """TiledFusedLogitsLoss takes the head's gradient inside forward (ZeRO-2's gradient hooks fire then): the engine's
    reduced gradients must still be checkpointing's own."""
    import contextlib

    from deepspeed.utils import safe_get_full_grad

    from helpers.runtime import setup_single_process

    setup_single_process()
    cfg = helpers.long_context.long_context_config(512, hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2)
    ds = helpers.build_ds_config(2, runtime=helpers.detect_runtime(), micro_batch_size=1,
                                 settings=ConfigSettings(lr=1e-3, scheduler=None))
    ids = torch.randint(0, 512, (1, 513))
    grads = {}
    for technique in ("checkpointing", "+ tiled logits", "+ tiled MLP"):
        engine = helpers.long_context.build_long_context_engine(cfg, ds, technique, seed=0)
        flags = helpers.long_context.technique_flags(technique)
        with helpers.long_context.tiled_mlp() if flags.get("tiled_mlp") else contextlib.nullcontext():
            loss = (helpers.long_context.tiled_causal_lm_loss(engine.module, ids, 128) if flags.get("tiled_logits")
                    else engine(input_ids=ids, labels=ids).loss)
            engine.backward(loss)
        grads[technique] = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        helpers.runtime.destroy_engine(engine)
    for technique in ("+ tiled logits", "+ tiled MLP"):
        for name, g in grads[technique].items():
            assert torch.allclose(g, grads["checkpointing"][name], rtol=1e-3, atol=1e-6), (technique, name)


def _notebook_functions(*names: str) -> dict:
    """The functions notebook 06 writes out with DeepSpeed's API in its section 3 (the draft while it exists), defined
    as the notebook defines them, so the page and helpers cannot drift apart."""
    import ast
    import math

    import nbformat
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    from conftest import ROOT

    name = "06_long_context.ipynb"
    path = ROOT / "notebooks" / "drafts" / name
    nb = nbformat.read(path if path.exists() else ROOT / "notebooks" / name, as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "code" and "def tiled_loss(" in c.source)
    defs = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(d.name for d in defs) == sorted(names)
    namespace = {"math": math, "torch": torch, "TiledMLP": TiledMLP, "TiledFusedLogitsLoss": TiledFusedLogitsLoss}
    exec(compile(ast.Module(body=defs, type_ignores=[]), "notebook 06 section 3", "exec"), namespace)
    return namespace


def test_the_notebooks_written_out_tiled_mlp_and_loss_give_the_helpers_loss_and_gradients():
    """Section 3 of notebook 06 writes TiledMLP / TiledFusedLogitsLoss out on the page; helpers.long_context.tiled_mlp and
    helpers.long_context.tiled_causal_lm_loss (the ladder's) must compute the same, fp16 loss scale included."""
    from transformers.models.llama import modeling_llama

    ns = _notebook_functions("tiled_mlp_forward", "tiled_loss")
    ns["LOGITS_TILE"] = 64
    model = _model(torch.float32)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 300))
    results = []
    for page in (False, True):
        model.zero_grad()
        if page:
            original = modeling_llama.LlamaMLP.forward
            modeling_llama.LlamaMLP.forward = ns["tiled_mlp_forward"]
            try:
                loss = ns["tiled_loss"](model, ids, 256.0)
                (loss * 256.0).backward()
            finally:
                modeling_llama.LlamaMLP.forward = original
        else:
            with helpers.long_context.tiled_mlp():
                loss = helpers.long_context.tiled_causal_lm_loss(model, ids, 64, loss_scale=256.0)
                (loss * 256.0).backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (helper_loss, helper_grads), (page_loss, page_grads) = results
    assert page_loss == pytest.approx(helper_loss, rel=1e-6)
    for n, g in helper_grads.items():
        assert torch.allclose(page_grads[n], g, rtol=1e-5, atol=1e-7), n


def test_the_estimate_of_a_long_context_step_prints_rows_that_add_up_to_its_peak():
    """The rows of notebook 06's step estimate are the model states and the larger of the activation peak and the
    optimizer step's temporaries (a short sequence: the temporaries), as notebook 01's estimate prints them."""
    from transformers import LlamaConfig

    from helpers.memory import estimate_peak

    shape = long_context_shape(LlamaConfig(**CONFIG))
    n_params = 2_000_000
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000},
           "fp16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "activation_checkpointing": {"cpu_checkpointing": True}}
    for seq_len in (256, 1 << 16):
        est = helpers.estimate_long_context_run(shape, n_params, cfg, seq_len, "+ checkpoints on CPU")
        rows = est.run_estimate().rows()
        assert sum(b for _, b in rows) == est.gpu_peak
        assert est.gpu_peak == estimate_peak(cfg, n_params, precision="fp16", activation_bytes=est.activation_peak)[0]
        assert rows[-1][0] == ("step temporaries" if est.step_transient > est.activation_peak else "activations")
        assert est.table().splitlines()[-1].split()[-1] == f"{est.gpu_peak / 2**30:.3f}"
    assert {r[0] for r in helpers.estimate_long_context_run(shape, n_params, cfg, 256, "plain").run_estimate().rows()} \
        >= {"params", "grads", "optimizer"}


def test_the_ladders_verdict_names_no_winner_when_several_reach_the_cap():
    tried = (4096, 16384, 65536)
    tie = helpers.ladder_verdict({"plain": 4096, "checkpointing": 65536, "+ tiled logits": 65536}, tried)
    assert "no winner" in tie and "2 techniques" in tie and "longest trained:" not in tie
    # plain trained 4,096 and not 16,384: its own longest is somewhere in between, so the gain is at least 4x, not 16x
    assert "at least 4x plain's longest, between 4,096 and 16,384)" in tie and "16x" not in tie
    one = helpers.ladder_verdict({"plain": 4096, "checkpointing": 16384, "+ tiled logits": 65536}, tried)
    assert one.startswith("longest trained: + tiled logits at 65,536") and "no winner" not in one
    below = helpers.ladder_verdict({"plain": 4096, "checkpointing": 16384, "+ tiled logits": 16384}, tried)
    assert "a tie" in below and "no winner" in below
    assert "nothing ran out of memory" in helpers.ladder_verdict({"plain": 512, "checkpointing": 512}, (256, 512))
    assert helpers.ladder_verdict({"plain": 0, "checkpointing": 0}, tried).startswith("no technique")
    assert "(plain: none, 4,096 did not fit)" in helpers.ladder_verdict({"plain": 0, "checkpointing": 16384}, tried)
    # one length further than plain: no "at least 1x", only where plain's longest lies
    near = helpers.ladder_verdict({"plain": 4096, "checkpointing": 16384}, tried)
    assert "(plain's longest between 4,096 and 16,384)" in near and "at least" not in near, near
    # plain among the longest (another technique failed earlier): no gain over plain to state
    assert helpers.ladder_verdict({"plain": 65536, "checkpointing": 16384}, tried) == \
        "longest trained: plain at 65,536 tokens; the longest length tried"
    with pytest.raises(ValueError, match="empty"):
        helpers.ladder_verdict({}, tried)


def test_a_parameter_count_reads_sensibly_at_every_size():
    assert [helpers.long_context.params_label(n) for n in (363_000, 2_500_000, 222_300_000, 1_300_000_000, 999)] == \
        ["363K", "2.5M", "222M", "1.3B", "999"]


def test_the_configs_activation_checkpointing_block_is_read_by_configure_and_release_sets_the_defaults_back():
    """Notebook 06 section 3: `deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)` reads the config's
    `activation_checkpointing` block (the engine does not); helpers.release_cpu_checkpoints turns cpu_checkpointing
    off again (and is safe when nothing was configured)."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    from helpers.runtime import setup_single_process

    assert helpers.release_cpu_checkpoints() is False
    setup_single_process()
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(verbose=False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True,
                                        "contiguous_memory_optimization": False, "number_checkpoints": None,
                                        "synchronize_checkpoint_boundary": False, "profile": False}}
    with helpers.quiet_deepspeed():
        deepspeed.checkpointing.configure(None, deepspeed_config=cfg)
    assert ds_checkpointing.CPU_CHECKPOINT is True and ds_checkpointing.PARTITION_ACTIVATIONS is False
    helpers.release_cpu_checkpoints()
    assert ds_checkpointing.CPU_CHECKPOINT is False and ds_checkpointing._cpu_offload_engine is None


@pytest.mark.parametrize("args, says", [
    (["--heads", "7"], "the model's shape: hidden (1024) must be a multiple of 8 x heads"),
    (["--lengths", "0", "4096"], "every length must be 1 token or more (got [0]). Fix: drop them, e.g. --lengths 4096"),
    (["--logits-tile", "0"], "--logits-tile 0: must be 1 or more"),
])
def test_the_benchmark_refuses_a_bad_shape_or_length_before_any_rung_and_writes_nothing(args, says, tmp_path):
    """Issue 41 item 6: --heads 7 printed the child's ValueError five times, exited 0 and wrote a report of empty rows
    (over reports/long_context.json by default); --lengths 0 built a 222M engine per rung first."""
    import subprocess
    import sys

    from conftest import ROOT

    out = tmp_path / "lc.json"
    proc = subprocess.run([sys.executable, "benchmarks/long_context.py", *args, "--out", str(out), "--work-dir",
                           str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and says in proc.stderr and not out.exists() and not (tmp_path / "work").exists()
