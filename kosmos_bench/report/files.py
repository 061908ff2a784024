"""Writing the report's outputs: a file's folders are created first, and an OSError of either becomes a one-line
``ReportError`` naming the path. Shared by render.py (reports, speedup charts, timelines) and train.py (training
reports and figures)."""

from __future__ import annotations

from pathlib import Path

from .schema import ReportError


def writing(path: Path, write):
    """``write()`` after creating the folders of ``path``; an OSError of either is a one-line ReportError naming
    the path."""
    make_folder(path)
    try:
        return write()
    except OSError as error:
        raise ReportError(f"cannot write {path}: {error.strerror or error}") from None


def make_folder(path: Path) -> None:
    """The folders above ``path`` (a one-line ReportError naming it when they cannot be made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        existing = next((folder for folder in path.parents if folder.exists()), None)
        why = f"{existing} is not a folder" if existing is not None and not existing.is_dir() else \
            f"cannot create its folder {path.parent} ({error.strerror or error})"
        raise ReportError(f"cannot write {path}: {why}") from None
