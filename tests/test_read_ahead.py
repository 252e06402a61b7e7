"""Read-ahead: checkpoint files reach the page cache while the block runs, and reading stops with it."""

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path

from mergeflow import pages
from mergeflow.read_ahead import read_ahead

FILE_BYTES = 8 * 1024 * 1024
WAIT_SECONDS = 10


def cold_file(path: Path) -> Path:
    """A file of random bytes, flushed and dropped from the page cache."""
    path.write_bytes(os.urandom(FILE_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return path


def cached(path: Path) -> bool:
    """Whether every page of the file is in the page cache (`mincore` on a mapping; reads nothing)."""
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
        try:
            return pages.in_page_cache(ctypes.addressof(view), len(mapping))
        finally:
            del view
            mapping.close()


def wait_until(condition, seconds: float = WAIT_SECONDS) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_files_are_in_the_page_cache_while_the_block_runs(tmp_path):
    files = [cold_file(tmp_path / "a.pt"), cold_file(tmp_path / "b.pt")]

    with read_ahead([str(path) for path in files]):
        assert wait_until(lambda: all(cached(path) for path in files))


def test_reading_ahead_stops_when_the_block_ends(tmp_path):
    with read_ahead([str(cold_file(tmp_path / "a.pt"))]):
        pass

    assert not any(thread.name == "mergeflow-read-ahead" for thread in threading.enumerate())


def test_a_missing_file_is_skipped(tmp_path):
    present = cold_file(tmp_path / "present.pt")

    with read_ahead([str(tmp_path / "missing.pt"), str(present)]):
        assert wait_until(lambda: cached(present))
