"""scripts/promote_drafts.py: a draft that passed its GPU check replaces its notebook and works in build/nbNN again."""
import promote_drafts  # scripts/ is on pytest's pythonpath (pyproject.toml)


def test_a_promoted_draft_replaces_its_notebook_and_leaves_no_draft_work_folder(tmp_path):
    drafts = tmp_path / "notebooks" / "drafts"
    drafts.mkdir(parents=True)
    cell = '"WORK = helpers.work_dir(\\"nb01-draft\\")  # build/nb01-draft (build/nb01 once out of drafts/)\\n"'
    (drafts / "01_x.ipynb").write_text('{"source": [' + cell + ']}')
    (drafts / "04_y.ipynb").write_text('{"source": ["m = f(helpers.work_dir(\\"nb04-draft\\"))"]}')
    (tmp_path / "notebooks" / "01_x.ipynb").write_text("old")

    written = promote_drafts.promote(["01"], drafts=drafts)

    assert [p.name for p in written] == ["01_x.ipynb"]
    text = (tmp_path / "notebooks" / "01_x.ipynb").read_text()
    assert 'work_dir(\\"nb01\\")  # build/nb01: checkpoints and logs' in text and "draft" not in text
    assert not (drafts / "01_x.ipynb").exists() and (drafts / "04_y.ipynb").exists()  # only the one asked for
    promote_drafts.promote(drafts=drafts)
    assert 'work_dir(\\"nb04\\"))' in (tmp_path / "notebooks" / "04_y.ipynb").read_text() and not drafts.exists()


def test_a_draft_whose_comment_names_its_contents_is_promoted_without_repeating_them(tmp_path):
    """Drafts 03 and 07 wrote '# build/nbNN-draft (build/nbNN once out of drafts/): checkpoints and logs'; promoted, that
    read '# build/nbNN: checkpoints and logs: checkpoints and logs' (2026-12-07)."""
    drafts = tmp_path / "notebooks" / "drafts"
    drafts.mkdir(parents=True)
    cell = ('"WORK = helpers.work_dir(\\"nb07-draft\\")  # build/nb07-draft (build/nb07 once out of drafts/): '
            'checkpoints and logs\\n"')
    (drafts / "07_z.ipynb").write_text('{"source": [' + cell + ']}')
    promote_drafts.promote(drafts=drafts)
    text = (tmp_path / "notebooks" / "07_z.ipynb").read_text()
    assert 'work_dir(\\"nb07\\")  # build/nb07: checkpoints and logs\\n"' in text, text
