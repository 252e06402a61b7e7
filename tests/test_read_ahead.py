"""Read-ahead: checkpoint files reach the page cache while it runs (a zip archive's metadata first, byte ranges in the
order given), and reading stops when it is stopped."""

import ctypes
import itertools
import mmap
import os
import threading
import time
import zipfile
from pathlib import Path

import torch

from mergeflow.perf import pages
from mergeflow.perf import read_ahead as read_ahead_module
from mergeflow.perf.read_ahead import ReadAhead, whole_files

FILE_BYTES = 8 * 1024 * 1024
HINT_BYTES = 1024 * 1024
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


def read_ahead_threads() -> int:
    return sum(thread.name == "mergeflow-read-ahead" for thread in threading.enumerate())


def hinted_requests(monkeypatch) -> list[tuple[int, int, int]]:
    """Every POSIX_FADV_WILLNEED request from here on, in order: (inode, offset, length)."""
    monkeypatch.setattr(read_ahead_module, "_hint_bytes", lambda fd: HINT_BYTES)
    hinted: list[tuple[int, int, int]] = []
    fadvise = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hinted.append((os.fstat(fd).st_ino, offset, length))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return hinted


def test_a_cold_file_is_not_in_the_page_cache(tmp_path):
    """What the other tests call cold really is: dropping a flushed file leaves none of it cached."""
    assert not cached(cold_file(tmp_path / "a.pt"))


def test_the_kernel_is_asked_to_read_every_byte_of_every_file(tmp_path, monkeypatch):
    """Where the device says how much a hint reads, every byte is hinted (whether the kernel reads a hint is
    its own choice: under memory pressure it drops them, so the test checks the requests, not the cache)."""
    hinted = hinted_requests(monkeypatch)
    files = [cold_file(tmp_path / "a.pt"), cold_file(tmp_path / "b.pt")]

    reading = ReadAhead(whole_files([str(path) for path in files])).start()
    assert wait_until(lambda: not reading.running)

    for path in files:
        requests = sorted((offset, length) for inode, offset, length in hinted if inode == path.stat().st_ino)
        assert requests[0][0] == 0
        assert all(offset == previous + length for (previous, length), (offset, _) in itertools.pairwise(requests))
        assert sum(requests[-1]) >= FILE_BYTES


def test_files_are_read_through_where_the_device_does_not_say_how_much_a_hint_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(read_ahead_module, "_hint_bytes", lambda fd: 0)
    files = [cold_file(tmp_path / "a.pt"), cold_file(tmp_path / "b.pt")]
    assert not any(cached(path) for path in files)

    reading = ReadAhead(whole_files([str(path) for path in files])).start()

    assert wait_until(lambda: all(cached(path) for path in files))
    reading.stop()


def test_stopping_ends_its_threads(tmp_path):
    reading = ReadAhead(whole_files([str(cold_file(tmp_path / name)) for name in ("a.pt", "b.pt", "c.pt")])).start()

    reading.stop()

    assert read_ahead_threads() == 0
    assert not reading.running


def test_a_missing_file_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(read_ahead_module, "_hint_bytes", lambda fd: 0)  # read through: the cache shows it
    present = cold_file(tmp_path / "present.pt")
    assert not cached(present)

    reading = ReadAhead(whole_files([str(tmp_path / "missing.pt"), str(present)])).start()

    assert wait_until(lambda: cached(present))
    reading.stop()


def test_a_second_start_while_it_runs_starts_nothing_more(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(read_ahead_module, "_read_ahead", lambda ranges, budget, stop: release.wait())
    reading = ReadAhead(whole_files([str(cold_file(tmp_path / "a.pt"))])).start()
    threads = read_ahead_threads()

    reading.start()

    assert read_ahead_threads() == threads == 1
    release.set()
    reading.stop()


def torch_saved_file(path: Path) -> Path:
    """A file as torch.save writes a rank's state: a zip archive of a pickle and one record per tensor."""
    torch.save({f"layer{i}.weight": torch.randn(512, 1024) for i in range(4)}, path)
    return path


def test_a_zip_archives_record_headers_are_asked_for_before_its_data(tmp_path, monkeypatch):
    """Indexing a rank file reads each record's local header: those come first, not after gigabytes of tensors."""
    hinted = hinted_requests(monkeypatch)
    path = torch_saved_file(tmp_path / "model_world_size_1_rank_0.pt")
    with zipfile.ZipFile(path) as archive:
        headers = [record.header_offset for record in archive.infolist()]

    reading = ReadAhead(whole_files([str(path)])).start()
    assert wait_until(lambda: not reading.running)

    assert [offset for _, offset, _ in hinted[: len(headers)]] == headers
    assert [offset for _, offset, _ in hinted[len(headers) :]] == list(range(0, path.stat().st_size, HINT_BYTES))


def test_byte_ranges_are_asked_for_in_the_order_given(tmp_path, monkeypatch):
    hinted = hinted_requests(monkeypatch)
    monkeypatch.setattr(read_ahead_module, "STREAMS", 1)
    first, second = cold_file(tmp_path / "a.pt"), cold_file(tmp_path / "b.pt")
    ranges = [(str(second), 3 * HINT_BYTES, HINT_BYTES), (str(first), HINT_BYTES, 2 * HINT_BYTES)]

    reading = ReadAhead(ranges).start()
    assert wait_until(lambda: not reading.running)

    inodes = {first.stat().st_ino: "a", second.stat().st_ino: "b"}
    assert [(inodes[inode], offset) for inode, offset, _ in hinted] == [("b", 3 * HINT_BYTES), ("a", HINT_BYTES), ("a", 2 * HINT_BYTES)]
