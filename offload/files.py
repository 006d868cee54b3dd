"""Checks of the files and directories a user names, shared by every layer (no
imports from the rest of offload)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["check_directory"]


def check_directory(path: Path, what: str) -> None:
    """Refuses a directory `path` (existing or to be created) that is, or would be
    created under, a file: `FileExistsError` naming `what` (the call or option), the
    file and the fix, where `mkdir` would name neither the file nor the fix."""
    for p in (path, *path.parents):
        if p.is_dir():
            return
        if p.exists() or p.is_symlink():
            raise FileExistsError(f"{what}: {p} is a file, not a directory; give a path "
                                  "under a directory")
