"""Which directory a checkpoint path means, including after a save killed at a bad moment, and
whether `train --resume MODE` continues from one."""

import pytest

from agentgym_mega import files
from agentgym_mega.config import load_config
from agentgym_mega.errors import BadInput
from agentgym_mega.models import checkpoint
from agentgym_mega.trainer import resume_from


def _checkpoint(path):
    path.mkdir(parents=True)
    (path / checkpoint.META).write_text("{}")


def test_root_resolves_through_latest_and_a_directory_to_itself(tmp_path):
    _checkpoint(tmp_path / "iter_0000002")
    _checkpoint(tmp_path / "iter_0000004")
    (tmp_path / "latest").write_text("iter_0000002\n")
    assert checkpoint.resolve(str(tmp_path)) == str(tmp_path / "iter_0000002")
    assert checkpoint.resolve(str(tmp_path / "iter_0000004")) == str(tmp_path / "iter_0000004")


def test_a_resave_killed_between_renames_still_resolves_to_the_old_copy(tmp_path):
    _checkpoint(tmp_path / "iter_0000002.old")  # final renamed away, new one not yet in place
    (tmp_path / "iter_0000002.tmp").mkdir()
    (tmp_path / "latest").write_text("iter_0000002\n")
    assert checkpoint.resolve(str(tmp_path)) == str(tmp_path / "iter_0000002.old")


def test_a_directory_without_meta_is_refused_by_name(tmp_path):
    (tmp_path / "iter_0000001.tmp").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint"):
        checkpoint.resolve(str(tmp_path / "iter_0000001.tmp"))


def test_commit_dir_replaces_atomically(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    tmp = files.atomic_dir(str(final))
    (tmp_path / "out.tmp" / "new.txt").write_text("new")
    files.commit_dir(tmp, str(final))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in final.iterdir()] == ["new.txt"]


@pytest.mark.parametrize("mode, saved, resumes", [(None, True, False), ("auto", False, False), ("auto", True, True),
                                                  ("latest", True, True)])
def test_resume_modes(tmp_path, mode, saved, resumes):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"])
    if saved:
        _checkpoint(tmp_path / "checkpoints" / "actor" / "iter_0000003")
        (tmp_path / "checkpoints" / "actor" / checkpoint.LATEST).write_text("iter_0000003\n")
    assert resume_from(cfg, mode) is resumes


def test_resume_latest_without_a_checkpoint_says_where_it_looked_and_what_else_to_do(tmp_path):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}"])
    with pytest.raises(BadInput, match=f"no checkpoint in {tmp_path}/checkpoints .*--resume auto starts fresh"):
        resume_from(cfg, "latest")
    with pytest.raises(BadInput, match="expected one of latest, auto"):
        resume_from(cfg, "sometimes")
