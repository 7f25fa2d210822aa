"""--overwrite deletes only a run's folder: never the current folder, a folder above it, or a folder of other files."""

from __future__ import annotations

import pytest

from flowrl.config import ConfigError, load_config
from flowrl.outputs import check_run_dir_free, prepare_run_dir


@pytest.fixture
def precious(tmp_path, monkeypatch):
    """A working folder holding a user's files, made the current folder."""
    (tmp_path / "precious.txt").write_text("keep me")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "y").write_text("and me")
    monkeypatch.chdir(tmp_path / "sub")
    return tmp_path


@pytest.mark.parametrize("where", [".", "..", "{root}"])
def test_overwrite_refuses_the_current_folder_and_those_above_it(precious, where):
    path = where.format(root=precious)
    for check in (lambda: check_run_dir_free(path, True), lambda: prepare_run_dir(path, True)):
        with pytest.raises(FileExistsError, match="is the current folder or one above it; --overwrite would delete"):
            check()
    assert (precious / "precious.txt").read_text() == "keep me" and (precious / "sub" / "y").is_file()


def test_overwrite_refuses_a_folder_that_holds_no_run(precious):
    other = precious / "notes"
    other.mkdir()
    (other / "todo.md").write_text("x")
    with pytest.raises(FileExistsError, match="holds files but no run .*--overwrite deletes only run folders"):
        prepare_run_dir(other, True)
    assert (other / "todo.md").is_file()


def test_overwrite_replaces_a_run_folder(precious):
    run = precious / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    check_run_dir_free(run, True)
    assert prepare_run_dir(run, True) == run and not any(run.iterdir())


@pytest.mark.parametrize("key", ["output.dir", "model.path", "prompts.train", "prompts.cache_dir"])
def test_an_empty_path_is_refused(key):
    with pytest.raises(ConfigError, match=f"'{key}' is empty; set it to a path"):
        load_config(None, [f"{key}="])


def test_a_resume_writes_only_into_its_own_run_folder(precious):
    run, other = precious / "a", precious / "b"
    for folder in (run, other):
        (folder / "checkpoints" / "iter-000001").mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("{}\n")
    check_run_dir_free(run, False, str(run / "checkpoints" / "iter-000001"))  # its own run: continues there
    check_run_dir_free(run, False, str(run))
    check_run_dir_free(precious / "new", False, str(run))  # a new folder is fine
    for overwrite in (False, True):  # another run's folder is never written over by a resume
        with pytest.raises(FileExistsError, match="is not the run of --resume .*leave output.dir out to continue in"):
            check_run_dir_free(other, overwrite, str(run / "checkpoints" / "iter-000001"))
