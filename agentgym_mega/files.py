"""Writing files and directories so that a reader (or a run killed midway) sees the old version
or the new one, never a mix: checkpoints, exported HF directories and generated models use it."""

from __future__ import annotations

import os
import shutil


def temp_path(final: str) -> str:
    return f"{final.rstrip(os.sep)}.tmp"


def previous_path(final: str) -> str:
    return f"{final.rstrip(os.sep)}.old"


def atomic_dir(final: str) -> str:
    """A fresh sibling temp dir of ``final``; :func:`commit_dir` moves it into place."""
    tmp = temp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def commit_dir(tmp: str, final: str) -> None:
    """Replaces ``final`` by ``tmp``: readers see the old directory or the new one, never a mix
    (between the two renames the old one is at :func:`previous_path`)."""
    old = previous_path(final)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def write_text_atomic(path: str, text: str) -> None:
    """Writes ``path`` through a synced sibling temp file and a rename."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
