"""helpers.gpt and helpers.moe (notebook 03): counts exact, loss falls with the aux loss added through train_run
and MoEHooks, routing counts add up, ZeRO-3 refused with DeepSpeed's message, experts split over 2 processes."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from helpers.data import load_text_dataset, pack_blocks, train_tokenizer
from helpers.hardware import detect_runtime
from helpers.gpt import GPTConfig, build_gpt
from helpers.moe import (ZERO3_REFUSAL, MoEHooks, RoutingRecorder, analytic_flops_per_token, capacity_sweep,
                         committed_report_note, count_moe_params, evenness, expert_capacity, measure_flops_per_token,
                         moe_ds_config, moe_param_groups, moe_table, most_even, speed_verdicts, zero3_refusal)
from helpers.runtime import DIST_ENV_VARS, setup_single_process
from helpers.train import MeasureSettings, RunResult, train_run

TINY = GPTConfig(vocab_size=512, seq_len=32, hidden=32, layers=4, heads=2, ffn=128, num_experts=4, k=1)


@pytest.fixture(autouse=True)
def _restore_dist_env(monkeypatch):
    for k in DIST_ENV_VARS:  # restored after each test: notebooks run later must get no stale port
        monkeypatch.setenv(k, "0")
        monkeypatch.delenv(k)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe")
    ds = load_text_dataset("local")
    texts = ds["train"].select(range(400))
    tok = train_tokenizer(texts["text"], work / "tok", vocab_size=512)
    return pack_blocks(texts, tok, 32), pack_blocks(ds["validation"], tok, 32, max_blocks=16), len(tok)


def test_param_counts_are_exact():
    h, f, e = TINY.hidden, TINY.ffn, TINY.num_experts
    dense = count_moe_params(build_gpt(TINY.dense_twin()))
    assert dense.total == dense.active == dense.local == dense.shared
    for k in (1, 2):
        cfg = TINY.replace(k=k)
        model = build_gpt(cfg)
        c = count_moe_params(model)
        n_moe = len(cfg.moe_layers)
        assert cfg.moe_layers == (1, 3)
        assert c.total == sum(p.numel() for p in model.parameters())
        assert c.per_expert == 2 * h * (f // k)
        assert c.experts == n_moe * e * c.per_expert
        assert c.gate == n_moe * h * e
        assert c.active == c.shared + n_moe * k * c.per_expert
        assert c.active - c.gate == dense.total  # equal active weights: the dense twin
        assert c.total - dense.total == c.gate + n_moe * (e - k) * c.per_expert


def test_measured_flops_match_the_shape_count():
    ids = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    tokens = ids.numel()
    for cfg in (TINY.dense_twin(), TINY, TINY.replace(k=2), TINY.replace(capacity_factor=0.5)):
        measured = measure_flops_per_token(build_gpt(cfg), ids)
        # top-2 gating adds two tiny einsums (2 x 2 x experts FLOPs per token and MoE layer)
        extra = 4 * cfg.num_experts * len(cfg.moe_layers) if cfg.k == 2 else 0
        assert measured == analytic_flops_per_token(cfg, tokens) + extra
    assert analytic_flops_per_token(TINY) == analytic_flops_per_token(TINY.dense_twin()) + \
        2 * TINY.hidden * TINY.num_experts * 2
    assert expert_capacity(TINY, 64) == math.ceil(64 / 4 * 1.25) == 20
    assert expert_capacity(TINY.replace(k=2), 64) == 40
    assert expert_capacity(TINY, 4) == TINY.min_capacity


def test_bad_shapes_say_the_fix():
    with pytest.raises(ValueError, match="divisible by k"):
        TINY.replace(k=2, ffn=129).check()
    with pytest.raises(ValueError, match="ep_size"):
        TINY.replace(ep_size=3).check()
    with pytest.raises(ValueError, match="Fix"):
        TINY.replace(k=5).check()
    with pytest.raises(RuntimeError, match="init_distributed"):
        build_gpt(TINY.replace(ep_size=2))


def test_experts_start_different_and_param_groups_split_them():
    model = build_gpt(TINY)
    experts = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts
    assert not torch.equal(experts[0].up.weight, experts[1].up.weight)
    assert torch.equal(build_gpt(TINY).blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts[1].up.weight,
                       experts[1].up.weight)  # same seed, same model
    groups = moe_param_groups(model)
    moe = [g for g in groups if g.get("moe")]
    assert len(moe) == 1 and moe[0]["name"] == "ep_size_1"
    expert_ids = {id(p) for m in (1, 3) for p in model.blocks[m].mlp.deepspeed_moe.experts.parameters()}
    assert {id(p) for p in moe[0]["params"]} == expert_ids
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert len(moe_param_groups(build_gpt(TINY.dense_twin()))) == 1


def test_recorder_counts_add_up_and_drop_above_capacity():
    for k, cf in ((1, 0.5), (2, 0.5), (1, 8.0)):
        cfg = TINY.replace(k=k, capacity_factor=cf)
        model = build_gpt(cfg, seed=1)
        ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
        tokens = ids.numel()
        with RoutingRecorder(model) as rec:
            for _ in range(3):
                model(ids)
                rec.end_step()
        s = rec.summary()
        cap = expert_capacity(cfg, tokens)
        assert len(rec.history()["kept"]) == 3
        assert s.tokens == [3 * tokens] * 2
        for layer in range(2):
            assert sum(s.demand[layer]) == k * 3 * tokens  # every token asks for k experts
            assert sum(s.load[layer]) + s.dropped_routes[layer] == k * 3 * tokens
            for step in rec.history()["kept"]:
                assert max(step[layer]) <= cap  # no expert takes more than its capacity
        if k == 1:  # top-1: an expert keeps min(asked, capacity) routes per step
            for kept, asked in zip(rec.history()["kept"], rec.history()["demand"]):
                assert kept == [[min(a, cap) for a in row] for row in asked]
            assert s.tokens_lost == s.dropped_routes
        if cf == 8.0:
            assert s.dropped_fraction == 0 and s.load == s.demand
        else:
            assert s.dropped_fraction > 0


def moe_run(name, cfg, train, rt, steps, mb, **kwargs):
    """One MoE run as notebook 03 makes it: train_run with the MoE hooks, the model from build_gpt."""
    probe = kwargs.pop("probe", None)
    return train_run(name, lambda: build_gpt(cfg, seed=0), train, runtime=rt, steps=steps,
                     ds_config=moe_ds_config(rt, micro_batch=mb, lr=3e-3, steps=steps),
                     measure=MeasureSettings(progress=False, hooks=MoEHooks(cfg, probe=probe), **kwargs))


@pytest.mark.slow
def test_moe_trains_under_zero2_with_the_aux_loss_added(blocks):
    train, val, vocab = blocks
    rt = detect_runtime()
    cfg = TINY.replace(vocab_size=vocab, k=2, aux_loss_coef=0.1)
    steps, mb = 12, 4
    run = moe_run("top-2", cfg, train, rt, steps, mb, val_blocks=val, eval_every=6,
                  probe=lambda m: capacity_sweep(m, val, [0.25, 1.0, 4.0], batches=2, batch_size=4))
    e = run.extras
    assert not run.error and run.micro_batch == mb
    assert e["lm_losses"][-1] < e["lm_losses"][0] - 0.3, e["lm_losses"]
    assert [s for s, _ in run.val_losses] == [6, 12] and run.val_loss < e["lm_losses"][0]
    assert len(run.losses) == len(e["lm_losses"]) == len(e["aux_losses"]) == steps
    for total, lm, aux in zip(run.losses, e["lm_losses"], e["aux_losses"]):
        assert aux > 0.5  # two MoE layers, each about 1.0
        assert total == pytest.approx(lm + 0.1 * aux, rel=1e-5)
    tokens = steps * mb * cfg.seq_len
    assert e["routing"]["tokens"] == [tokens, tokens]
    assert all(sum(d) == 2 * tokens for d in e["routing"]["demand"])
    assert all(sum(l) + d == 2 * tokens for l, d in zip(e["routing"]["load"], e["routing"]["dropped_routes"]))
    assert len(e["load_history"]) == steps and run.tokens_per_s > 0
    c = count_moe_params(build_gpt(cfg))
    assert (e["params_total"], e["params_active"], run.params) == (c.total, c.active, c.total)
    assert e["kind"] == "top-2" and e["num_experts"] == 4
    drops = [r["dropped_fraction"] for r in e["probe"]]
    assert drops[0] > drops[1] >= drops[2] == 0
    again = RunResult.from_dict(json.loads(json.dumps(run.as_dict())))  # one serialisation, round trip
    assert again.extras == e and again.val_losses == run.val_losses
    dense = moe_run("dense", cfg.dense_twin(), train, rt, 4, mb, val_blocks=val, eval_every=4)
    assert dense.extras["aux_losses"] == [0.0] * 4 and dense.extras["routing"] == {}
    assert dense.extras["kind"] == "dense" and len(dense.val_losses) == 1
    table = moe_table([dense, run])
    assert "dense" in table and f"{run.val_loss:.3f}" in table
    # train_run timed every step after the two untimed ones: the table gives the median step and the middle half
    assert len(run.step_seconds) == steps - 2 and len(dense.step_seconds) == 2
    low, mid, high = run.speed_spread()
    assert low <= mid <= high and f"{mid:>10,.0f}" in table and f"{low:,.0f}-{high:,.0f}" in table
    assert "RAM +GB" in table and f"{max(run.peak_rss_gb - run.baseline_rss_gb, 0):.2f}" in table
    assert ("peak GiB" in table) == bool(run.peak_vram_gib or dense.peak_vram_gib)


def timed(name, step_seconds, tokens_per_s=0.0, routing=None):
    """A RunResult with only its name, timed steps (8 x 32 tokens each) and routing set."""
    return RunResult(name=name, model="m", params=1, config=name, precision="fp32", micro_batch=8, grad_accum=1,
                     seq_len=32, steps=len(step_seconds) + 2, checkpointing=False, runtime="test",
                     tokens_per_s=tokens_per_s, step_seconds=step_seconds, extras={"routing": routing or {}})


def test_speed_verdicts_call_a_difference_only_beyond_the_spread():
    dense = timed("dense", [0.010, 0.011, 0.012, 0.010, 0.011])
    slow = timed("MoE top-1", [0.020, 0.021, 0.022, 0.020, 0.021])  # the middle halves far apart: slower
    noisy = timed("MoE top-2", [0.008, 0.011, 0.016, 0.009, 0.013])  # overlaps dense's: no verdict
    verdicts = {c.a: c for c in speed_verdicts([dense, slow, noisy])}
    assert set(verdicts) == {"MoE top-1", "MoE top-2"} and all(c.b == "dense" for c in verdicts.values())
    assert verdicts["MoE top-1"].separated and verdicts["MoE top-1"].verdict == "slower"
    assert verdicts["MoE top-1"].ratio == pytest.approx(0.011 / 0.021, rel=1e-3)
    assert not verdicts["MoE top-2"].separated
    assert verdicts["MoE top-2"].verdict == "no difference beyond the spread"


def test_most_even_follows_each_measure_and_they_can_disagree():
    # reports/moe.json's aux sweep pattern: 0.01 the most even per step, 0.1 over the whole run (the bars)
    routings = {0.0: {"imbalance": 4.94, "demand": [[40, 10, 10, 20]]},
                0.01: {"imbalance": 2.59, "demand": [[30, 20, 20, 30]]},
                0.1: {"imbalance": 2.89, "demand": [[26, 24, 25, 25]]}}
    assert evenness(routings[0.1]).whole_run == pytest.approx(26 * 4 / 100)
    assert evenness(routings[0.01]).per_step == 2.59
    assert most_even(routings) == {"per_step": [0.01], "whole_run": [0.1]}
    routings[0.1]["imbalance"] = 2.588  # equal to the printed two decimals: both named
    assert most_even(routings)["per_step"] == [0.01, 0.1]


def test_committed_report_note_says_where_its_numbers_come_from():
    def row(name, tps, steps=None):
        r = {"name": name, "runtime": "GPU box", "micro_batch": 8, "seq_len": 32, "steps": 20, "tokens_per_s": tps,
             "params_total": 1, "precision": "fp16"}
        if steps is not None:
            r["step_seconds"] = steps
        return r

    report = {"runtime": "GPU box", "gpu": "GPU", "date": "2026-01-01", "shape": {"hidden": 8, "layers": 2},
              "steps": 20, "micro_batch": 8, "seq_len": 32, "precision": "fp16",
              "rows": [row("dense", 1000.0), row("MoE top-1", 500.0)]}
    here = [timed("dense", [0.01, 0.011, 0.012], 900.0), timed("MoE top-1", [0.02, 0.021, 0.022], 400.0)]
    old = committed_report_note(report, here, "CPU here")
    assert "'GPU box'" in old and "2026-01-01" in old and "'CPU here'" in old and "not compared" in old
    assert "no per-step times recorded" in old and "x0.50 dense" in old  # an old report: no verdict, its ratio only
    assert "vs dense" not in old  # no SpeedComparison line without per-step times
    assert "dense 900" in old and here[0].speed_text() in old  # this run's numbers, labelled as this run's
    report["rows"] = [row("dense", 1000.0, [0.010, 0.011, 0.012]), row("MoE top-1", 500.0, [0.020, 0.021, 0.022])]
    new = committed_report_note(report)
    assert "In the report (median step" in new and "slower" in new and "This run" not in new


@pytest.mark.slow
def test_an_interrupted_moe_run_removes_its_gate_hooks(blocks):
    """KeyboardInterrupt mid-run: train_run's teardown closes the hooks (no forward hook left on the gates)."""
    from deepspeed.moe.sharded_moe import TopKGate

    train, _, vocab = blocks
    rt = detect_runtime()
    cfg = TINY.replace(vocab_size=vocab)
    model = build_gpt(cfg)

    class Stop(MoEHooks):
        def after_step(self, step, result):
            super().after_step(step, result)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_run("stopped", lambda: model, train, runtime=rt, steps=3,
                  ds_config=moe_ds_config(rt, micro_batch=4, steps=3),
                  measure=MeasureSettings(progress=False, hooks=Stop(cfg)))
    gates = [m for m in model.modules() if isinstance(m, TopKGate)]
    assert gates and all(not g._forward_hooks for g in gates)


