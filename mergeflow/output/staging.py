"""Atomic output: build the model in a hidden sibling directory and rename it into place at the end."""

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mergeflow.errors import OutputError
from mergeflow.run_layout import Protected, training_files_in

FILE_MODE = 0o666
"""Mode every output file is created with (the umask applies), as `open()` creates config.json."""
STAGING_PREFIX = ".mergeflow-staging-"
TRASH_PREFIX = ".mergeflow-replaced-"


def check_target(target_dir: Path, *, overwrite: bool, protected: Sequence[Protected] = ()) -> None:
    """Refuse a target that overlaps the training run, holds training files, or is not an empty directory
    (unless `overwrite` is set: earlier merge outputs and ordinary folders may then be replaced).

    Raises:
        OutputError: the target is, contains or lies inside a `protected` directory; it holds training
            checkpoint files (whatever `overwrite` says); it is a file; or it is not empty and overwrite is off.
    """
    target_dir = Path(target_dir)
    check_overlap(target_dir, protected)
    if target_dir.is_file():
        raise OutputError(f"target {target_dir} is a file, not a directory")
    if not (target_dir.is_dir() and any(target_dir.iterdir())):
        return
    training = training_files_in(target_dir)
    if training:
        shown = ", ".join(training[:3]) + (f" and {len(training) - 3} more" if len(training) > 3 else "")
        raise OutputError(
            f"target {target_dir} holds training checkpoint files ({shown}): mergeflow never replaces them, "
            "even with --overwrite",
            hint="choose another target directory",
        )
    if not overwrite:
        raise OutputError(f"target directory {target_dir} is not empty", hint="pass --overwrite to replace it")


def check_overlap(target_dir: Path, protected: Sequence[Protected]) -> None:
    """Refuse a target that is, contains or lies inside a protected directory (symlinks resolved).

    Raises:
        OutputError: naming the first protected directory it overlaps, and how.
    """
    target = Path(target_dir).resolve()
    for entry in protected:
        path = entry.path.resolve()
        if target == path:
            overlap = "is"
        elif path.is_relative_to(target):
            overlap = "contains"
        elif target.is_relative_to(path):
            overlap = "lies inside"
        else:
            continue
        raise OutputError(
            f"target {target_dir} {overlap} {entry.what} ({entry.path}): writing there could destroy what was trained",
            hint="choose a target directory outside the training run",
        )


def staging_dir_of(target_dir: Path, merge_key: str) -> Path:
    """Where one merge builds its model before it is renamed into place, named by the merge's key so that an
    interrupted run of the same merge resumes in it (not created here)."""
    target_dir = Path(target_dir).absolute()
    return target_dir.parent / f"{STAGING_PREFIX}{target_dir.name}-{merge_key[:16]}"


def publish(staging: Path, target_dir: Path, *, overwrite: bool, protected: Sequence[Protected] = ()) -> None:
    """Rename a finished staging directory into place as the target, replacing the target only if allowed."""
    target_dir = Path(target_dir).absolute()
    check_target(target_dir, overwrite=overwrite, protected=protected)
    _replace(staging, target_dir)


def _replace(staging: Path, target_dir: Path) -> None:
    os.chmod(staging, 0o755)
    _fsync_tree(staging)
    if not target_dir.exists():
        os.rename(staging, target_dir)
    elif not any(target_dir.iterdir()):
        target_dir.rmdir()
        os.rename(staging, target_dir)
    else:
        trash = Path(tempfile.mkdtemp(prefix=f"{TRASH_PREFIX}{target_dir.name}-", dir=target_dir.parent))
        os.rename(target_dir, trash / target_dir.name)
        os.rename(staging, target_dir)
        shutil.rmtree(trash, ignore_errors=True)
    _fsync_path(target_dir.parent)


def _fsync_tree(folder: Path) -> None:
    """Flush every file and directory under `folder` to the device, so that once the rename makes the
    model visible, a power loss cannot leave it with empty or partial files."""
    for path in sorted(folder.rglob("*"), key=lambda path: path.is_dir()):
        _fsync_path(path)
    _fsync_path(folder)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
