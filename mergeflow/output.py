"""Atomic output: build the model in a hidden sibling directory and rename it into place at the end."""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mergeflow.errors import OutputError

STAGING_PREFIX = ".mergeflow-staging-"
TRASH_PREFIX = ".mergeflow-replaced-"


def check_target(target_dir: Path, *, overwrite: bool) -> None:
    """Refuse a target that exists and is not an empty directory, unless `overwrite` is set.

    Raises:
        OutputError: the target is a file, or a non-empty directory and overwrite is off.
    """
    target_dir = Path(target_dir)
    if target_dir.is_file():
        raise OutputError(f"target {target_dir} is a file, not a directory")
    if target_dir.is_dir() and any(target_dir.iterdir()) and not overwrite:
        raise OutputError(f"target directory {target_dir} is not empty: pass --overwrite to replace it")


@contextlib.contextmanager
def staged_output(target_dir: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a staging directory beside the target; on success it becomes the target, on failure it is removed.

    A merge that fails or is killed leaves the target as it was.
    """
    target_dir = Path(target_dir).absolute()
    check_target(target_dir, overwrite=overwrite)
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target_dir.name}-", dir=target_dir.parent))
    try:
        yield staging
        _replace(staging, target_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def resumable_staging(target_dir: Path, merge_key: str) -> Path:
    """The staging directory beside the target for one merge (named by its key); what an interrupted run
    of the same merge left there is kept, so shards already written need not be written again."""
    staging = staging_dir_of(target_dir, merge_key)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def staging_dir_of(target_dir: Path, merge_key: str) -> Path:
    """Where `resumable_staging` keeps one merge's staging directory (not created here)."""
    target_dir = Path(target_dir).absolute()
    return target_dir.parent / f"{STAGING_PREFIX}{target_dir.name}-{merge_key[:16]}"


def publish(staging: Path, target_dir: Path, *, overwrite: bool) -> None:
    """Rename a finished staging directory into place as the target, replacing the target only if allowed."""
    target_dir = Path(target_dir).absolute()
    check_target(target_dir, overwrite=overwrite)
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
