"""Read-ahead: checkpoint files reach the page cache while the block runs, and reading stops with it."""

import ctypes
import mmap
import os
import threading
import time
from pathlib import Path

from mergeflow.perf import pages
from mergeflow.perf import read_ahead as read_ahead_module
from mergeflow.perf.read_ahead import read_ahead, start_read_ahead, stop_read_ahead

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


def test_files_are_read_through_where_the_device_does_not_say_how_much_a_hint_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(read_ahead_module, "_hint_bytes", lambda fd: 0)
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


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_ahead_threads() -> int:
    return sum(thread.name == "mergeflow-read-ahead" for thread in threading.enumerate())


def test_a_started_read_ahead_reads_the_files_before_any_block(tmp_path):
    files = [cold_file(tmp_path / "a.pt"), cold_file(tmp_path / "b.pt")]

    start_read_ahead([str(path) for path in files])

    assert wait_until(lambda: all(cached(path) for path in files))
    with read_ahead([str(path) for path in files]):
        pass


def test_a_block_carries_on_the_read_ahead_started_for_its_files_instead_of_reading_them_again(tmp_path):
    path = cold_file(tmp_path / "a.pt")
    start_read_ahead([str(path)])
    assert wait_until(lambda: cached(path) and read_ahead_threads() == 0)
    evict(path)

    with read_ahead([str(path)]):
        time.sleep(0.2)
        assert not cached(path)


def test_a_started_read_ahead_ends_with_the_block_of_its_files(tmp_path):
    files = [str(cold_file(tmp_path / name)) for name in ("a.pt", "b.pt", "c.pt")]
    start_read_ahead(files)

    with read_ahead(files):
        pass

    assert read_ahead_threads() == 0


def test_a_stopped_read_ahead_ends_before_its_block(tmp_path):
    files = [str(cold_file(tmp_path / name)) for name in ("a.pt", "b.pt", "c.pt")]

    with read_ahead(files):
        stop_read_ahead(files)
        assert read_ahead_threads() == 0


def test_a_block_that_may_not_start_a_read_ahead_reads_nothing(tmp_path):
    path = cold_file(tmp_path / "a.pt")

    with read_ahead([str(path)], start=False):
        time.sleep(0.2)
        assert read_ahead_threads() == 0
        assert not cached(path)
