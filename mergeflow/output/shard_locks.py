"""The file locks that let several processes write the weight files of one staging folder: one lock per
file, taken by whoever writes it, and a writers' lock that a process writing ahead of the flow holds
shared, so that the flow, before it finishes the folder, waits for it and then closes the folder to it."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_SUFFIX = ".lock"
WRITERS_LOCK = f".mergeflow-writers{LOCK_SUFFIX}"


@contextlib.contextmanager
def file_lock(path: Path, operation: int) -> Iterator[None]:
    """`flock` `path` (created if missing) for the block."""
    with open(path, "a") as file:
        fcntl.flock(file, operation)
        yield


def open_to_writers(folder: Path) -> None:
    """Create `folder` and let processes write into it under `shard_writers` until `closed_to_writers`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WRITERS_LOCK).touch()


@contextlib.contextmanager
def shard_writers(folder: Path) -> Iterator[None]:
    """Held by a process that may still write weight files into `folder`.

    Raises:
        FileNotFoundError: the folder is gone, or was closed to writers: its files are final.
    """
    path = folder / WRITERS_LOCK
    with open(path) as file:
        fcntl.flock(file, fcntl.LOCK_SH)
        if os.fstat(file.fileno()).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(f"{folder} was closed to writers")
        yield


@contextlib.contextmanager
def closed_to_writers(folder: Path) -> Iterator[None]:
    """Wait for the processes in `shard_writers`, then keep any other from writing into `folder`."""
    path = folder / WRITERS_LOCK
    with file_lock(path, fcntl.LOCK_EX):
        path.unlink()
        yield
