from helpers.models import GPT2_LADDER, model_shape
from helpers.planner import plan, planner_widget


def test_ladder_sizes_match_the_published_gpt2_family():
    assert round(model_shape("gpt2").n_params / 1e6, 1) == 124.4
    assert round(model_shape("gpt2-medium").n_params / 1e6) == 355
    assert round(model_shape("gpt2-xl").n_params / 1e6) == 1558
    assert list(GPT2_LADDER)[:2] == ["gpt2-tiny", "gpt2"]


def test_plan_gpt2_fits_a_t4_and_gpt2_xl_does_not(t4):
    small = plan("gpt2", 2, runtime=t4)
    assert small.report.fits and small.config["fp16"]["enabled"]
    big = plan("gpt2-xl", 2, runtime=t4)
    assert not big.report.fits and big.report.suggestion["stage"] == 3
    assert "a config predicted to fit" in str(big)


def test_plan_reports_a_refused_config_instead_of_raising(t4):
    p = plan("gpt2", 2, offload_param="cpu", runtime=t4)
    assert p.config is None and "Parameter offload needs ZeRO stage 3" in str(p)
    assert "no native bf16" in plan("gpt2", 2, precision="bf16", runtime=t4).error


def test_widget_updates_when_a_setting_changes(t4):
    ui = planner_widget(t4)
    out = ui.children[-1]
    first = out.value
    assert "ZeRO-2" in first and "&quot;stage&quot;: 2" in first
    stage = ui.children[0].children[1]
    stage.value = 3
    second = out.value
    assert "ZeRO-3" in second and "&quot;stage&quot;: 3" in second


def test_a_bare_size_is_planned_with_the_nearest_rungs_shapes(t4):
    from helpers.models import parse_param_count

    assert parse_param_count("350M") == 350_000_000 and parse_param_count("1.3B") == 1_300_000_000
    assert parse_param_count("7e9") == 7_000_000_000 and parse_param_count(124_000_000) == 124_000_000
    assert parse_param_count("gpt2") is None
    shape = model_shape("1.3B")
    assert shape.n_params == 1_300_000_000 and shape.hidden == 1600 and shape.name == "1.30B params"
    assert not plan("1.3B", 2, runtime=t4).report.fits