def test_zero_stages_0_1_2_train_moe_alike():
    import deepspeed

    ids = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    trajectories = []
    for stage in (0, 1, 2):
        setup_single_process()
        model = build_gpt(TINY.replace(k=2))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=moe_param_groups(model),
                                          config=moe_ds_config(detect_runtime(), stage=stage, micro_batch=2, lr=3e-3))
        losses = []
        torch.manual_seed(0)  # top-2's sampled second expert draws from the global RNG
        for _ in range(5):
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.lm_loss.item())
        engine.destroy()
        trajectories.append(losses)
    assert trajectories[0][-1] < trajectories[0][0]
    for t in trajectories[1:]:
        assert t == pytest.approx(trajectories[0], rel=1e-4)


def test_zero3_is_refused_with_deepspeeds_message():
    message = zero3_refusal(TINY.replace(k=2), detect_runtime())
    assert ZERO3_REFUSAL in message and "stage 1/2" in message
    # the failed initialize leaves nothing behind: ZeRO-2 still trains in this process
    setup_single_process()
    import deepspeed

    model = build_gpt(TINY)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),  # engine splits the groups
                                      config=moe_ds_config(detect_runtime(), micro_batch=2))
    ids = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    out = engine(input_ids=ids, labels=ids)
    engine.backward(out.loss)
    engine.step()
    assert math.isfinite(out.loss.item())
    engine.destroy()


