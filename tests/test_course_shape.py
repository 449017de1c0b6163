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


def test_two_runs_verdicts_are_compared_with_numbers_masked(tmp_path):
    """scripts/verdicts.py (issue 40 item 5): 'slower' in one run and 'within the spread' in the other is a flip; the
    same verdict with other numbers is not; progress bars are not verdicts."""
    import verdicts  # scripts/

    def run(folder, lines):
        folder.mkdir()
        cells = [nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output("stream", name="stdout", text=t)])
                 for t in lines]
        nbformat.write(nbformat.v4.new_notebook(cells=cells), folder / "01.ipynb")

    run(tmp_path / "a", ["ZeRO-2 vs plain: x0.72, slower, beyond the spread\n", "it fits: 3.1 GB\n",
                         "training: 100%|####| 10/10 faster\n"])
    run(tmp_path / "b", ["ZeRO-2 vs plain: x0.87, within the spread\n", "it fits: 3.4 GB\n",
                         "training: 100%|####| 10/10 slower\n"])
    flips = verdicts.compare(tmp_path / "a", tmp_path / "b")
    assert [c["cell"] for c in flips["01.ipynb"]] == [0]
    assert flips["01.ipynb"][0]["a"] == ["ZeRO-# vs plain: x#, slower, beyond the spread"]
    assert "| 01.ipynb | 1 |" in verdicts.markdown(tmp_path / "a", tmp_path / "b", flips)
