"""helpers.overflow_check: ZeRO-3's overflow check in slices gives DeepSpeed's own answer, without its whole-buffer
temporaries (issue 25). On CPU the check is called directly: DeepSpeed runs it only for fp16, which it refuses on CPU."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def zero3_engine(clean_dist_env):
    import deepspeed

    import helpers
    from helpers.checkpoints import release_zero3
    from helpers.runtime import setup_single_process, teardown

    runtime = helpers.detect_runtime()
    config = helpers.gpt2_config("gpt2-tiny", vocab_size=1024, n_positions=32)
    cfg = helpers.config.offload_config("zero3_offload_cpu", runtime, largest_param=helpers.model_shape(config)
                                 .largest_layer_params, micro_batch_size=2)
    setup_single_process()
    model, keep_alive = helpers.checkpoints.build_zero3_model(cfg, config=config, seed=0)
    ns = {}
    ns["engine"], ns["optimizer"], _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                               config=cfg)
    del model, keep_alive
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0))
    ns["engine"].backward(ns["engine"](input_ids=ids, labels=ids).loss)
    yield ns["engine"].optimizer
    helpers.restore_zero3_overflow_check()
    teardown(ns, "engine", "optimizer")
    release_zero3()


@pytest.mark.slow
def test_chunked_check_answers_as_deepspeed_does(zero3_engine):
    import helpers

    opt = zero3_engine
    flat = opt.grad_partitions_flat_buffer
    assert flat.device.type == "cpu" and flat.numel() > 1000 and torch.isfinite(flat).all()
    original = type(opt).has_overflow
    answers = []
    for bad in (None, float("inf"), float("-inf"), float("nan")):
        saved = flat[-1].clone()
        if bad is not None:
            flat[-1] = bad  # the last slice: a scan that stopped early would miss it
        helpers.chunk_zero3_overflow_check(chunk_elements=97)  # many slices, the last one short
        assert type(opt).has_overflow is not original and helpers.overflow_check.chunked_overflow_check_active()
        chunked = opt.has_overflow()
        helpers.restore_zero3_overflow_check()
        assert type(opt).has_overflow is original
        answers.append((chunked, opt.has_overflow()))
        flat[-1] = saved
    assert answers == [(False, False), (True, True), (True, True), (True, True)]
    assert not opt.inf_or_nan_tracker.any()  # reset after each check, as DeepSpeed does


def test_chunked_check_refuses_other_deepspeed_versions_and_bad_sizes(monkeypatch):
    import deepspeed

    import helpers

    for bad, fix in [(0, 2**25), ("1e6", 1_000_000), (2.5, 2**25), (True, 2**25), (None, 2**25), (4096.0, 4096)]:
        with pytest.raises(ValueError, match="chunk_elements must be an integer >= 1") as err:
            helpers.chunk_zero3_overflow_check(chunk_elements=bad)
        assert str(err.value).split("Fix: ")[1].startswith(f"chunk_elements={fix} ")
        helpers.overflow_check._check_chunk_elements(fix)  # the suggested fix passes the check that refused
    assert not helpers.overflow_check.chunked_overflow_check_active()
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    with pytest.raises(RuntimeError, match=r"checked against DeepSpeed 0\.19\.8 only; this is DeepSpeed 0\.20\.0"):
        helpers.chunk_zero3_overflow_check()
    assert not helpers.overflow_check.chunked_overflow_check_active()


def test_restoring_under_another_deepspeed_version_puts_the_original_back(monkeypatch):
    """Issue 41: restore took the saved original out of its store, then raised on the version check: the patch stayed
    on, `chunked_overflow_check_active()` said False and DeepSpeed's own check was lost."""
    import deepspeed
    from deepspeed.runtime.zero import stage3

    import helpers

    own = stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow
    helpers.chunk_zero3_overflow_check()
    try:
        assert helpers.overflow_check.chunked_overflow_check_active()
        assert stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow is not own
        monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
        helpers.restore_zero3_overflow_check()
    finally:
        monkeypatch.undo()
        helpers.restore_zero3_overflow_check()
    assert stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow is own
    assert not helpers.overflow_check.chunked_overflow_check_active()


@pytest.mark.slow
def test_the_benchmark_compares_both_checks_on_the_same_run(tmp_path):
    """benchmarks/overflow_check.py smoke-sized on this machine: both runs train the same losses (on CPU, bf16, the
    check never runs: the patch must change nothing else), the comparison and the Markdown say so."""
    import json

    from conftest import ROOT, load_script

    bench = load_script(ROOT / "benchmarks" / "overflow_check.py", "overflow_check_bench")
    out = tmp_path / "overflow_check.json"
    assert bench.main(["--sizes", "gpt2-tiny", "--steps", "3", "--seq-len", "32", "--quiet", "--out", str(out),
                       "--nvme-path", str(tmp_path / "nvme"), "--work-dir", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    assert [r["check"] for r in report["rows"]] == ["DeepSpeed's", "chunked"]
    (c,) = report["comparison"]
    assert c["same_skipped_steps"] and c["max_loss_difference"] < 1e-4, report
    assert "| gpt2-tiny | yes |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_min_max_per_slice_gives_isinf_isnans_answer(dtype):
    """The chunked check's test (issue 24): each slice's torch.aminmax instead of isinf/isnan over the buffer. The
    largest finite values, a lone inf/-inf/NaN at either end of any slice, NaN beside inf: the same answer."""
    from helpers.overflow_check import _any_inf_or_nan

    big = torch.finfo(dtype).max
    cases = [[], [(0, big), (1, -big)]]
    cases += [[(i, v)] for i in (0, 96, 97, 999) for v in (float("inf"), float("-inf"), float("nan"))]
    cases += [[(5, float("nan")), (500, float("inf"))], [(5, float("-inf")), (500, float("nan"))]]
    for case in cases:
        flat = torch.linspace(-3, 3, 1000).to(dtype)
        for i, v in case:
            flat[i] = v
        expected = bool(torch.isinf(flat).any() or torch.isnan(flat).any())
        assert bool(_any_inf_or_nan(flat, 97)) == expected, (dtype, case)
