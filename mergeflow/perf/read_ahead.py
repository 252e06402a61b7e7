"""Have the kernel read a checkpoint's files into the page cache while the merge is busy elsewhere (importing
torch, building a spec), so that its own reads later find them there.

Where the file's block device says how much one readahead request may cover (`read_ahead_kb`,
`max_sectors_kb` in sysfs), the files are hinted in requests of that size (POSIX_FADV_WILLNEED): the
kernel reads them asynchronously, many requests in flight, and copies nothing to this process.
Elsewhere, background threads read the files through one small reused buffer each, two files at a
time. It is only a hint: what is not read ahead, or is evicted before it is needed, is read from disk.

Two orders: before the merge is planned, whole files, each zip archive's metadata first (every record's
local header, and small records whole: what indexing a torch rank file reads), so the index does not wait
behind gigabytes of tensor data; once it is planned, the byte ranges of the tensors in the order the merge
reads them, so it finds each one read or in flight.
"""

import mmap
import os
import threading
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

REQUEST_BYTES = 16 * 1024 * 1024
"""One read: long enough that waiting for the GIL between reads costs little, short enough to stop promptly."""
MIN_HINT_BYTES = 256 * 1024
"""Hints smaller than this cost more in system calls than they save: read instead."""
STREAMS = 2
"""Files read at once, each by its own thread."""
MEMORY_SHARE = 4
"""Read ahead at most 1/MEMORY_SHARE of physical memory, so the cache never pushes out what it holds."""
HEADER_BYTES = 4096
"""What is read of a zip record's start: its local header (which gives where the data begins)."""
SMALL_RECORD_BYTES = 1024 * 1024
"""Zip records up to this size (a pickle, a format version, small tensors) are read whole with the metadata."""

ByteRange = tuple[str, int, int | None]
"""Bytes of one file to read ahead: (path, offset, length); None for the rest of the file."""


def whole_files(paths: Sequence[str]) -> tuple[ByteRange, ...]:
    return tuple((path, 0, None) for path in paths)


class ReadAhead:
    """A background read of byte ranges, in their order, until stopped or out of budget (whole files: the
    metadata of those that are zip archives first); STREAMS threads share the ranges out (every STREAMS-th to
    each) and the budget."""

    def __init__(self, ranges: Sequence[ByteRange]):
        self.ranges = tuple(ranges)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "ReadAhead":
        """Start reading (a second call while it runs does nothing)."""
        if not self.running:
            self._stop.clear()
            streams = max(1, min(STREAMS, len(self.ranges)))
            self._threads = [
                threading.Thread(
                    target=_read_ahead,
                    args=(self.ranges[first::streams], _budget_bytes() // streams, self._stop),
                    name="mergeflow-read-ahead",
                    daemon=True,
                )
                for first in range(streams)
            ]
            for thread in self._threads:
                thread.start()
        return self

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def stop(self) -> None:
        """End it now (hints still queued would hold up the reads of whoever reads the files next)."""
        self._stop.set()
        for thread in self._threads:
            thread.join()


def _read_ahead(ranges: tuple[ByteRange, ...], budget: int, stop: threading.Event) -> None:
    buffer = mmap.mmap(-1, REQUEST_BYTES)
    view = memoryview(buffer)
    try:
        with _OpenFiles() as files:
            metadata = [(path, offset, length) for path, _, to_end in ranges if to_end is None
                        for offset, length in _zip_metadata(path)]  # fmt: skip
            for path, offset, length in (*metadata, *ranges):
                if stop.is_set() or budget <= 0:
                    return
                opened = files.get(path)
                if opened is not None:
                    budget = _read_range(*opened, offset, length, view, budget, stop)
    finally:
        view.release()
        buffer.close()


class _OpenFiles(ExitStack):
    """Each file opened once (for reading, sequentially advised), with how much one hint of it reads; None for
    a file that cannot be opened."""

    def __init__(self):
        super().__init__()
        self._opened: dict[str, tuple[int, int] | None] = {}

    def get(self, path: str) -> tuple[int, int] | None:
        if path not in self._opened:
            self._opened[path] = self._open(path)
        return self._opened[path]

    def _open(self, path: str) -> tuple[int, int] | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        self.callback(os.close, fd)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd, _hint_bytes(fd)
        except OSError:
            return None


def _zip_metadata(path: str) -> Iterator[tuple[int, int]]:
    """(offset, length) of what indexing a zip archive reads besides its directory: every record's local
    header, and small records whole; nothing for a file that is not a zip archive."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (OSError, zipfile.BadZipFile):
        return
    for record in records:
        small = record.compress_size <= SMALL_RECORD_BYTES
        yield record.header_offset, HEADER_BYTES + (record.compress_size if small else 0)


def _read_range(
    fd: int, hint_bytes: int, offset: int, length: int | None, view: memoryview, budget: int, stop: threading.Event
) -> int:
    """Bring `length` bytes of the file at `offset` (to its end for None) into the page cache, until `stop` or
    the budget; returns the budget left."""
    try:
        end = os.fstat(fd).st_size if length is None else offset + length
        if hint_bytes >= MIN_HINT_BYTES:
            return _hint_range(fd, hint_bytes, offset, end, budget, stop)
        return _read_through(fd, view, offset, end, budget, stop)
    except OSError:
        return budget


def _hint_range(fd: int, hint_bytes: int, offset: int, end: int, budget: int, stop: threading.Event) -> int:
    """Ask the kernel to read the range ahead, `hint_bytes` per request (it returns once they are queued)."""
    while offset < end and not stop.is_set() and budget > 0:
        length = min(hint_bytes, end - offset)
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        offset += length
        budget -= length
    return budget


def _read_through(fd: int, view: memoryview, offset: int, end: int, budget: int, stop: threading.Event) -> int:
    while offset < end and not stop.is_set() and budget > 0:
        count = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
        if count == 0:
            break
        offset += count
        budget -= count
    return budget


def _hint_bytes(fd: int) -> int:
    """The most one POSIX_FADV_WILLNEED request reads of this file (after POSIX_FADV_SEQUENTIAL, which
    doubles the readahead window): the larger of the device's largest request and that window, as Linux
    caps it; 0 where the file's device does not say (no sysfs, not a block device)."""
    device = os.fstat(fd).st_dev
    block = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve()  # a partition: queue/ is its disk's
    queue = block / "queue" if (block / "queue").is_dir() else block.parent / "queue"
    try:
        window_kb = int((queue / "read_ahead_kb").read_text())
        request_kb = int((queue / "max_sectors_kb").read_text())
    except (OSError, ValueError):
        return 0
    return min(max(request_kb, 2 * window_kb) * 1024, REQUEST_BYTES)


def _budget_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // MEMORY_SHARE
    except (AttributeError, OSError, ValueError):
        return 0