def test_a_client_optimizer_over_mixed_groups_is_refused():
    import deepspeed

    setup_single_process()
    model = build_gpt(TINY)
    with pytest.raises(AssertionError, match="None of the param groups are marked as MoE"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                             config=moe_ds_config(detect_runtime(), micro_batch=2))


@pytest.mark.slow
def test_expert_parallel_script_splits_the_experts_over_two_processes(tmp_path, free_port_env, blocks):
    out = tmp_path / "ep"
    train, _, vocab = blocks
    train.select(range(64)).with_format(None).save_to_disk(str(tmp_path / "blocks"))  # as notebook 03 does
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port_env,
           "notebooks/programs/moe_expert_parallel.py", "--out", str(out), "--device", "cpu", "--experts", "4",
           "--steps", "3", "--hidden", "32", "--blocks", str(tmp_path / "blocks"), "--vocab", str(vocab)]
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    written = sorted(p.name for p in out.glob("rank*.json")) if out.exists() else []
    assert proc.returncode == 0, (f"exit {proc.returncode}; reports written: {written}\n"
                                  f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    layer = next(iter(ranks[0]["experts_held"]))
    assert [r["experts_held"][layer] for r in ranks] == [[0, 1], [2, 3]]
    for r in ranks:
        assert r["ep_size"] == 2 and r["backend"] == "gloo"
        assert 2 * r["expert_params_local"] == r["expert_params_total"]
        assert r["params_local"] == r["shared_params"] + r["expert_params_local"]
        assert r["same_weights_as_unsplit_model"] and r["shared_weights_equal_on_all_ranks"]
        assert r["expert_weights_differ_between_ranks"]
        assert r["routes_to_other_ranks"] > 0 and len(r["losses"]) == 3


@pytest.fixture
def free_port_env():
    from helpers.runtime import free_port

    return str(free_port())


@pytest.mark.slow
def test_benchmark_smoke(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, "benchmarks/moe.py", "--vocab", "512", "--seq-len", "32", "--hidden", "32",
                           "--layers", "2", "--heads", "2", "--ffn", "128", "--experts", "4", "--micro-batch", "4",
                           "--steps", "4", "--texts", "300", "--aux-sweep", "0", "0.01", "--capacity-sweep", "0.5",
                           "2", "--out", str(out), "--work-dir", str(tmp_path)],
                          cwd=ROOT, env={k: v for k, v in os.environ.items() if k not in DIST_ENV_VARS},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["rows"]] == ["dense", "MoE top-1", "MoE top-2"]
    for r in report["rows"]:
        assert {"params_total", "params_active", "tokens_per_s", "peak_vram_gib", "val_loss", "expert_load",
                "runtime"} <= set(r)
    assert report["rows"][1]["params_active"] == report["rows"][2]["params_active"]
    assert len(report["rows"][1]["expert_load"][0]) == 4
    assert [a["aux_loss_coef"] for a in report["aux_sweep"]] == [0.0, 0.01]
    assert ZERO3_REFUSAL in report["zero3_refusal"]
    for r in report["rows"]:  # 4 steps, 2 untimed: the per-step times and their quartiles are in the report
        assert len(r["step_seconds"]) == 2 and len(r["tokens_per_s_steps"]) == 3
        assert r["tokens_per_s_steps"][0] <= r["tokens_per_s_steps"][1] <= r["tokens_per_s_steps"][2]
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# Dense vs Mixture of Experts")
    assert "MoE top-1 vs dense: x" in md and "middle halves" in md  # the verdicts, from the steps' spread


