"""Replacing a stage's output directory without ever deleting what it must not.

A stage starts from an empty output directory, so an old one is deleted first. That is refused, with a message, when
the directory is (or contains) one of the stage's inputs, or the repo itself, or when it exists, is not empty and
holds nothing the stage writes (a mistyped path must not wipe somebody's folder).
Shared by the stages that replace their output directory (prepare, tokenize), each with its own inputs and markers.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from drafter_data.errors import StageError

REPO_ROOT = Path(__file__).resolve().parents[1]


def fresh_output_dir(out_dir: Path, key: str, protected: dict[str, Path], markers: tuple[str, ...]) -> Path:
    """Deletes out_dir if it is safe to (see the module doc), then creates it empty. `protected` names what must
    survive (e.g. {"the prompt file of source 'x'": path}); the working directory and the repo are always added;
    `markers` are glob patterns of files the stage writes there (e.g. "stats.json", "prompts-*.parquet")."""
    check_replaceable(out_dir, key, protected, markers)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    return out_dir


def check_replaceable(out_dir: Path, key: str, protected: dict[str, Path], markers: tuple[str, ...]) -> None:
    target = out_dir.resolve()
    always = {"the working directory": Path.cwd(), "the repo": REPO_ROOT}
    for what, path in {**protected, **always}.items():
        path = path.resolve()
        if target == path or target in path.parents:
            raise StageError(f"{key}={out_dir} {'is' if target == path else 'contains'} {what} ({path}); "
                             f"it would be deleted: choose another output directory")
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise StageError(f"{key}={out_dir} exists and is not a directory; remove it or choose another path")
    if out_dir.exists() and any(out_dir.iterdir()) and not any(any(out_dir.glob(m)) for m in markers):
        raise StageError(f"{key}={out_dir} is a directory with other files in it (none of {', '.join(markers)}): "
                         f"refusing to delete it; empty it or choose another output directory")
