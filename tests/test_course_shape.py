"""scripts/course_shape.py (issue 40): the main path ends at `## Going deeper`; words, helpers calls, DeepSpeed's API
and jargon are counted there only."""
import nbformat

import course_shape  # scripts/


def test_the_main_path_stops_at_going_deeper_and_counts_only_it(tmp_path):
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    nb = nbformat.v4.new_notebook(cells=[
        md("# Title\nOne two three"),
        code("engine, *_ = deepspeed.initialize(model=m, config=cfg)\nhelpers.plot_losses(x)\nengine.backward(loss)"),
        md("## Going deeper\nThe roofline and glibc"),
        code("helpers.trace(1)"),
    ])
    nbformat.write(nb, tmp_path / "x.ipynb")
    row = course_shape.shape(tmp_path / "x.ipynb")
    assert row["main_path_cells"] == 2 and row["has_going_deeper"]
    assert row["main_path_words"] == 5 and row["jargon_main_path"] == {}
    assert row["helpers_calls_main_path"] == 1 and row["helpers_calls"] == 2
    assert row["deepspeed_api_main_path"] == {"deepspeed.initialize": 1, ".backward(": 1}
    nb.cells[2].source = "## 3. More\nThe roofline and glibc"  # no Going deeper: all of it is the main path
    nbformat.write(nb, tmp_path / "x.ipynb")
    row = course_shape.shape(tmp_path / "x.ipynb")
    assert not row["has_going_deeper"] and row["jargon_main_path"] == {"roofline": 1, "glibc": 1}
