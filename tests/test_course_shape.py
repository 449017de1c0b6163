"""scripts/course_shape.py (issue 40): the main path ends at `## Going deeper`; words, helpers calls, DeepSpeed's API
and jargon are counted there only."""
import json

import nbformat
import pytest

import course_shape  # scripts/
from conftest import ROOT

GPU_REPORT = json.loads((ROOT / "reports" / "gpu_check.json").read_text())


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


def test_bookkeeping_records_outputs_and_the_time_line_are_counted_on_the_main_path(tmp_path):
    """The budget's other measures: two bookkeeping calls in one cell, a main-path output's printed lines (progress
    bars left out), a bar saved with its refreshes, and the intro's T4 time line."""
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    out = nbformat.v4.new_output
    cells = [md("# T\n**Time:** about 3-5 minutes on a Colab T4"),
             code("helpers.clean_slate(globals(), 'a')\nhelpers.require(globals(), 'b', where='x')\nhelpers.record_figure('a', 1)",
                  outputs=[out("stream", name="stdout", text="".join(f"line {i}\n" for i in range(30))
                               + "run: 100%|####| 9/9\n")]),
             md("## Summary\n## Exercises"),
             md("## Going deeper"),
             code("print(1)", outputs=[out("stream", name="stdout", text="x\n" * 40 + "bar:  10%|#\rbar: 100%|##|\n")])]
    nb = nbformat.v4.new_notebook(cells=cells)
    nbformat.write(nb, tmp_path / "x.ipynb")
    row = course_shape.shape(tmp_path / "x.ipynb", tmp_path / "x.ipynb")
    assert row["max_bookkeeping_calls_per_cell"] == 2 and row["max_record_calls_per_cell"] == 1
    assert row["time_line"] == [3, 5] and row["sections_before_going_deeper"] == ["## Summary", "## Exercises"]
    assert row["longest_main_path_output_lines"] == 30 and row["longest_printed_output_lines"] == 40
    assert row["extra_progress_bar_lines"] == 1
    assert course_shape.t4_minutes({"low_s": 377, "high_s": 514}) == (6, 9)
    assert course_shape.t4_minutes({"low_s": 20, "high_s": 50}) == (1, 2)


DRAFTS = sorted((ROOT / "notebooks" / "drafts").glob("[0-9][0-9]_*.ipynb"))


def _budget(row: dict, name: str) -> None:
    """The text and code of issue 40's budget: the lesson in ~1,300 words of markdown before `## Going deeper`,
    Summary and Exercises before it, none of the internals' jargon there, at most one bookkeeping call and one record
    call per cell, and the intro's T4 time the GPU report's estimate."""
    assert row["has_going_deeper"] and row["sections_before_going_deeper"] == ["## Summary", "## Exercises"], row
    assert row["main_path_words"] <= course_shape.MAX_MAIN_PATH_WORDS, row["main_path_words"]
    assert row["jargon_main_path"] == {}, row["jargon_main_path"]
    assert row["max_bookkeeping_calls_per_cell"] <= 1 and row["max_record_calls_per_cell"] <= 1, row
    estimate = GPU_REPORT["notebooks"][name]["t4_estimate"]
    assert row["time_line"] == list(course_shape.t4_minutes(estimate)), (row["time_line"], estimate)


@pytest.mark.parametrize("path", DRAFTS, ids=[p.name for p in DRAFTS])
def test_a_drafted_notebook_keeps_the_learners_budget_in_its_text_and_code(path):
    _budget(course_shape.shape(path), path.name)


@pytest.mark.parametrize("name", course_shape.EDITED)
def test_an_edited_notebook_keeps_the_learners_budget_and_its_outputs_are_short(name):
    """The budget above, and printed outputs (of its executed copy, the GPU run's) under ~25 lines on the main path."""
    row = course_shape.shape(ROOT / "notebooks" / name, ROOT / "reports" / "executed" / name)
    _budget(row, name)
    assert row["longest_main_path_output_lines"] <= course_shape.MAX_OUTPUT_LINES, row["longest_main_path_output_lines"]


def test_every_executed_copy_saves_each_progress_bar_as_its_final_line():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        row = course_shape.shape(path, ROOT / "reports" / "executed" / path.name)
        assert row["extra_progress_bar_lines"] == 0, (path.name, row["extra_progress_bar_lines"])


def test_an_executed_copy_is_saved_as_a_reader_sees_it_and_takes_the_notebooks_markdown(tmp_path):
    """scripts/run_notebooks.py: save_executed keeps a progress bar's final line only (nbconvert's coalescing of the
    stream outputs), and sync_markdown gives a copy its notebook's edited markdown but refuses other code."""
    import run_notebooks  # scripts/

    out = nbformat.v4.new_output
    refreshes = [out("stream", name="stdout", text="\rrun:   0%|  | 0/3"), out("stream", name="stdout", text="\rrun:  33%|# | 1/3"),
                 out("stream", name="stdout", text="\rrun: 100%|##| 3/3\n"), out("stream", name="stdout", text="done\n")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Old"),
                                         nbformat.v4.new_code_cell("train()", outputs=refreshes)])
    run_notebooks.save_executed(nb, tmp_path / "ran.ipynb")
    saved = nbformat.read(tmp_path / "ran.ipynb", as_version=4)
    assert [o.text for o in saved.cells[1].outputs] == ["run: 100%|##| 3/3\ndone\n"]
    assert course_shape.shape(tmp_path / "ran.ipynb", tmp_path / "ran.ipynb")["extra_progress_bar_lines"] == 0
    source = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# New"), nbformat.v4.new_code_cell("train()")])
    nbformat.write(source, tmp_path / "nb.ipynb")
    assert run_notebooks.sync_markdown(tmp_path / "ran.ipynb", tmp_path / "nb.ipynb") == 1
    synced = nbformat.read(tmp_path / "ran.ipynb", as_version=4)
    assert synced.cells[0].source == "# New" and synced.cells[1].outputs[0].text.startswith("run: 100%")
    source.cells[1].source = "train(steps=2)"
    nbformat.write(source, tmp_path / "nb.ipynb")
    with pytest.raises(ValueError, match="did not run"):
        run_notebooks.sync_markdown(tmp_path / "ran.ipynb", tmp_path / "nb.ipynb")


def test_a_long_text_is_shown_folded_under_its_summary(capsys):
    """helpers.show_folded: outside a notebook (here) only the summary line is printed, never the long text."""
    import helpers

    helpers.show_folded("line\n" * 50, "the raw report: 50 lines")
    assert capsys.readouterr().out == "the raw report: 50 lines\n"


def test_every_intro_that_names_a_t4_time_names_the_reports():
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + DRAFTS:
        row = course_shape.shape(path)
        if row["time_line"] is not None or path.name in course_shape.EDITED or path in DRAFTS:
            estimate = GPU_REPORT["notebooks"][path.name]["t4_estimate"]
            assert row["time_line"] == list(course_shape.t4_minutes(estimate)), (path.name, row["time_line"], estimate)