def test_committed_report_if_present():
    path = ROOT / "reports" / "moe.json"
    if not path.exists():
        pytest.skip("reports/moe.json not committed yet (GPU run)")
    report = json.loads(path.read_text())
    assert "CPU" not in report["runtime"]
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"dense", "MoE top-1", "MoE top-2"}
    for r in rows.values():
        assert r["runtime"] == report["runtime"] and r["tokens_per_s"] > 0 and r["peak_vram_gib"] > 0
        assert r["loss_last5"] < r["loss_first5"]
    assert rows["MoE top-1"]["params_total"] > rows["dense"]["params_total"]
    assert rows["MoE top-1"]["params_active"] - rows["dense"]["params_active"] == \
        report["shape"]["hidden"] * report["shape"]["num_experts"] * len(report["moe_layers"])


def test_drop_shares_split_the_run_into_its_first_and_last_steps():
    """helpers.moe.drop_shares: the share of routes dropped over all steps, the first tenth and the last tenth."""
    from helpers.moe import drop_shares

    steps = 20
    history = {"dropped_routes": [[8, 2]] * 2 + [[1, 0]] * 16 + [[0, 0]] * 2,  # two MoE layers per step
               "tokens": [[50, 50]] * steps}
    shares = drop_shares(history, k=1)
    assert shares["steps"] == 2 and shares["first"] == 10 / 100 and shares["last"] == 0.0
    assert shares["all"] == (2 * 10 + 16 * 1) / (steps * 100)
    assert drop_shares(history, k=2)["first"] == 10 / 200  # top-2: two routes per token
